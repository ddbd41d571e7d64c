"""Block-sparse local attention over global index ranges: plan, forward, backward.

Every mask is a predicate on global token indices (causal, sliding window, same document, same attention chunk,
valid key, and bidirectional blocks OR-ed with causality: a query also sees the later keys of its image block).
For each (query range, key range) pair the planner decides skip / full / causal-diagonal / partial;
only partial tiles get a mask, and a partial tile larger than MAX_TILE x MAX_TILE is split first, so no
mask larger than a tile is ever built. Plans are cached on the step's `StepBatch` and reused by every
layer of the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import StepBatch
from ..layout.masks import MaskSpec, chunk_ids
from .cuda_kernels import aligned_mask
from .kernels import NEG_INF, acc_dtype, has_fused_kernel, kernel_backward, kernel_forward, lse_for_backward, merge_into

MAX_TILE = 1024
KERNEL_TILE = 2048  # queries and keys of the largest kernel call (see kernel_pieces)


def _groups(spec: MaskSpec, sb: StepBatch) -> list[torch.Tensor]:
    """(B, padded_len) non-decreasing group ids a query and its keys must share: documents, attention chunks."""
    groups = [sb.doc_ids] if sb.doc_ids is not None else []
    if spec.chunk is not None:
        key = ("chunk ids", spec.chunk)
        if key not in sb.plans:
            sb.plans[key] = chunk_ids(sb, spec.chunk)
        groups.append(sb.plans[key])
    return groups


@dataclass
class Tile:
    q_off: int
    q_len: int
    k_off: int
    k_len: int
    is_causal: bool = False
    mask: torch.Tensor | None = None  # (B or 1, 1, q_len, k_len) additive, in the query dtype
    softcap: float | None = None
    empty_rows: torch.Tensor | None = None  # (B or 1, 1, q_len) bool: rows with no allowed key in this tile


def coalesce(ranges) -> list[tuple[int, int, int]]:
    """(global start, length) ranges in tensor order -> (global start, length, local offset), adjacent ones merged."""
    out, off = [], 0
    for start, n in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            s, m, o = out[-1]
            out[-1] = (s, m + n, o)
        else:
            out.append((start, n, off))
        off += n
    return out


def _blocks_meet(sb: StepBatch, qs: int, qe: int, ks: int, ke: int) -> bool:
    """Whether some row may have a bidirectional block with tokens in both ranges (conservative: the ranges' block
    id intervals overlap; exact for ids that grow along the row, as transformers numbers images)."""
    q, k = sb.blocks[:, qs : qe + 1], sb.blocks[:, ks : ke + 1]
    big = torch.iinfo(q.dtype).max
    lo = torch.maximum(torch.where(q >= 0, q, big).amin(-1), torch.where(k >= 0, k, big).amin(-1))
    return bool((lo <= torch.minimum(q.amax(-1), k.amax(-1))).any())


def _classify(spec: MaskSpec, sb: StepBatch, qs: int, ql: int, ks: int, kl: int) -> tuple[str, bool]:
    """Returns (kind, only_causal): kind in skip / full / partial; only_causal when causality alone is partial."""
    qe, ke = qs + ql - 1, ks + kl - 1
    causal_partial = False
    other_partial = False
    blocks = spec.blocks is not None and sb.blocks is not None and _blocks_meet(sb, qs, qe, ks, ke)
    whole = blocks and spec.blocks == "whole"  # a block's keys are seen beyond the window too
    if spec.causal:
        if qe < ks and not blocks:
            return "skip", False
        causal_partial = qs < ke
    if spec.window is not None:
        if qs - ke >= spec.window and not whole:
            return "skip", False
        other_partial |= qe - ks >= spec.window
    other_partial |= blocks and ((spec.causal and qs < ke) or (whole and qe - ks >= spec.window))
    for d in _groups(spec, sb):
        dq0, dq1, dk0, dk1 = d[:, qs], d[:, qe], d[:, ks], d[:, ke]
        if bool(((dq1 < dk0) | (dk1 < dq0)).all()):
            return "skip", False
        other_partial |= not bool(((dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0)).all())
    if sb.key_valid is not None:
        kv = sb.key_valid[:, ks : ke + 1]
        if not bool(kv.any()):
            return "skip", False
        other_partial |= not bool(kv.all())
    if not (causal_partial or other_partial):
        return "full", False
    return "partial", causal_partial and not other_partial


def _allowed(spec: MaskSpec, sb: StepBatch, qs: int, ql: int, ks: int, kl: int, device) -> torch.Tensor:
    """(B or 1, 1, ql, kl) bool: which keys each query may see."""
    qi = torch.arange(qs, qs + ql, device=device)[:, None]
    ki = torch.arange(ks, ks + kl, device=device)[None, :]
    causal = ki <= qi if spec.causal else torch.ones(ql, kl, dtype=torch.bool, device=device)
    window = (qi - ki) < spec.window if spec.window is not None else None
    if spec.blocks is not None and sb.blocks is not None:
        bq, bk = sb.blocks[:, qs : qs + ql, None].to(device), sb.blocks[:, None, ks : ks + kl].to(device)
        block = (bq == bk) & (bq >= 0)  # (B, ql, kl): the same bidirectional block
        if spec.blocks == "whole" or window is None:
            allowed = ((causal & window) if window is not None else causal) | block
        else:
            allowed = (causal | block) & window
        allowed = allowed[:, None]
    else:
        allowed = (causal & window if window is not None else causal)[None, None]
    for d in _groups(spec, sb):
        allowed = allowed & (d[:, qs : qs + ql, None] == d[:, None, ks : ks + kl])[:, None].to(device)
    if sb.key_valid is not None:
        allowed = allowed & sb.key_valid[:, None, None, ks : ks + kl]
    return allowed


def _plan_pair(spec, sb, q, k, dtype, device, tiles) -> None:
    (qs, ql, qo), (ks, kl, ko) = q, k
    kind, only_causal = _classify(spec, sb, qs, ql, ks, kl)
    if kind == "skip":
        return
    big = ql * kl > MAX_TILE * MAX_TILE
    fused = fused_for(spec, device, dtype)  # a fused kernel tiles internally; the math kernel needs small tiles
    cap = spec.softcap
    if kind == "full" and (fused or not big):
        tiles.append(Tile(qo, ql, ko, kl, softcap=cap))
        return
    if only_causal and qs == ks and ql == kl and (fused or not big):
        tiles.append(Tile(qo, ql, ko, kl, is_causal=True, softcap=cap))
        return
    if big:  # split the longer side and classify the halves again
        if ql >= kl:
            h = ql // 2
            _plan_pair(spec, sb, (qs, h, qo), k, dtype, device, tiles)
            _plan_pair(spec, sb, (qs + h, ql - h, qo + h), k, dtype, device, tiles)
        else:
            h = kl // 2
            _plan_pair(spec, sb, q, (ks, h, ko), dtype, device, tiles)
            _plan_pair(spec, sb, q, (ks + h, kl - h, ko + h), dtype, device, tiles)
        return
    # (the meta device, hfcp's dry run: the mask is made on the host, where its values are, then taken there)
    where = torch.device("cpu") if device.type == "meta" else device
    allowed = _allowed(spec, sb, qs, ql, ks, kl, where)
    empty = ~allowed.any(-1)  # (B or 1, 1, ql)
    if bool(empty.all()):
        return
    if allowed.device.type == "cuda":  # rows aligned for the memory-efficient kernel, built once per step
        mask = aligned_mask(allowed, dtype)
    else:
        mask = torch.zeros(allowed.shape, dtype=dtype, device=where).masked_fill_(~allowed, NEG_INF).to(device)
        empty = empty.to(device)
    tiles.append(Tile(qo, ql, ko, kl, mask=mask, empty_rows=empty if bool(empty.any()) else None, softcap=cap))


def _causal_in_tensor_order(spec: MaskSpec, sb: StepBatch, ranges) -> bool:
    """Whether queries and keys at the same ascending `ranges` see exactly a causal mask in tensor order
    (no window, document or padding boundary inside): then one causal kernel call covers them all."""
    starts = [s for s, _ in ranges]
    if not spec.causal or starts != sorted(starts) or (spec.blocks is not None and sb.blocks is not None):
        return False
    if spec.window is not None and spec.window < sb.layout.padded_len:
        return False
    lo, hi = ranges[0][0], ranges[-1][0] + ranges[-1][1] - 1
    if any(not bool((d[:, lo] == d[:, hi]).all()) for d in _groups(spec, sb)):
        return False
    return sb.key_valid is None or all(bool(sb.key_valid[:, s : s + n].all()) for s, n in ranges)


def plan_tiles(spec: MaskSpec, sb: StepBatch, q_ranges, k_ranges, dtype, device) -> list[Tile]:
    """Tiles of work for queries at global `q_ranges` against keys at `k_ranges` (both in tensor order)."""
    key = (spec, tuple(q_ranges), tuple(k_ranges), dtype, str(device))
    tiles = sb.plans.get(key)
    if tiles is None and tuple(q_ranges) == tuple(k_ranges) and fused_for(spec, device, dtype) \
            and _causal_in_tensor_order(spec, sb, q_ranges):  # e.g. a ring's own zigzag chunks
        n = sum(length for _, length in q_ranges)
        tiles = sb.plans[key] = [Tile(0, n, 0, n, is_causal=True)]
    if tiles is None:
        tiles = []
        for q in coalesce(q_ranges):
            for k in coalesce(k_ranges):
                _plan_pair(spec, sb, q, k, dtype, device, tiles)
        sb.plans[key] = tiles
    return tiles


def fused_for(spec: MaskSpec, device, dtype) -> bool:
    """Whether this spec's tiles run on a fused kernel (none implements a softcap: the math kernel does)."""
    return spec.softcap is None and has_fused_kernel(device, dtype)


def kernel_pieces(t: Tile) -> list[Tile]:
    """A tile without a mask cut into kernel calls of at most KERNEL_TILE queries x KERNEL_TILE keys: a causal
    (square) tile into full pieces below its diagonal and causal squares on it. A kernel call returns whole tensors
    for its queries and keys (forward: the block's output, merged into the accumulators after; backward: dq, dk and
    dv, added after); in pieces those temporaries are a fixed size, not the rank's whole block. Masked tiles are at
    most MAX_TILE x MAX_TILE already."""
    n = KERNEL_TILE
    if t.mask is not None or (t.q_len <= n and t.k_len <= n):
        return [t]
    pieces = []
    for a in range(0, t.q_len, n):
        rows = min(n, t.q_len - a)
        below = a if t.is_causal else t.k_len  # the keys every query of the piece sees
        pieces += [Tile(t.q_off + a, rows, t.k_off + c, min(n, below - c), softcap=t.softcap)
                   for c in range(0, below, n)]
        if t.is_causal:
            pieces.append(Tile(t.q_off + a, rows, t.k_off + a, rows, is_causal=True, softcap=t.softcap))
    return pieces


def forward_tiles(q, k, v, tiles: list[Tile], scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Accumulate attention of q against k/v over `tiles` into out (B, H, Lq, D) and lse (B, H, Lq) (acc_dtype)."""
    for t in (piece for tile in tiles for piece in kernel_pieces(tile)):
        qs, ks = slice(t.q_off, t.q_off + t.q_len), slice(t.k_off, t.k_off + t.k_len)
        o, piece_lse = kernel_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], t.mask, t.is_causal, scale, t.softcap)
        if t.empty_rows is not None:  # the CPU kernel reports lse 0 for such rows: give them no weight
            piece_lse = piece_lse.masked_fill(t.empty_rows, NEG_INF)
            o = o.masked_fill(t.empty_rows[..., None], 0.0)  # and never let a kernel's NaN there reach the merge
        merge_into(out[:, :, qs], lse[:, :, qs], o, piece_lse)


def backward_tiles(dout, q, k, v, out, lse, tiles: list[Tile], scale: float, dq, dk, dv) -> None:
    """Accumulate the block gradients of `tiles` into dq, dk, dv (acc_dtype), given the merged out and lse."""
    lse_b = lse_for_backward(lse)
    for t in (piece for tile in tiles for piece in kernel_pieces(tile)):
        qs, ks = slice(t.q_off, t.q_off + t.q_len), slice(t.k_off, t.k_off + t.k_len)
        gq, gk, gv = kernel_backward(
            dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse_b[:, :, qs],
            t.mask, t.is_causal, scale, t.softcap,
        )
        dq[:, :, qs] += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
        del gq, gk, gv  # before the next piece's kernel allocates its own


def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (out, lse) accumulators for q (B, H, Lq, D); out keeps q's memory layout (see kernels)."""
    b, h, lq, _ = q.shape
    acc = acc_dtype(q.dtype)
    return torch.zeros_like(q, dtype=acc), q.new_full((b, h, lq), NEG_INF, dtype=acc)
