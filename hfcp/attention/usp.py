"""USP: Ulysses inside groups of consecutive ranks, ring across those groups.

A CP group of cp ranks splits into cp/u Ulysses groups of u consecutive ranks. The all-to-all inside a Ulysses
group turns (all heads, own tokens) into (H/u heads, the tokens of the whole Ulysses group); those blocks then
travel a ring over the ranks with the same position in every Ulysses group, as the plain ring does; a second
all-to-all brings (all heads, own tokens) back. cp can so exceed the KV-head count, and the all-to-all stays
among consecutive ranks (within a node, where bandwidth is highest). u = cp is Ulysses, u = 1 is the ring.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed.collectives import all_to_all_heads, all_to_all_sequence, group_rank
from ..layout import StepBatch
from ..layout.masks import MaskSpec
from .ring import ring_backward, ring_forward
from .sinks import add_sink, head_group, head_group_sink_grad


@dataclass(frozen=True)
class UspGroups:
    """The two sub-groups of this rank's CP group."""

    ulysses: object  # u consecutive ranks: the all-to-all
    ring: object  # cp/u ranks, one per Ulysses group: the ring
    ulysses_size: int


def check_ulysses_size(ulysses_size, cp: int, num_heads: int, num_kv_heads: int) -> int:
    """The Ulysses group size: `ulysses_size`, or (None) the largest divisor of cp dividing both head counts.

    Raises:
        ValueError: a size that is not a positive divisor of cp, or does not divide both head counts.
    """
    good = [u for u in range(1, cp + 1) if cp % u == 0 and num_heads % u == 0 and num_kv_heads % u == 0]
    if ulysses_size is None:
        return good[-1]
    if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size not in good:
        raise ValueError(f"ulysses_size={ulysses_size!r} must divide cp_size={cp}, num_attention_heads={num_heads} "
                         f"and num_key_value_heads={num_kv_heads}; choose one of {good}")
    return ulysses_size


def build_usp_groups(cp_groups, ulysses_size: int, timeout=None) -> UspGroups:
    """Every rank creates every sub-group of every CP group, in the same order (new_group is collective).

    cp_groups: the global ranks of every CP group of the world (`Mesh.cp_groups`)."""
    me = dist.get_rank()
    mine = {}
    kw = {"timeout": timeout} if timeout is not None else {}
    for ranks_of_cp in cp_groups:
        for j in range(len(ranks_of_cp) // ulysses_size):
            ranks = list(ranks_of_cp[j * ulysses_size:(j + 1) * ulysses_size])
            group = dist.new_group(ranks, **kw)
            if me in ranks:
                mine["ulysses"] = group
        for i in range(ulysses_size):
            ranks = list(ranks_of_cp[i::ulysses_size])
            group = dist.new_group(ranks, **kw)
            if me in ranks:
                mine["ring"] = group
    return UspGroups(mine["ulysses"], mine["ring"], ulysses_size)


def _ranges_of(sb: StepBatch, u: int):
    """Ring member j holds the tokens of Ulysses group j: CP ranks j*u .. j*u+u-1, in the all-to-all's order."""
    return lambda j: tuple(r for m in range(u) for r in sb.layout.ranges(j * u + m))


class UspAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, sb, spec, scale, groups: UspGroups):
        u = groups.ulysses_size
        qh, kh, vh = all_to_all_heads([q, k, v], groups.ulysses)  # (B, H/u, u*L/cp, D)
        out, lse = ring_forward(qh, kh, vh, sb, spec, scale, groups.ring, _ranges_of(sb, u))
        out, lse = add_sink(out, lse, head_group(sink, u, group_rank(groups.ulysses)))  # this rank's heads
        out = out.to(q.dtype)
        ctx.save_for_backward(qh, kh, vh, out, lse, sink)
        ctx.args = (sb, spec, scale, groups)
        return all_to_all_sequence([out], groups.ulysses)[0]

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, out, lse, sink = ctx.saved_tensors
        sb, spec, scale, groups = ctx.args
        u = groups.ulysses_size
        dout_h = all_to_all_heads([dout], groups.ulysses)[0]
        grads = ring_backward(dout_h, qh, kh, vh, out, lse, sb, spec, scale, groups.ring, _ranges_of(sb, u))
        dq, dk, dv = all_to_all_sequence(list(grads), groups.ulysses)
        dsink = head_group_sink_grad(dout_h, out, lse, sink, u, group_rank(groups.ulysses))  # its ring's queries
        return dq, dk, dv, dsink, None, None, None, None


def usp_attention(q, k, v, sb: StepBatch, spec: MaskSpec, scale: float, groups: UspGroups, sink=None):
    """q (B, H, L/cp, D), k/v (B, Hkv, L/cp, D) in the layout's local order, sink None or (H,) -> (B, H, L/cp, D)."""
    return UspAttention.apply(q, k, v, sink, sb, spec, scale, groups)
