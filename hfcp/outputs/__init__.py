"""What a user reads from a patched model: its local sequence outputs made whole (gather.py), vectors pooled over the
whole sequence (pooling.py), and per-sequence log-probabilities of the targets (logps.py, from the last hidden states
and the output head that head_input.py finds)."""
from .gather import gather_outputs, gather_sequence  # noqa: F401
from .pooling import pool_sequence  # noqa: F401
