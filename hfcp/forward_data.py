"""The data of one forward of a patched model (CPState.fwd)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class ForwardData:
    """What one forward of the patched model carries from its pre-hook to its post-hook and to the integrations that
    read it after the forward (a new one each forward: nothing of a forward outlives the next one)."""

    targets: torch.Tensor | None = None  # this rank's shifted labels, padded to the layout
    denominator: object = None  # the global count of target tokens (or the Trainer's num_items_in_batch)
    loss_sum: torch.Tensor | None = None  # the chunked loss's local sum, computed by the output head's stand-in
    token_stats: torch.Tensor | None = None  # with labels: (3,) fp64 [targets, top-1 hits, entropy sum], whole sequence
    local_output_names: frozenset = frozenset()  # output fields that hold local sequences
    attention_calls: set = field(default_factory=set)  # id() of the attention modules that ran
    router_logits_wanted: bool = False  # this forward records router logits: the aux loss is computed
    router_logits: tuple | None = None  # the local router logits, taken by RouterStatsHook
    pending_layout: object = None  # a VLM's layout between its outer model's hook and its language model's hook
    cache: object = None  # generation: the ShardedKVCache of this forward (hfcp/inference/kv_cache.py), None otherwise
    decoding: bool = False  # a decode step (new tokens whole on every rank), not the prompt's prefill
