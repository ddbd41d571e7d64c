"""The per-call part of an attention mask (MaskSpec) and what it reads from the model and the step: the layer's
attention chunk and each token's chunk id. Every mask is a predicate on global token indices
(hfcp/attention/tiles.py plans tiles from it; hfcp/layout/work.py counts the work it allows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import StepBatch


@dataclass(frozen=True)
class MaskSpec:
    """The per-call part of the mask (the per-step part, documents and padding, lives in the StepBatch)."""

    causal: bool
    window: int | None  # keys with q - k >= window are masked (transformers' sliding_window)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2)
    chunk: int | None = None  # chunked attention (Llama 4): keys in the query's chunk of this many tokens only
    blocks: str | None = None  # the step's bidirectional blocks (StepBatch.blocks) OR-ed with causality: "windowed"
    # ((causal | same block) & window, Gemma 3) or "whole" ((causal & window) | same block, PaliGemma 2); None: none


def chunk_ids(sb: StepBatch, chunk: int) -> torch.Tensor:
    """(B or 1, padded_len) non-decreasing attention-chunk id of each token, as transformers' chunked mask: chunks
    of `chunk` tokens counted from the first valid token of the row (after left padding, which gets negative ids);
    in packed rows from each document's position 0 (the id then also tells the documents apart)."""
    if sb.positions is not None:  # a new id where the document or the position's chunk changes: non-decreasing
        c = torch.div(sb.positions.to(sb.doc_ids), chunk, rounding_mode="floor")
        change = (torch.diff(sb.doc_ids, dim=-1) != 0) | (torch.diff(c, dim=-1) != 0)
        return torch.nn.functional.pad(change.long().cumsum(-1), (1, 0))
    idx = torch.arange(sb.layout.padded_len)
    if sb.key_valid is None:
        return (idx // chunk)[None]
    left = (sb.key_valid.cpu().long().cumsum(-1) == 0).sum(-1, keepdim=True)  # (B, 1) leading padding
    return torch.div(idx[None] - left, chunk, rounding_mode="floor").to(sb.key_valid.device)


def attention_chunk(module) -> int | None:
    """The attention chunk size of this module's layer (transformers' chunked attention: config.attention_chunk_size
    on the layers whose config.layer_types entry is "chunked_attention"; the mask alone applies it), or None."""
    cfg = getattr(module, "config", None)
    size = getattr(cfg, "attention_chunk_size", None)
    if not size:
        return None
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if types is None or not isinstance(idx, int) or not 0 <= idx < len(types):
        raise ValueError(f"{type(module).__name__}: config.attention_chunk_size={size} but hfcp cannot tell whether "
                         f"this layer (layer_idx={idx!r}) is chunked (config.layer_types={types!r})")
    return int(size) if types[idx] == "chunked_attention" else None
