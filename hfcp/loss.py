"""Causal-LM loss under CP: labels shifted over the global sequence before sharding, token-weighted
global mean made equal on every rank by an autograd-aware all-reduce."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import all_reduce_sum

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, L): position i holds the target of token i (labels[i + 1]); the last is ignored.

    Done on the full sequence, so the target of a rank's last token (which lives on another rank) is kept.
    """
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def causal_lm_loss(logits: torch.Tensor, local_targets: torch.Tensor, denominator, group) -> torch.Tensor:
    """sum of CE over the valid local tokens / denominator, summed over the CP group.

    Args:
        logits: (B, L/cp, V) local logits.
        local_targets: (B, L/cp) shifted labels of the local tokens (IGNORE_INDEX where none).
        denominator: the global count of valid targets (or the caller's num_items_in_batch).
        group: the CP group.
    Returns:
        The scalar loss, identical on every rank of the group (0-token ranks contribute exactly 0).
    """
    local_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        local_targets.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    total = all_reduce_sum(local_sum, group)
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(total.device)
    return total / denominator
