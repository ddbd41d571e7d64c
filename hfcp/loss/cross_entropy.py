"""Causal-LM loss under CP: labels shifted over the global sequence before sharding, token-weighted
global mean made equal on every rank by an autograd-aware all-reduce."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..distributed.collectives import all_reduce_sum
from .linear_ce import IDENTITY, IGNORE_INDEX, LogitTransform, add_token_stats, chunk_starts, linear_cross_entropy_sum


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(B, L) -> (B, L): position i holds the target of token i (labels[i + 1]); the last is `ignore_index`.

    Done on the full sequence, so the target of a rank's last token (which lives on another rank) is kept.
    """
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def ce_sum(logits: torch.Tensor, local_targets: torch.Tensor) -> torch.Tensor:
    """sum of CE over the valid local tokens: logits (B, L/cp, V), targets (B, L/cp) -> fp32 scalar."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        local_targets.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def global_mean(local_sum: torch.Tensor, denominator, group) -> torch.Tensor:
    """sum over the CP group / denominator (the global count of valid targets, or num_items_in_batch),
    identical on every rank; the all-reduce's backward is an all-reduce (see collectives)."""
    total = all_reduce_sum(local_sum, group)
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(total.device)
    return total / denominator


def _chunk_ce_sum(hidden: torch.Tensor, targets: torch.Tensor, head, stats_out: list | None,
                  transform: LogitTransform) -> torch.Tensor:
    logits = transform(head(hidden))
    if stats_out is not None and not stats_out:  # not again when checkpointing recomputes this chunk in backward
        stats_out.append(torch.zeros(3, dtype=torch.float64, device=logits.device))
        add_token_stats(logits, targets, stats_out[0])
    return ce_sum(logits, targets)


def chunked_ce_sum(hidden: torch.Tensor, targets: torch.Tensor, head, chunk: int,
                   stats: torch.Tensor | None = None, transform: LogitTransform = IDENTITY) -> torch.Tensor:
    """sum of CE(transform(head(hidden)), targets) over valid tokens, `chunk` tokens at a time: the (tokens x
    vocab) logits of a chunk exist only inside it. `transform`: the model's logit scale / softcap.

    A plain nn.Linear head takes the fused path (linear_ce: gradients taken in forward, nothing recomputed);
    any other head (a PEFT-wrapped lm_head, say) is called per chunk under activation checkpointing, so
    backward recomputes its logits.

    hidden (B, L, H), targets (B, L) -> scalar fp32 (0 when no target is valid, never NaN). stats: see
    add_token_stats.
    """
    if type(head) is torch.nn.Linear:
        return linear_cross_entropy_sum(hidden, targets, head, chunk, stats, transform)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(hidden.device)
    total = None
    for start in chunk_starts(t, chunk):
        found = None if stats is None else []
        part = checkpoint(_chunk_ce_sum, h[start : start + chunk], t[start : start + chunk], head, found, transform,
                          use_reentrant=False)
        if found:  # summed here: checkpoint saves its tensor inputs and refuses them changed in place in backward
            stats += found[0]
        total = part if total is None else total + part
    return total
