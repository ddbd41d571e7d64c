"""Bytes each rank sends per training step in each dimension of a dp_replicate x dp_shard x cp x tp layout, from
the shapes (textbook ring collectives: an all-gather or reduce-scatter over n ranks sends (n-1)/n of the whole, an
all-reduce twice that). What each dimension moves:

- cp: hfcp's attention exchange (`comm_bytes`), per layer, over the heads of one TP rank;
- tp: transformers' plan (q/k/v, gate/up column-wise, o/down row-wise): an all-reduce of the local activations
  (batch x L/cp x hidden) after each row-wise layer forward and before each column-wise one backward, 4 per layer;
- dp_shard (FSDP2 over dp_shard x cp, every rank of both): the parameters of a TP rank all-gathered in forward and
  again in backward, their gradients reduce-scattered;
- dp_replicate (HSDP's replicas): each rank's gradient shard all-reduced.
"""
from __future__ import annotations

from .volume import comm_bytes


def layout_bytes(params: float, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, seq_len: int,
                 batch: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1,
                 strategy: str = "ring", ulysses_size: int | None = None, dtype_bytes: int = 2) -> dict[str, float]:
    """Per-rank bytes sent in one training step (forward + backward) of a full fine-tune, by dimension.

    Args:
        params: the model's parameter count (all of them, before any sharding).
        heads, kv_heads: the model's; each TP rank holds 1/tp of them.
        seq_len: tokens of one sequence, split over cp.
        dtype_bytes: bytes of an activation, parameter and gradient element (2: bf16).
    Returns:
        {"cp": ..., "tp": ..., "dp_shard": ..., "dp_replicate": ...}: bytes sent by one rank.
    Raises:
        ValueError: tp that does not divide both head counts.
    """
    if heads % tp or kv_heads % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads}")
    cp_bytes = layers * comm_bytes(strategy, batch, seq_len, heads // tp, kv_heads // tp, head_dim, cp,
                                   ulysses_size, dtype_bytes) if cp > 1 else 0.0
    activation = batch * (seq_len / cp) * hidden * dtype_bytes
    tp_bytes = layers * 4 * 2 * (tp - 1) / tp * activation
    shard = dp_shard * cp  # FSDP2 shards over dp_shard x cp
    local = params / tp * dtype_bytes  # what one TP rank's parameters weigh, before FSDP
    fsdp_bytes = 3 * (shard - 1) / shard * local  # all-gather forward, all-gather backward, reduce-scatter
    replicate_bytes = 2 * (dp_replicate - 1) / dp_replicate * local / shard
    return {"cp": cp_bytes, "tp": tp_bytes, "dp_shard": fsdp_bytes, "dp_replicate": replicate_bytes}
