"""hfcp: make Hugging Face models context-parallel with one line.

The docs: docs/index.md; every public name: docs/reference/api.md.
"""
from .distributed.collectives import CollectiveError
from .distributed.data import average_gradients, data_parallel_rank_and_size
from .outputs import gather_outputs, gather_sequence, pool_sequence
from .api import patch, unpatch
from .report import balance_report, step_imbalance
from .state import cp_state
from .outputs.logps import SequenceLogps, sequence_logps
from .families.registry import Patcher, UnsupportedModelError, register_patcher, supported_model_types
from .pipelining import pipeline
from .planning import Plan, plan

from . import patches  # noqa: E402,F401  (registers the families; installed from the repo's patches/)

__all__ = [
    "patch", "unpatch", "gather_sequence", "pool_sequence", "gather_outputs", "cp_state", "data_parallel_rank_and_size",
    "average_gradients", "sequence_logps", "SequenceLogps", "balance_report", "step_imbalance",
    "UnsupportedModelError", "CollectiveError", "Patcher", "register_patcher", "supported_model_types", "pipeline",
    "plan", "Plan",
]
__version__ = "0.1.0"
