"""Local attention kernels that return the log-sum-exp, with their backward, and the LSE merge.

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H % Hkv == 0 (GQA: K/V are never repeated before
this point); mask None or an additive float mask broadcastable to (B, 1, Lq, Lk) in q's dtype;
lse (B, H, Lq) float32 (float64 for a float64 model: see acc_dtype), natural log of the sum of exp(scale * q.k) over the allowed keys.

Memory layout: transformers hands attention (B, L, H, D) memory viewed as (B, H, L, D), and the CPU flash
kernel is 10-15% faster on that layout than on contiguous (B, H, L, D) (measured, torch 2.13, one thread), so
hfcp keeps it: accumulators are allocated like q, and K/V blocks travel in their own layout.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of merges, LSEs and gradient accumulators: fp32, or fp64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cpu_forward(q, k, v, mask, is_causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, lse.to(acc_dtype(q.dtype))


def _cpu_backward(dout, q, k, v, out, lse, mask, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(acc_dtype(q.dtype)), 0.0, is_causal, attn_mask=mask, scale=scale
    )


def _scores(q, k, mask, is_causal, scale, softcap=None):
    """Scaled scores (B, H, Lq, Lk) in acc_dtype, softcapped (c * tanh(s / c)) then masked; and the tanh of the
    capped scores (their derivative is 1 - tanh^2), or None without a cap."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1) if rep > 1 else k
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    if is_causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), NEG_INF)
    if mask is not None:
        s = s + mask.to(acc)
    return s, rep, tanh


def reference_forward(q, k, v, mask, is_causal, scale, softcap=None):
    """Plain-math kernel (fp32 inside, fp64 for fp64): the ground truth the tests use, the fallback off CPU, and
    the kernel of softcapped attention (which no fused kernel implements)."""
    s, rep, _ = _scores(q, k, mask, is_causal, scale, softcap)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
    p = torch.exp(s - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])
    vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
    return torch.matmul(p, vr.to(p.dtype)).to(q.dtype), lse


def reference_backward(dout, q, k, v, out, lse, mask, is_causal, scale, softcap=None):
    """Plain-math block gradients from the merged out and lse: P = exp(s - lse), dS = P * (dP - rowsum(dO * O)),
    times 1 - tanh^2 through a softcap."""
    s, rep, tanh = _scores(q, k, mask, is_causal, scale, softcap)
    p = torch.exp(s - lse[..., None])  # lse = +inf for rows with no allowed key: p = 0
    vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
    acc = p.dtype
    do = dout.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vr.to(acc).transpose(-1, -2))
    ds = p * (dp - (do * out.to(acc)).sum(-1, keepdim=True)) * scale
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k
    dq = torch.matmul(ds, kr.to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    if rep > 1:
        b, h, lk, d = dk.shape
        dk = dk.view(b, h // rep, rep, lk, d).sum(2)
        dv = dv.view(b, h // rep, rep, lk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _repeat_kv(k, v, rep):
    return (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if rep > 1 else (k, v)


def _aligned_bias(mask, b, h, lq, lk):
    """The mem-efficient kernel wants the bias's last dim stride a multiple of 16: pad, then view."""
    if mask is None:
        return None
    width = math.ceil(lk / 16) * 16
    buf = mask.new_zeros(mask.shape[0], 1, lq, width)
    buf[..., :lk] = mask
    return buf[..., :lk].expand(b, h, lq, lk)


def _cuda_forward(q, k, v, mask, is_causal, scale):
    b, h, lq, _ = q.shape
    kr, vr = _repeat_kv(k, v, h // k.shape[1])
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, kr, vr, _aligned_bias(mask, b, h, lq, k.shape[2]), True, 0.0, is_causal, scale=scale
    )
    return out, lse[..., :lq].to(acc_dtype(q.dtype))


def _cuda_backward(dout, q, k, v, out, lse, mask, is_causal, scale):
    b, h, lq, _ = q.shape
    rep = h // k.shape[1]
    kr, vr = _repeat_kv(k, v, rep)
    lse_k = lse.new_full((b, h, math.ceil(lq / 32) * 32), float("inf"))  # the kernel's padded layout
    lse_k[..., :lq] = lse
    no_rng = torch.zeros((), dtype=torch.long)  # dropout 0: the kernel draws no random numbers
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, kr, vr, _aligned_bias(mask, b, h, lq, k.shape[2]), out, lse_k, no_rng, no_rng,
        0.0, [True, True, True, False], is_causal, scale=scale,
    )
    if rep > 1:
        dk = dk.view(b, h // rep, rep, *dk.shape[2:]).sum(2)
        dv = dv.view(b, h // rep, rep, *dv.shape[2:]).sum(2)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _fused_cuda_ok(device: str, dtype: torch.dtype) -> bool:
    """Run the fused CUDA path once against the math kernel (masked, causal, GQA, fwd + bwd); on any error or
    mismatch, warn and use the math kernel for this device and dtype (exact, slower)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v, do = (torch.randn(2, hh, 40, 16, generator=g).to(device, dtype) for hh in (4, 2, 2, 4))
        mask = torch.zeros(2, 1, 40, 40).masked_fill_(torch.rand(2, 1, 40, 40, generator=g) < 0.3, NEG_INF)
        mask[..., 0] = 0.0
        mask = mask.to(device, dtype)
        tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
        for m, causal in ((None, True), (mask, False)):
            o1, l1 = _cuda_forward(q, k, v, m, causal, 0.25)
            o2, l2 = reference_forward(q, k, v, m, causal, 0.25)
            g1 = _cuda_backward(do, q, k, v, o1, l1, m, causal, 0.25)
            g2 = reference_backward(do, q, k, v, o2, l2, m, causal, 0.25)
            for a, b in ((o1, o2), (l1, l2), *zip(g1, g2)):
                if not bool(torch.isfinite(a).all()) or float((a.float() - b.float()).abs().max()) > tol * (1 + float(b.float().abs().max())):
                    raise RuntimeError("fused kernel disagrees with the math kernel")
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        warnings.warn(f"hfcp: fused CUDA attention unavailable on {device} for {dtype} ({e}); using the exact math "
                      "kernel (slower, tiles of at most MAX_TILE x MAX_TILE)")
        return False


def has_fused_kernel(device, dtype=torch.float32) -> bool:
    """Whether blocks run on a fused kernel that tiles internally (CPU flash, CUDA mem-efficient SDPA after a
    self-check); else the plain-math kernel, whose tiles the planner keeps small."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _fused_cuda_ok(str(device), dtype)


def kernel_forward(q, k, v, mask, is_causal: bool, scale: float, softcap: float | None = None):
    """One block of attention: returns (out in q's dtype, lse in acc_dtype). q, k, v share one dtype; autocast
    is off inside (the caller brought q/k/v to the autocast dtype, as SDPA does). A softcap takes the math kernel."""
    with torch.autocast(q.device.type, enabled=False):
        if softcap is not None:
            return reference_forward(q, k, v, mask, is_causal, scale, softcap)
        if q.device.type == "cpu":
            return _cpu_forward(q, k, v, mask, is_causal, scale)
        if has_fused_kernel(q.device, q.dtype):
            return _cuda_forward(q, k, v, mask, is_causal, scale)
        return reference_forward(q, k, v, mask, is_causal, scale)


def kernel_backward(dout, q, k, v, out, lse, mask, is_causal: bool, scale: float, softcap: float | None = None):
    """Block gradients given the *merged* out and lse (rows with no key anywhere carry lse = +inf)."""
    with torch.autocast(q.device.type, enabled=False):
        if softcap is not None:
            return reference_backward(dout, q, k, v, out, lse, mask, is_causal, scale, softcap)
        if q.device.type == "cpu":
            return _cpu_backward(dout, q, k, v, out, lse, mask, is_causal, scale)
        if has_fused_kernel(q.device, q.dtype):
            return _cuda_backward(dout, q, k, v, out, lse, mask, is_causal, scale)
        return reference_backward(dout, q, k, v, out, lse, mask, is_causal, scale)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: (out, lse) <- LSE-merge of (out, lse) and (block_out, block_lse), in their dtype (acc_dtype).

    out (B, H, Lq, D), lse (B, H, Lq), both acc_dtype; rows with lse = -inf on both sides stay 0.
    """
    new = torch.logaddexp(lse, block_lse)
    base = new.masked_fill(new == NEG_INF, 0.0)
    w_old = torch.exp(lse - base)[..., None]
    w_new = torch.exp(block_lse - base)[..., None]
    out.mul_(w_old).add_(block_out.to(out.dtype) * w_new)
    lse.copy_(new)


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Rows whose keys were all masked (lse = -inf) get +inf so that exp(s - lse) = 0, never NaN."""
    return lse.masked_fill(lse == NEG_INF, float("inf"))
