"""Ulysses attention: all-to-all from (all heads, local sequence) to (heads/cp, whole sequence), attend
locally, all-to-all back. Needs num_heads and num_kv_heads divisible by cp."""
from __future__ import annotations

import torch

from ..collectives import all_to_all, group_size
from ..layout import StepBatch
from .blocks import MaskSpec, backward_tiles, forward_tiles, new_accumulators, plan_tiles


def check_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """Raises ValueError unless both head counts divide by cp."""
    if num_heads % cp or num_kv_heads % cp:
        raise ValueError(
            f"strategy='ulysses' splits attention heads over the CP group, but num_attention_heads={num_heads} "
            f"and num_key_value_heads={num_kv_heads} are not both divisible by cp_size={cp}; "
            "use strategy='ring' or 'allgather', or a cp_size that divides both"
        )


def _to_heads(x, group):  # (B, H, L/cp, D) -> (B, H/cp, L, D)
    return all_to_all(x, group, scatter_dim=1, gather_dim=2)


def _to_sequence(x, group):  # (B, H/cp, L, D) -> (B, H, L/cp, D)
    return all_to_all(x, group, scatter_dim=2, gather_dim=1)



class UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sb, spec, scale, group):
        cp = group_size(group)
        check_heads(q.shape[1], k.shape[1], cp)
        qf, kf, vf = (_to_heads(t, group) for t in (q, k, v))
        ranges = sb.layout.all_ranges()
        tiles = plan_tiles(spec, sb, ranges, ranges, q.dtype, q.device)
        out_f, lse_f = new_accumulators(qf)
        forward_tiles(qf, kf, vf, tiles, scale, out_f, lse_f)
        out_f = out_f.to(q.dtype)
        ctx.save_for_backward(qf, kf, vf, out_f, lse_f)
        ctx.args = (sb, spec, scale, group)
        return _to_sequence(out_f, group)

    @staticmethod
    def backward(ctx, dout):
        qf, kf, vf, out_f, lse_f = ctx.saved_tensors
        sb, spec, scale, group = ctx.args
        ranges = sb.layout.all_ranges()
        tiles = plan_tiles(spec, sb, ranges, ranges, qf.dtype, qf.device)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (qf, kf, vf))
        backward_tiles(_to_heads(dout.contiguous(), group), qf, kf, vf, out_f, lse_f, tiles, scale, dq, dk, dv)
        grads = (_to_sequence(g.to(t.dtype), group) for g, t in ((dq, qf), (dk, kf), (dv, vf)))
        return (*grads, None, None, None, None)


def ulysses_attention(q, k, v, sb: StepBatch, spec: MaskSpec, scale: float, group) -> torch.Tensor:
    """q (B, H, L/cp, D), k/v (B, Hkv, L/cp, D) in the layout's local order -> out (B, H, L/cp, D)."""
    return UlyssesAttention.apply(q, k, v, sb, spec, scale, group)
