"""hfcp.pipeline: pipeline parallelism x context parallelism in one mesh, exact against one process
(docs/how-to/pipeline.md): the split into stages (split), each stage's layers and parameters (stage), the schedule
and the runner that drives it."""
from .runner import PipelineRunner
from .split import pipeline

__all__ = ["pipeline", "PipelineRunner"]
