"""Attention sinks: one learnable logit per head that joins every query's softmax denominator (GPT-OSS `s_aux`).

It enters once, after all key blocks are merged (docs/concepts/exactness.md): lse_total = logaddexp(lse, s_h),
and the output is scaled by exp(lse - lse_total). Backward then runs the usual block formula with the final out and
lse_total, and the sink's own gradient is d s_h = -sum over rows of exp(s_h - lse_total) * (dO . O).
"""
from __future__ import annotations

import torch


def add_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None):
    """out (B, H, L, D) and lse (B, H, L) merged over all keys -> with the sink in the denominator."""
    if sink is None:
        return out, lse
    total = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))  # rows without keys: total = s, out stays 0
    return out * torch.exp(lse - total)[..., None].to(out.dtype), total


def head_group(sink: torch.Tensor | None, groups: int, index: int):
    """The sink logits of head group `index` of `groups` (after an all-to-all over heads), or None."""
    return None if sink is None else sink.view(groups, -1)[index]


def head_group_sink_grad(dout, out, total, sink: torch.Tensor | None, groups: int, index: int):
    """sink_grad of head group `index`, placed in a (H,) gradient that is zero elsewhere (or None): the other head
    groups' ranks give the rest, and the group's gradient convention sums them."""
    if sink is None:
        return None
    grad = torch.zeros_like(sink).view(groups, -1)
    grad[index] = sink_grad(dout, out, total, head_group(sink, groups, index))
    return grad.view(-1)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, total: torch.Tensor, sink: torch.Tensor | None):
    """d loss / d sink (H,) from dout, the final out and lse_total of the local queries (None without a sink)."""
    if sink is None:
        return None
    p = torch.exp(sink.to(total.dtype).view(1, -1, 1) - total)  # (B, H, L) probability mass of the sink
    rows = (dout.to(total.dtype) * out.to(total.dtype)).sum(-1)  # (B, H, L)
    return (-(p * rows).sum(dim=(0, 2))).to(sink.dtype)
