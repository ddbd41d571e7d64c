"""Where each token lives: padding to a multiple, zigzag (head-tail) or contiguous split, global indices.

A `Layout` is pure arithmetic on lengths; `StepBatch` adds the per-step token metadata (document ids from
position_ids resets, key padding) that attention masks read. Every rank holds the full batch, so each
rank can compute the metadata of every global token without communication.
"""
from .ranges import Layout, Range, check_plan, pad_to  # noqa: F401
from .step_batch import StepBatch, build_step_batch, document_ids  # noqa: F401
