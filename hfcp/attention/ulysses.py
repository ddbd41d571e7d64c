"""Ulysses attention: all-to-all from (all heads, local sequence) to (heads/cp, whole sequence), attend
locally, all-to-all back. Needs num_heads and num_kv_heads divisible by cp."""
from __future__ import annotations

import torch

from ..distributed.collectives import all_to_all_heads, all_to_all_sequence, group_rank, group_size
from ..layout import StepBatch
from ..layout.masks import MaskSpec
from .tiles import backward_tiles, forward_tiles, new_accumulators, plan_tiles
from .kernels import acc_dtype
from .sinks import add_sink, head_group, head_group_sink_grad


def check_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """Raises ValueError unless both head counts divide by cp."""
    if num_heads % cp or num_kv_heads % cp:
        raise ValueError(
            f"strategy='ulysses' splits attention heads over the CP group, but num_attention_heads={num_heads} "
            f"and num_key_value_heads={num_kv_heads} are not both divisible by cp_size={cp}; "
            "use strategy='ring' or 'allgather', or a cp_size that divides both"
        )


def natural(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D) reordered along L by `index`, in (B, L, H, D) memory (the kernels' preferred layout)."""
    return x.transpose(1, 2).index_select(1, index).transpose(1, 2)


class UlyssesAttention(torch.autograd.Function):
    """After the all-to-all every rank holds the whole sequence for its heads; it is put in natural (global)
    order first, so a plain causal mask is a single kernel call instead of merged zigzag blocks."""

    @staticmethod
    def forward(ctx, q, k, v, sink, sb, spec, scale, group):
        cp = group_size(group)
        check_heads(q.shape[1], k.shape[1], cp)
        order = sb.layout.gathered_order(q.device)  # global index of each gathered position
        inverse = sb.layout.gathered_inverse(q.device, keep_padding=True)  # gathered position of each global index
        qn, kn, vn = (natural(t, inverse) for t in all_to_all_heads([q, k, v], group))  # (B, H/cp, L, D) natural
        whole = [(0, sb.layout.padded_len)]
        tiles = plan_tiles(spec, sb, whole, whole, q.dtype, q.device)
        out_n, lse_n = new_accumulators(qn)
        forward_tiles(qn, kn, vn, tiles, scale, out_n, lse_n)
        out_n, lse_n = add_sink(out_n, lse_n, head_group(sink, cp, group_rank(group)))  # this rank's heads
        out_n = out_n.to(q.dtype)
        ctx.save_for_backward(qn, kn, vn, out_n, lse_n, order, inverse, sink)
        ctx.args = (sb, spec, scale, group)
        return all_to_all_sequence([natural(out_n, order)], group)[0]

    @staticmethod
    def backward(ctx, dout):
        qn, kn, vn, out_n, lse_n, order, inverse, sink = ctx.saved_tensors
        sb, spec, scale, group = ctx.args
        whole = [(0, sb.layout.padded_len)]
        tiles = plan_tiles(spec, sb, whole, whole, qn.dtype, qn.device)
        dq, dk, dv = (torch.zeros_like(t, dtype=acc_dtype(t.dtype)) for t in (qn, kn, vn))
        dout_n = natural(all_to_all_heads([dout], group)[0], inverse)
        backward_tiles(dout_n, qn, kn, vn, out_n, lse_n, tiles, scale, dq, dk, dv)
        grads = all_to_all_sequence([natural(g.to(t.dtype), order) for g, t in ((dq, qn), (dk, kn), (dv, vn))], group)
        dsink = head_group_sink_grad(dout_n, out_n, lse_n, sink, group_size(group), group_rank(group))
        return (*grads, dsink, None, None, None, None)


def ulysses_attention(q, k, v, sb: StepBatch, spec: MaskSpec, scale: float, group, sink=None) -> torch.Tensor:
    """q (B, H, L/cp, D), k/v (B, Hkv, L/cp, D) in the layout's local order, sink None or (H,) -> (B, H, L/cp, D)."""
    return UlyssesAttention.apply(q, k, v, sink, sb, spec, scale, group)
