"""Attention work: how many query-key pairs the masks allow, per query and per rank of a layout.

Every mask is a predicate on global indices, and each group a query must share with its keys (its document, its
attention chunk) is a run of consecutive tokens, so the keys a query may see form one interval, less the padded keys
in it: [max(group start, q - window + 1), q] for causal attention, [max(group start, q - window + 1), group end]
otherwise. Counting is a prefix sum over the valid keys, O(rows x tokens) per mask: never an L x L mask.

A rank's work is the sum over its queries: every rank sees every key once per pass (the ring, the all-gather), so the
work a rank does is decided by which queries it holds. Ulysses' all-to-all gives each rank all of its group's queries
for a share of the heads: the group's work is shared evenly (rank_work's ulysses_size).
"""
from __future__ import annotations

from typing import Iterable

import torch

from .masks import MaskSpec, attention_chunk, chunk_ids
from . import Layout, StepBatch


def _run_bounds(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) non-decreasing group ids -> (first, last) global index of each token's run of equal ids, (B, P) each."""
    P = ids.shape[-1]
    idx = torch.arange(P, device=ids.device).expand_as(ids)
    change = ids[:, 1:] != ids[:, :-1]  # (B, P-1)
    edge = torch.ones_like(ids[:, :1], dtype=torch.bool)
    first = torch.where(torch.cat([edge, change], -1), idx, 0).cummax(-1).values
    last = torch.where(torch.cat([change, edge], -1), idx, P - 1).flip(-1).cummin(-1).values.flip(-1)
    return first, last


def query_work(spec: MaskSpec, sb: StepBatch) -> torch.Tensor:
    """(B, padded_len) int64: how many keys each query of each row may attend to under `spec` and the step's
    documents, attention chunks and key padding (the predicate of hfcp.attention.tiles).

    Raises:
        ValueError: a spec with bidirectional blocks (image blocks of a vision-language model), which are not counted.
    """
    if spec.blocks is not None and sb.blocks is not None:
        raise ValueError("attention work is not counted for masks with bidirectional blocks (vision-language models "
                         "keep the row layout)")
    P = sb.layout.padded_len
    rows = next((t.shape[0] for t in (sb.doc_ids, sb.key_valid) if t is not None), 1)
    q = torch.arange(P).expand(rows, P)
    lo, hi = torch.zeros_like(q), q.clone() if spec.causal else torch.full_like(q, P - 1)
    if spec.window is not None:
        lo = torch.maximum(lo, q - int(spec.window) + 1)
    groups = [sb.doc_ids] if sb.doc_ids is not None else []
    if spec.chunk is not None:
        groups.append(chunk_ids(sb, spec.chunk))
    for ids in groups:
        first, last = _run_bounds(ids.cpu().long().expand(rows, P))
        lo, hi = torch.maximum(lo, first), torch.minimum(hi, last)
    valid = torch.ones(rows, P, dtype=torch.long) if sb.key_valid is None else sb.key_valid.cpu().long()
    seen = torch.nn.functional.pad(valid.expand(rows, P).cumsum(-1), (1, 0))  # (B, P+1) valid keys before each index
    count = seen.gather(-1, (hi + 1).clamp(min=0)) - seen.gather(-1, lo.clamp(min=0, max=P))
    return torch.where(hi >= lo, count, 0)


def position_work(masks: Iterable[tuple[MaskSpec, int]], sb: StepBatch) -> torch.Tensor:
    """(padded_len,) int64: the attention work of each query position, summed over the batch's rows and over the
    model's layers. masks: (spec, number of layers that attend with it) pairs, e.g. sliding and full layers."""
    total = torch.zeros(sb.layout.padded_len, dtype=torch.long)
    for spec, layers in masks:
        total += int(layers) * query_work(spec, sb).sum(0)
    return total


def step_work(sb: StepBatch, masks: Iterable[tuple[MaskSpec, int]]) -> torch.Tensor:
    """position_work of the step, counted on its first use and kept on the step (sb.work): the balance planner and
    the step's imbalance (hfcp.step_imbalance) read the same count."""
    if sb.work is None:
        sb.work = position_work(masks, sb)
    return sb.work


def layer_masks(modules, causal: bool) -> list[tuple[MaskSpec, int]]:
    """(mask, number of layers) of the model's attention modules, as their calls pass it: each module's own
    sliding_window (Gemma, Qwen2), else its config's (Mistral), and its layer's attention chunk (Llama 4)."""
    counts: dict[MaskSpec, int] = {}
    for m in modules:
        window = getattr(m, "sliding_window", getattr(getattr(m, "config", None), "sliding_window", None))
        spec = MaskSpec(causal, int(window) if window else None, chunk=attention_chunk(m))
        counts[spec] = counts.get(spec, 0) + 1
    return list(counts.items()) or [(MaskSpec(causal, None), 1)]


def rank_work(layout: Layout, work: torch.Tensor, ulysses_size: int = 1) -> list[float]:
    """Each rank's attention work under `layout`: the sum of `work` (per position) over the rank's local tokens.

    ulysses_size: ranks per Ulysses group (1: ring and allgather; cp: ulysses; usp's size). The all-to-all gives each
    rank of a group the group's queries for 1 / ulysses_size of the heads, so its work is the group's mean.
    """
    own = [int(work[layout.local_index(r)].sum()) for r in range(layout.cp_size)]
    u = ulysses_size
    return own if u == 1 else [sum(own[r - r % u: r - r % u + u]) / u for r in range(layout.cp_size)]


def ulysses_width(strategy: str, cp_size: int, ulysses_size: int | None) -> int:
    """Ranks that share their queries by an all-to-all: cp_size for "ulysses", usp's Ulysses group size, else 1."""
    if strategy == "ulysses":
        return cp_size
    return (ulysses_size or 1) if strategy == "usp" else 1


def imbalance(per_rank: list[int]) -> float:
    """max / mean of per-rank work (1.0 when there is no work)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0
