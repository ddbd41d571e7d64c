"""Causal depthwise convolution over the global sequence, computed on each rank's tokens
(docs/concepts/recurrent-state.md).

A causal convolution of kernel k makes output t from inputs t-k+1..t. Under CP a rank holds runs of consecutive
global positions (zigzag: chunks r and 2cp-1-r), so each run needs the k-1 inputs before its start: its halo,
which another rank holds at the end of one of its runs (zero before the sequence start). Every rank sends the last
k-1 inputs of each of its runs in one all-gather; each run takes its halo from there and is convolved without
padding. The all-gather's backward sums the halo's gradient back to the rank that owns those inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.collectives import all_gather
from ..layout import StepBatch


def causal_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, step: StepBatch,
                            group) -> torch.Tensor:
    """What `F.conv1d(x_global, weight[:, None], bias, padding=k-1, groups=C)[..., :L]` gives at this rank's tokens.

    x: (B, C, local_len), this rank's tokens in local order; weight: (C, k).

    Raises:
        ValueError: the layout's chunks are shorter than k-1 tokens (a halo would reach past the chunk before).
    """
    k, layout = weight.shape[-1], step.layout
    if k == 1:
        return F.conv1d(x, weight.unsqueeze(1), bias, groups=x.shape[1])
    if layout.chunk_len < k - 1:
        raise ValueError(f"hfcp: a causal convolution of kernel {k} needs chunks of at least {k - 1} tokens, but this "
                         f"batch's layout has chunks of {layout.chunk_len}: use longer sequences or fewer ranks")
    ranges = layout.ranges(step.rank)
    starts = [sum(n for _, n in ranges[:i]) for i in range(len(ranges))]  # local start of each range
    tails = torch.cat([x[..., at + n - (k - 1):at + n] for at, (_, n) in zip(starts, ranges)], -1)
    table = all_gather(tails, group, -1)  # every range's last k-1 inputs, in layout.all_ranges() order
    table = torch.cat([table, table.new_zeros(table.shape[:-1] + (1,))], -1)  # the last column: before position 0
    column = {g + n - (k - 1) + j: i * (k - 1) + j
              for i, (g, n) in enumerate(layout.all_ranges()) for j in range(k - 1)}
    zero = table.shape[-1] - 1
    out = []
    for at, (first, n) in zip(starts, ranges):
        need = [column[p] if p >= 0 else zero for p in range(first - (k - 1), first)]  # chunks are back to back
        halo = table.index_select(-1, torch.tensor(need, device=x.device))
        out.append(F.conv1d(torch.cat([halo, x[..., at:at + n]], -1), weight.unsqueeze(1), bias, groups=x.shape[1]))
    return torch.cat(out, -1)
