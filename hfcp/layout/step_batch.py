"""The per-step token metadata that attention masks read (`StepBatch`): document ids from position_ids resets, key
padding. Every rank holds the full batch, so each rank computes the metadata of every global token without
communication."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ranges import Layout, pad_to


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) document index of each token: a position that is not previous + 1 starts a new document
    (exactly transformers' `find_packed_sequence_indices`)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@dataclass
class StepBatch:
    """Per-step metadata over the padded global sequence, shared by every attention call of the step.

    doc_ids:   (B, padded_len) long, non-decreasing per row, or None when no row is packed.
    key_valid: (B, padded_len) bool, or None when every key is valid.
    positions: (B, padded_len) long position ids when a row is packed (transformers then evaluates the masks of
               packed rows on positions: chunked attention restarts in each document), else None.
    """

    layout: Layout
    rank: int
    doc_ids: torch.Tensor | None
    key_valid: torch.Tensor | None
    positions: torch.Tensor | None = None
    max_position: torch.Tensor | None = None  # 0-dim: the whole batch's largest position id (dynamic RoPE reads it)
    outer_masks: dict | None = None  # forms of masks an outer model built ({layer type: OuterMask}), checked per layer
    blocks: torch.Tensor | None = None  # (B, padded_len) long bidirectional block ids of those masks (-1: none)
    plans: dict = field(default_factory=dict)  # attention block plans, cached for all layers of the step
    # (padded_len,) attention work of each position (hfcp.work.step_work), once counted
    work: torch.Tensor | None = None

    @property
    def local_index(self) -> torch.Tensor:
        return self.layout.local_index(self.rank)

    def local(self, x: torch.Tensor, dim: int = 1, fill=0) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (Layout.local)."""
        return self.layout.local(x, self.rank, dim, fill)


def build_step_batch(
    layout: Layout,
    rank: int,
    batch_size: int,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    device,
) -> StepBatch:
    """Document ids and key padding of the padded global sequence (see `StepBatch`).

    Packing is detected only when there is no attention_mask, as transformers does.
    """
    L, P = layout.seq_len, layout.padded_len
    doc_ids = positions = None
    if attention_mask is None and position_ids is not None:
        docs = document_ids(position_ids.expand(batch_size, -1))
        if bool((docs[:, -1] > 0).any()):
            # padding forms one more document after the last, so ids stay non-decreasing
            doc_ids = pad_to(docs, P, 1, 0)
            doc_ids[:, L:] = docs[:, -1:] + 1
            positions = pad_to(position_ids.expand(batch_size, -1), P, 1, 0)
    key_valid = None
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool).expand(batch_size, -1)
        key_valid = pad_to(valid, P, 1, False)
    elif P > L:
        key_valid = torch.zeros(batch_size, P, dtype=torch.bool, device=device)
        key_valid[:, :L] = True
    if key_valid is not None and bool(key_valid.all()):
        key_valid = None
    return StepBatch(layout, rank, doc_ids, key_valid, positions)
