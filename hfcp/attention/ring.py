"""Ring attention: K/V blocks (KV heads only) travel the ring while the current block is computed.

Forward: step s computes the local queries against the K/V of rank (r - s) mod cp while the next block
is in flight. Backward: recompute per block from the saved merged out and lse; dQ stays local; dK/dV
accumulate in a buffer that travels with the K/V and arrives home after cp steps. The buffer arrives before the
step that adds to it (that transfer is not hidden behind the step's compute), so a rank holds one block of dK/dV,
not three (the one sent, the one received and the step's own): at a layer's backward, where a long step peaks.
No rank ever holds more than two K/V blocks.
"""
from __future__ import annotations

import torch

from ..distributed.collectives import RingComm, group_rank, group_size
from ..layout import StepBatch
from ..layout.masks import MaskSpec
from .tiles import backward_tiles, forward_tiles, new_accumulators, plan_tiles
from .kernels import acc_dtype
from .sinks import add_sink, sink_grad

KV_TAG, GRAD_TAG = 0, 1


def ring_forward(q, k, v, sb: StepBatch, spec: MaskSpec, scale: float, group, ranges_of=None):
    """Returns (out (B, H, L/cp, D), lse (B, H, L/cp)), both in acc_dtype, of the local queries against all keys.

    ranges_of(i): the global ranges that ring member i holds (default: the layout's ranges of CP rank i; usp
    passes the ranges of a whole Ulysses group)."""
    cp, rank = group_size(group), group_rank(group)
    ranges_of = ranges_of or sb.layout.ranges
    comm = RingComm(group, KV_TAG)
    out, lse = new_accumulators(q)  # (B, H, L/cp, D), (B, H, L/cp) in acc_dtype
    q_ranges = ranges_of(rank)
    kv = [k, v]
    for step in range(cp):
        if step + 1 < cp:
            comm.exchange(kv)
        owner = (rank - step) % cp
        tiles = plan_tiles(spec, sb, q_ranges, ranges_of(owner), q.dtype, q.device)
        forward_tiles(q, kv[0], kv[1], tiles, scale, out, lse)
        if step + 1 < cp:
            kv = comm.wait()
    return out, lse


def ring_backward(dout, q, k, v, out, lse, sb: StepBatch, spec: MaskSpec, scale: float, group, ranges_of=None):
    """Returns (dq, dk, dv) of the local q/k/v; dk/dv accumulate while travelling the ring with their block."""
    cp, rank = group_size(group), group_rank(group)
    ranges_of = ranges_of or sb.layout.ranges
    if cp == 1:  # a ring of one (usp with ulysses_size == cp): nothing travels
        tiles = plan_tiles(spec, sb, ranges_of(0), ranges_of(0), q.dtype, q.device)
        dq, dk, dv = (torch.zeros_like(t, dtype=acc_dtype(q.dtype)) for t in (q, k, v))
        backward_tiles(dout, q, k, v, out, lse, tiles, scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    kv_comm, grad_comm = RingComm(group, KV_TAG), RingComm(group, GRAD_TAG)
    q_ranges = ranges_of(rank)
    dq = torch.zeros_like(q, dtype=acc_dtype(q.dtype))
    kv = [k, v]
    for step in range(cp):
        if step + 1 < cp:
            kv_comm.exchange(kv)
        owner = (rank - step) % cp
        tiles = plan_tiles(spec, sb, q_ranges, ranges_of(owner), q.dtype, q.device)
        # the block's grads so far: what its earlier holders accumulated, received before this step's compute and
        # added to in place (one block of grads alive, not the one sent, the one received and a fresh one)
        dkv = grad_comm.wait() if step > 0 else [torch.zeros_like(t, dtype=acc_dtype(q.dtype)) for t in (k, v)]
        backward_tiles(dout, q, kv[0], kv[1], out, lse, tiles, scale, dq, *dkv)
        grad_comm.exchange(dkv)
        if step + 1 < cp:
            kv = kv_comm.wait()
    dk, dv = grad_comm.wait()  # our own block's grads, back home after cp hops
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, sb, spec, scale, group):
        out, lse = add_sink(*ring_forward(q, k, v, sb, spec, scale, group), sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (sb, spec, scale, group)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, sink_grad(dout, out, lse, sink), None, None, None, None


def ring_attention(q, k, v, sb: StepBatch, spec: MaskSpec, scale: float, group, sink=None) -> torch.Tensor:
    """q (B, H, L/cp, D), k/v (B, Hkv, L/cp, D) in the layout's local order, sink None or (H,) -> (B, H, L/cp, D)."""
    return RingAttention.apply(q, k, v, sink, sb, spec, scale, group)
