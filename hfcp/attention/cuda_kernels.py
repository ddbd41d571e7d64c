"""CUDA tile kernels: torch's flash kernel for tiles without a mask, the memory-efficient kernel for masked tiles.

Both are the aten ops torch's own ring attention calls (torch/distributed/tensor/experimental/_context_parallel/
_attention.py), with the signatures of torch 2.13 (`torch.ops.aten.<op>.default._schema`):

    _scaled_dot_product_flash_attention(query, key, value, dropout_p=0., is_causal=False, return_debug_mask=False,
        *, scale=None) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
    _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None) -> (dq, dk, dv)
    _scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.,
        is_causal=False, *, scale=None) -> (output, log_sumexp, philox_seed, philox_offset)
    _scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value, attn_bias, out, logsumexp,
        philox_seed, philox_offset, dropout_p, grad_input_mask[4], is_causal=False, *, scale=None) -> (dq, dk, dv, db)

Layouts (torch/_meta_registrations.py; the CUDA sources of flash_api.cpp and attention_backward.cu):
- flash: fp16 / bf16 only, head dim a multiple of 8 and at most 256, lse (B, H, Lq) float32, unpadded. GQA is
  native (flash-attn's num_heads_k; dk/dv come back with the KV heads): K/V are never repeated for it. Its backward
  reads the lse as a contiguous (B, H, Lq) buffer; cum_seq_q None (an undefined tensor) selects the dense kernel;
  with dropout 0 the philox tensors are not read. is_causal with Lq != Lk is bottom-right aligned: hfcp calls it
  causal on square tiles only.
- memory-efficient: lse (B, H, ceil(Lq / 32) * 32) float32 (padded on CUDA; ROCm returns Lq columns), its backward
  wants that padded layout. Its backward checks equal query and key heads, so K/V are repeated for GQA here, and
  only here: a masked tile is at most MAX_TILE x MAX_TILE, so the copy is the tile's. The bias must have a last
  dim whose row stride is a multiple of 16 elements, the query's dtype, and shape (B, H, Lq, Lk) (a view).
"""
from __future__ import annotations

import math

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_head_dim_ok(device, head_dim: int) -> bool:
    """Whether torch's flash kernel takes this head dim, forward and backward (flash_api.cpp: a multiple of 8, at most
    256; sdp_utils.cpp: above 192 the backward needs sm80 or sm90)."""
    if head_dim % 8 or head_dim > 256:
        return False
    return head_dim <= 192 or torch.cuda.get_device_capability(device) in ((8, 0), (9, 0))


def aligned(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`t` (.., D) with its last dim zero-padded to `head_dim`, and its storage offset and strides multiples of 8
    elements (16 bytes in fp16 / bf16): the aten ops check strides but not where a view starts, and the
    memory-efficient kernel reads misaligned views wrongly (pytorch#183484, guarded in SDPA's dispatcher only).
    A copy only when needed."""
    if t.shape[-1] != head_dim:
        return torch.nn.functional.pad(t, (0, head_dim - t.shape[-1]))
    if t.stride(-1) != 1 or t.storage_offset() % 8 or any(s % 8 for s in t.stride()[:-1]):
        return t.clone(memory_format=torch.contiguous_format)  # (contiguous() keeps a contiguous view's offset)
    return t


def flash_forward(q, k, v, mask, is_causal: bool, scale: float):
    """(out (B, H, Lq, D), lse (B, H, Lq) float32) of an unmasked tile; k/v (B, Hkv, Lk, D) as they are (GQA)."""
    assert mask is None and (not is_causal or q.shape[2] == k.shape[2]), "flash tiles: no mask, causal only square"
    q, k, v = (aligned(t, q.shape[-1]) for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    return out, lse


def flash_backward(dout, q, k, v, out, lse, mask, is_causal: bool, scale: float):
    """Block gradients (dq, dk with k's heads, dv) from the merged out and lse (rows without keys: lse = +inf)."""
    assert mask is None, "flash tiles take no mask"
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)  # dropout 0: never read (flash_api.cpp mha_bwd)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    d = q.shape[-1]
    dout, q, k, v, out = (aligned(t.to(q.dtype), d) for t in (dout, q, k, v, out))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.float().contiguous(), None, None, q.shape[2], k.shape[2],
        0.0, is_causal, rng, unused, scale=scale,
    )
    return dq, dk, dv


def repeat_kv(k, v, rep: int):
    """K/V (B, Hkv, Lk, D) -> (B, Hkv * rep, Lk, D): only for the memory-efficient kernel, whose backward needs it."""
    return (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if rep > 1 else (k, v)


def aligned_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (.., Lq, Lk) in `dtype` from a bool mask, stored with rows of a multiple of 16 elements (the
    memory-efficient kernel's alignment), so that a tile's bias is built once per step and never copied again."""
    *lead, lq, lk = allowed.shape
    buf = torch.zeros(*lead, lq, math.ceil(lk / 16) * 16, dtype=dtype, device=allowed.device)
    view = buf[..., :lk]
    view.masked_fill_(~allowed, float("-inf"))
    return view


def _bias(mask, b: int, h: int, lq: int, lk: int):
    """The tile's mask (B or 1, 1, Lq, Lk) as the kernel's (B, H, Lq, Lk) view of 16-aligned rows (copied once if
    the planner did not build it aligned)."""
    if mask is None:
        return None
    if mask.stride(-1) != 1 or mask.stride(-2) % 16:
        buf = mask.new_zeros(*mask.shape[:-1], math.ceil(lk / 16) * 16)[..., :lk]
        mask = buf.copy_(mask)
    return mask.expand(b, h, lq, lk)


def masked_forward(q, k, v, mask, is_causal: bool, scale: float):
    """(out, lse (B, H, Lq) float32) of a tile with an additive mask (or none: the fallback of flash tiles). A head dim
    that is no multiple of 8 is zero-padded (scores and the kept columns do not change), as SDPA pads for flash."""
    b, h, lq, d = q.shape
    dp = math.ceil(d / 8) * 8
    q, kr, vr = (aligned(t, dp) for t in (q, *repeat_kv(k, v, h // k.shape[1])))
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, kr, vr, _bias(mask, b, h, lq, k.shape[2]), True, 0.0, is_causal, scale=scale
    )[:2]
    return out[..., :d], lse[..., :lq].float()


def masked_backward(dout, q, k, v, out, lse, mask, is_causal: bool, scale: float):
    """Block gradients of a masked tile from the merged out and lse; dk/dv summed back to k's heads."""
    b, h, lq, d = q.shape
    rep, dp = h // k.shape[1], math.ceil(d / 8) * 8
    dout, q, out, kr, vr = (aligned(t.to(q.dtype), dp) for t in (dout, q, out, *repeat_kv(k, v, rep)))
    lse_k = lse.new_full((b, h, math.ceil(lq / 32) * 32), float("inf"), dtype=torch.float32)  # the padded layout
    lse_k[..., :lq] = lse
    no_rng = torch.zeros((), dtype=torch.long, device=q.device)  # dropout 0: not read (as the forward returns it)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, kr, vr, _bias(mask, b, h, lq, k.shape[2]), out, lse_k, no_rng, no_rng, 0.0,
        [True, True, True, False], is_causal, scale=scale,
    )
    dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
    if rep > 1:
        dk = dk.view(b, h // rep, rep, *dk.shape[2:]).sum(2)
        dv = dv.view(b, h // rep, rep, *dv.shape[2:]).sum(2)
    return dq, dk, dv
