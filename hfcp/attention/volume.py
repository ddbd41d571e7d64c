"""Bytes each rank sends per attention layer and training step (forward + backward), from the shapes, as hfcp's
strategies move them (NCCL's ring all-gather / reduce-scatter; gloo turns the reduce-scatter into an all-reduce,
twice as much). dK/dV accumulate in fp32, so the gradients that travel are 4 bytes an element."""
from __future__ import annotations

FP32 = 4


def comm_bytes(strategy: str, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, cp: int,
               ulysses_size: int | None = None, dtype_bytes: int = 2, recompute: bool = False) -> float:
    """Per-rank bytes sent by one attention layer in one training step.

    Args:
        strategy: "ring", "allgather", "ulysses" or "usp" (with ulysses_size, 1 <= u <= cp).
        dtype_bytes: bytes of an activation element (2 for bf16).
        recompute: the layer is checkpointed: its forward, exchanges included, runs again in backward.
    """
    kv = batch * kv_heads * (seq_len / cp) * head_dim  # elements of one local K (or V) block
    tokens = batch * (seq_len / cp) * head_dim  # elements per head of the local slice
    again = 1 if recompute else 0
    if strategy == "ring":
        return _ring(kv, cp, dtype_bytes, again)
    if strategy == "allgather":  # gather (again in the recompute), re-gather; reduce-scatter
        return (cp - 1) * 2 * kv * dtype_bytes * (2 + again) + (cp - 1) * 2 * kv * FP32
    if strategy == "ulysses":
        return _ulysses(tokens, heads, kv_heads, cp, dtype_bytes, again)
    if strategy == "usp":
        u = ulysses_size or 1
        # the all-to-all runs among u ranks on the local slice; the ring moves Ulysses-group blocks of
        # (kv_heads / u) heads x (u * L / cp) tokens: as many elements as a ring block
        return _ulysses(tokens, heads, kv_heads, u, dtype_bytes, again) + _ring(kv, cp // u, dtype_bytes, again)
    raise ValueError(f"strategy={strategy!r} is not one of ['allgather', 'ring', 'ulysses', 'usp']")


def _ring(kv: float, ring: int, e: int, again: int = 0) -> float:
    if ring == 1:
        return 0.0
    # K/V forward (again in the recompute) and backward; dK/dV travel home
    return (ring - 1) * 2 * kv * e * (2 + again) + ring * 2 * kv * FP32


def _ulysses(tokens: float, heads: int, kv_heads: int, u: int, e: int, again: int = 0) -> float:
    share = (u - 1) / u  # what leaves the rank in an all-to-all
    qkv, out = (heads + 2 * kv_heads) * tokens, heads * tokens
    return share * (qkv + out) * e * (2 + again)  # q/k/v and the output forward (again); dout and dq/dk/dv backward


def _runs(zigzag: bool) -> int:
    return 2 if zigzag else 1  # runs of consecutive tokens per rank


def conv_halo_bytes(batch: int, channels: int, kernel: int, cp: int, zigzag: bool = True,
                    dtype_bytes: int = 2) -> float:
    """Per-rank bytes sent by one causal convolution layer (hfcp/mixers/conv_halo.py) in one training step: the last
    kernel-1 inputs of each run, all-gathered forward, their gradient reduce-scattered backward. Independent of the
    sequence length."""
    piece = _runs(zigzag) * (kernel - 1) * channels * batch
    return 2 * (cp - 1) * piece * dtype_bytes


def state_fold_bytes(batch: int, heads: int, key_dim: int, value_dim: int, cp: int, zigzag: bool = True) -> float:
    """Per-rank bytes sent by one delta-rule layer (hfcp/mixers/state_fold.py) in one training step: each run's final
    state and transition, [S_loc | M] (heads x key_dim x (value_dim + key_dim), fp32), all-gathered forward, their
    gradient reduce-scattered backward. Independent of the sequence length."""
    piece = _runs(zigzag) * batch * heads * key_dim * (value_dim + key_dim)
    return 2 * (cp - 1) * piece * FP32


def scalar_fold_bytes(batch: int, heads: int, head_dim: int, state: int, cp: int, zigzag: bool = True) -> float:
    """Per-rank bytes sent by one Mamba-2 layer's scan (hfcp/mixers/state_fold.py, a scalar decay per head) in one
    training step: each run's final state (heads x head_dim x state, fp32) and total log decay (one per head),
    all-gathered forward, their gradient reduce-scattered backward. Independent of the sequence length."""
    piece = _runs(zigzag) * batch * heads * (head_dim * state + 1)
    return 2 * (cp - 1) * piece * FP32


def channel_fold_bytes(batch: int, channels: int, state: int, cp: int, zigzag: bool = True) -> float:
    """Per-rank bytes sent by one Mamba 1 layer's scan (hfcp/mixers/state_fold.py, a decay per channel and state index)
    in one training step: each run's final state (channels x state, fp32) and total step per channel, all-gathered
    forward, their gradient reduce-scattered backward. Independent of the sequence length."""
    piece = _runs(zigzag) * batch * channels * (state + 1)
    return 2 * (cp - 1) * piece * FP32
