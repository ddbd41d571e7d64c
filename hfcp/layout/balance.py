"""A balanced layout for packed rows: every rank the same number of tokens and nearly the same attention work.

Zigzag balances one causal document; a packed row of documents of very different lengths it does not. The planner
works on the attention work of each query position (hfcp.work, summed over the batch's rows, which share one layout)
and the row's segments (the runs between document starts of any row):

1. Long segments (work above a share of a rank's mean) are split head-tail over the ranks, the way zigzag splits
   a row, with each rank's head and tail sized so that its tokens and work land on its target.
2. The other segments stay whole: consecutive ones are bundled (so that many tiny documents give few ranges), and the
   bundles go, largest first, to the rank whose share of tokens and work stays lowest.
3. What the whole segments left each rank short of (tokens exactly, work approximately) is what the long ones fill.

The share that makes a segment long is tried from large (few ranges) to small (more splitting) until the slowest
rank is within GOOD_ENOUGH of the mean. Each rank's ranges are ascending and adjacent ones merged.
"""
from __future__ import annotations

import torch

from . import Layout, Range, StepBatch
from .work import step_work

LONG_SHARES = (1 / 4, 1 / 8, 1 / 16, 1 / 64, 0.0)  # a segment is long above this share of a rank's mean work
BUNDLE_SHARE = 1 / 16  # whole segments are bundled up to this share of a rank's mean work (and of its tokens)
GOOD_ENOUGH = 1.02  # max / mean work at which the planner stops trying smaller shares
GAIN = 0.99  # the balanced layout replaces the row layout when it cuts the slowest rank's work below this fraction


def segment_starts(doc_ids: torch.Tensor | None, padded_len: int) -> list[int]:
    """Ascending global indices where a document starts in any row ((B, P) non-decreasing ids; None: [0])."""
    if doc_ids is None:
        return [0]
    change = (doc_ids[:, 1:] != doc_ids[:, :-1]).any(0).cpu()
    return [0] + (change.nonzero().flatten() + 1).tolist()


def plan_ranges(work: torch.Tensor, starts: list[int], cp_size: int) -> tuple[tuple[Range, ...], ...]:
    """Per-rank ascending (start, length) ranges of positions [0, P) (P = len(work), a multiple of cp_size), each rank
    P / cp_size of them, with the most even per-rank sum of `work` the planner finds (see the module docstring).

    Args:
        work: (P,) int64 attention work of each query position.
        starts: ascending segment starts (0 first): split points the planner prefers.
    """
    prefix = _Prefix(work)
    P = work.numel()
    segs = [(s, e) for s, e in zip(starts, starts[1:] + [P]) if e > s]
    best = None
    for share in LONG_SHARES:
        plan = _attempt(prefix, segs, cp_size, share)
        ratio = _ratio(prefix, plan)
        if best is None or ratio < best[0] - 1e-9:
            best = (ratio, plan)
        if ratio <= GOOD_ENOUGH:
            break
    return best[1]


def balanced_layout(row: Layout, work: torch.Tensor, starts: list[int]) -> Layout:
    """`row` (the zigzag or contiguous layout of the same padded length) with the planner's ranges, or `row` itself
    when the plan does not cut the slowest rank's work by more than 1 - GAIN, or cp_size is 1."""
    if row.cp_size == 1 or len(starts) <= 1:
        return row
    plan = plan_ranges(work, starts, row.cp_size)
    prefix = _Prefix(work)
    before = max(_range_work(prefix, row.ranges(r)) for r in range(row.cp_size))
    after = max(_range_work(prefix, ranges) for ranges in plan)
    return Layout(row.seq_len, row.cp_size, row.zigzag, plan) if after < GAIN * before else row


class _Prefix:
    """Prefix sums of per-position work: .t (P+1,) int64 tensor for vectorised look-ups, .l the same as a list."""

    def __init__(self, work: torch.Tensor):
        self.t = torch.nn.functional.pad(work.cpu().long().cumsum(0), (1, 0))
        self.l = self.t.tolist()

    def __call__(self, start: int, end: int) -> int:
        """The work of positions [start, end)."""
        return self.l[end] - self.l[start]


def why_row_layout(patcher) -> str:
    """Why a model of this record keeps the row layout whatever its batch, or "" when balance="auto" applies."""
    if patcher.embeddings_classes:
        return "a vision model keeps the row layout"
    if patcher.language_model:
        return "a vision-language model keeps the row layout"
    if patcher.mixers:
        return "recurrent mixers pass their state in sequence order: the row layout"
    if not patcher.causal:
        return "bidirectional attention keeps the row layout"
    return ""


def step_layout(sb: StepBatch, masks) -> Layout:
    """The layout of this step: balanced over its packed documents (masks: (MaskSpec, layers) pairs, hfcp.work) when
    that cuts the slowest rank's work, else sb.layout (the row layout): rows without documents, or with the
    bidirectional blocks of masks built outside the model."""
    row = sb.layout
    if sb.doc_ids is None or sb.blocks is not None:
        return row
    return balanced_layout(row, step_work(sb, masks), segment_starts(sb.doc_ids, row.padded_len))


def _range_work(prefix: _Prefix, ranges) -> int:
    return sum(prefix(s, s + n) for s, n in ranges)


def _ratio(prefix: _Prefix, plan) -> float:
    works = [_range_work(prefix, ranges) for ranges in plan]
    mean = sum(works) / len(works)
    return max(works) / mean if mean > 0 else 1.0


class _Ranks:
    """What each rank holds so far: tokens, work and ranges."""

    def __init__(self, cp: int):
        self.tokens, self.work, self.ranges = [0] * cp, [0] * cp, [[] for _ in range(cp)]

    def add(self, rank: int, start: int, length: int, work: int) -> None:
        if length > 0:
            self.tokens[rank] += length
            self.work[rank] += work
            self.ranges[rank].append((start, length))

    def merged(self) -> tuple[tuple[Range, ...], ...]:
        out = []
        for ranges in self.ranges:
            merged: list[Range] = []
            for s, n in sorted(ranges):
                if merged and sum(merged[-1]) == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            out.append(tuple(merged))
        return tuple(out)


def _attempt(prefix: torch.Tensor, segs: list[tuple[int, int]], cp: int, long_share: float):
    """One plan: segments with work above long_share of a rank's mean split, the others whole."""
    P = len(prefix.l) - 1
    mean = prefix.l[-1] / cp
    seg_work = [prefix(s, e) for s, e in segs]
    long = [i for i, w in enumerate(seg_work) if w > long_share * mean]
    if not long:  # something must absorb what whole segments leave uneven
        long = [max(range(len(segs)), key=lambda i: (seg_work[i], segs[i][1] - segs[i][0]))]
    ranks = _Ranks(cp)
    fill = [segs[i] for i in long]
    fill += _place_whole(prefix, _bundles(prefix, segs, set(long), mean, P // cp), ranks, P // cp)
    _fill(prefix, fill, ranks, P // cp, mean)
    return ranks.merged()


def _bundles(prefix, segs, long: set, mean: float, per_rank: int) -> list[tuple[int, int]]:
    """Consecutive whole segments joined into (start, end) bundles of at most BUNDLE_SHARE of a rank's work and
    tokens (a segment larger than that alone); a long segment ends a bundle."""
    out: list[list[int]] = []
    open_ = False
    for i, (s, e) in enumerate(segs):
        if i in long:
            open_ = False
            continue
        if open_:
            b = out[-1]
            if prefix(b[0], e) <= BUNDLE_SHARE * mean and e - b[0] <= BUNDLE_SHARE * per_rank:
                b[1] = e
                continue
        out.append([s, e])
        open_ = True
    return [(s, e) for s, e in out]


def _place_whole(prefix, bundles, ranks: _Ranks, per_rank: int) -> list[tuple[int, int]]:
    """Place bundles whole, largest first, where the rank's larger share (tokens or work, of the whole bundles'
    per-rank mean) stays lowest; a bundle that fits no rank's tokens is returned, to be split."""
    cp = len(ranks.tokens)
    works = {b: prefix(*b) for b in bundles}
    tok_mean = max(sum(e - s for s, e in bundles) / cp, 1.0)
    work_mean = max(sum(works.values()) / cp, 1.0)

    def load(rank, b=None):
        n, w = (b[1] - b[0], works[b]) if b else (0, 0)
        return max((ranks.tokens[rank] + n) / tok_mean, (ranks.work[rank] + w) / work_mean)

    left = []
    for b in sorted(bundles, key=lambda b: (-max((b[1] - b[0]) / tok_mean, works[b] / work_mean), b)):
        fits = [r for r in range(cp) if ranks.tokens[r] + b[1] - b[0] <= per_rank]
        if not fits:
            left.append(b)
            continue
        rank = min(fits, key=lambda r: (load(r, b), r))
        ranks.add(rank, b[0], b[1] - b[0], works[b])
    return left


def _fill(prefix, segs: list[tuple[int, int]], ranks: _Ranks, per_rank: int, mean: float) -> None:
    """Split `segs` head-tail over the ranks so that each ends with per_rank tokens and its work nears `mean`:
    smallest segment first, each giving every rank its proportional share of what the rank still lacks."""
    segs = sorted(segs, key=lambda se: (prefix(*se), se))
    left_tokens = sum(e - s for s, e in segs)
    for j, (s, e) in enumerate(segs):
        n, seg_w = e - s, prefix(s, e)
        need = [per_rank - t for t in ranks.tokens]
        left_work = sum(max(mean - w, 0.0) for w in ranks.work) or 1.0
        if j == len(segs) - 1:
            take = need
        else:
            take = _shares(need, n, left_tokens)
        left_tokens -= n
        targets = [max(mean - w, 0.0) * min(seg_w / left_work, 1.0) for w in ranks.work]
        _split(prefix, s, e, take, targets, ranks)


def _shares(need: list[int], n: int, total: int) -> list[int]:
    """n tokens shared in proportion to need (sum total), each at most its need, summing to n."""
    exact = [k * n / total for k in need]
    take = [int(x) for x in exact]
    for r in sorted(range(len(need)), key=lambda r: take[r] - exact[r]):
        if sum(take) == n:
            break
        if take[r] < need[r]:
            take[r] += 1
    return take


def _split(prefix, start: int, end: int, take: list[int], targets: list[float], ranks: _Ranks) -> None:
    """Give rank r take[r] tokens of [start, end) as a head piece and a tail piece (zigzag within the segment), sized
    so that its work nears targets[r]; ranks whose target density is furthest from the segment's go first (they
    get the extremes), the last one gets the middle."""
    density = prefix(start, end) / (end - start) if end > start else 0.0
    order = sorted((r for r in range(len(take)) if take[r] > 0),
                   key=lambda r: (-abs(targets[r] / take[r] - density), r))
    lo, hi = start, end
    for i, r in enumerate(order):
        n = take[r]
        if i == len(order) - 1:
            h = hi - lo  # the rest, one range
        else:
            heads, t = torch.arange(n + 1), prefix.t
            work = t[lo + heads] - t[lo] + t[hi] - t[hi - n + heads]
            h = int((work.double() - targets[r]).abs().argmin())
        ranks.add(r, lo, h, prefix(lo, lo + h))
        ranks.add(r, hi - (n - h), n - h, prefix(hi - (n - h), hi))
        lo, hi = lo + h, hi - (n - h)
