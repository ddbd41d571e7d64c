"""All-gather attention: gather K/V (KV heads only) from the CP group, attend locally, and in backward
re-gather K/V and reduce-scatter dK/dV to their owners. Simple and robust; holds all K/V of the
sequence for one layer at a time (use `ring` when that does not fit)."""
from __future__ import annotations

import torch

from ..distributed.collectives import all_gather_no_grad, group_rank, reduce_scatter_sum
from ..layout import StepBatch
from ..layout.masks import MaskSpec
from .tiles import backward_tiles, forward_tiles, new_accumulators, plan_tiles
from .kernels import acc_dtype
from .sinks import add_sink, sink_grad


def _gather_kv(k, v, group):  # gathered in (B, L, Hkv, D) memory, the layout the kernels prefer (see kernels)
    kv = all_gather_no_grad(torch.stack([k.transpose(1, 2), v.transpose(1, 2)]), group, dim=2)  # (2, B, L, Hkv, D)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (B, Hkv, L, D) views, rank order


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, sb, spec, scale, group):
        rank = group_rank(group)
        k_all, v_all = _gather_kv(k, v, group)
        tiles = plan_tiles(spec, sb, sb.layout.ranges(rank), sb.layout.all_ranges(), q.dtype, q.device)
        out, lse = new_accumulators(q)
        forward_tiles(q, k_all, v_all, tiles, scale, out, lse)
        out, lse = add_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)  # local K/V only: re-gathered in backward
        ctx.args = (sb, spec, scale, group)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        sb, spec, scale, group = ctx.args
        rank = group_rank(group)
        k_all, v_all = _gather_kv(k, v, group)
        tiles = plan_tiles(spec, sb, sb.layout.ranges(rank), sb.layout.all_ranges(), q.dtype, q.device)
        dq = torch.zeros_like(q, dtype=acc_dtype(q.dtype))
        dk_all = torch.zeros_like(k_all, dtype=acc_dtype(q.dtype))
        dv_all = torch.zeros_like(v_all, dtype=acc_dtype(q.dtype))
        backward_tiles(dout, q, k_all, v_all, out, lse, tiles, scale, dq, dk_all, dv_all)
        dkv = reduce_scatter_sum(torch.stack([dk_all.transpose(1, 2), dv_all.transpose(1, 2)]), group, dim=2)
        dk, dv = (g.transpose(1, 2).to(t.dtype) for g, t in ((dkv[0], k), (dkv[1], v)))  # (B, Hkv, L/cp, D)
        return dq.to(q.dtype), dk, dv, sink_grad(dout, out, lse, sink), None, None, None, None


def allgather_attention(q, k, v, sb: StepBatch, spec: MaskSpec, scale: float, group, sink=None) -> torch.Tensor:
    """q (B, H, L/cp, D), k/v (B, Hkv, L/cp, D) in the layout's local order, sink None or (H,) -> (B, H, L/cp, D)."""
    return AllGatherAttention.apply(q, k, v, sink, sb, spec, scale, group)
