"""Attention of new tokens (a decode step) against a KV cache whose tokens are spread over the CP group.

Every rank holds the same new queries and the keys of its own cached tokens (hfcp/inference/kv_cache.py). Each computes
the softmax attention of the queries over its keys alone, as (out_r, lse_r) in fp32; one all-gather of [out_r | lse_r]
((B, H, n, D + 1) per rank) gives every rank all of them, and the exact result is their log-sum-exp merge:
lse = log sum_r exp(lse_r), out = sum_r exp(lse_r - lse) out_r (an attention sink enters the denominator once,
after the merge). Every rank merges the same gathered values in the same order, so every rank gets the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed.collectives import all_gather
from ..layout.masks import MaskSpec
from .sinks import add_sink


@dataclass(eq=False)
class DecodeStep:
    """What a decode step's attention calls need: the cache (hfcp.inference.kv_cache.ShardedKVCache) and the new
    tokens' global columns."""

    cache: object
    columns: torch.Tensor  # (n,) long


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_columns: torch.Tensor,
                     key_columns: torch.Tensor, key_valid: torch.Tensor, spec: MaskSpec, scale: float, group,
                     sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the new tokens over every rank's cached keys.

    Args:
        query: (B, H, n, D) the new tokens' queries, the same on every rank.
        key, value: (B, Hkv, L_r, D) this rank's cached keys and values (its new tokens' included when it holds them).
        query_columns: (n,) the new tokens' global columns; key_columns: (L_r,) those of this rank's keys.
        key_valid: (B, L_r) bool, False for padding.
        spec: causal (always, here), a sliding window (q - k < window) and a softcap; chunks and blocks refused by
            the caller.
    Returns: (B, H, n, D) in the query's dtype.
    """
    batch, heads, new, _ = query.shape
    kv_heads = key.shape[1]
    group_size = heads // kv_heads
    f32 = torch.promote_types(query.dtype, torch.float32)
    k, v = key.to(f32), value.to(f32)
    # GQA without repeating the cache: the query heads of one KV head side by side, (B, Hkv, group * n, D)
    q = query.to(f32).reshape(batch, kv_heads, group_size * new, query.shape[-1])
    scores = torch.einsum("bhnd,bhkd->bhnk", q, k) * scale
    if spec.softcap:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    gap = (query_columns.to(key_columns.device)[:, None] - key_columns[None, :]).repeat(group_size, 1)  # (g*n, L_r)
    allowed = gap >= 0
    if spec.window is not None:
        allowed = allowed & (gap < spec.window)
    allowed = allowed[None, None] & key_valid[:, None, None, :]  # (B, 1, g*n, L_r)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if scores.shape[-1] == 0:  # no key here (a sliding window's keys all on other ranks): weight 0, and still gather
        scores = scores.new_full(scores.shape[:-1] + (1,), float("-inf"))
        v = v.new_zeros(v.shape[:2] + (1, v.shape[-1]))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a rank without a key for a query: weight 0
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)  # (B, H, n, 1)
    out = torch.einsum("bhnk,bhkd->bhnd", weights, v) / total.clamp_min(torch.finfo(f32).tiny)
    out = out.reshape(batch, heads, new, v.shape[-1])
    lse = (top + torch.log(total)).reshape(batch, heads, new, 1)  # -inf where no key
    parts = all_gather(torch.cat([out, lse], -1)[None], group, 0)  # (cp, B, H, n, D + 1)
    outs, lses = parts[..., :-1], parts[..., -1]
    merged = torch.logsumexp(lses, 0)  # (B, H, n)
    share = torch.exp(lses - merged.where(torch.isfinite(merged), torch.zeros_like(merged)))
    out = (share[..., None] * outs).sum(0)
    out, _ = add_sink(out, merged, sink)
    return out.to(query.dtype)
