"""Local attention kernels that return the log-sum-exp, with their backward, and the LSE merge.

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H % Hkv == 0 (GQA: K/V are never repeated before
this point); mask None or an additive float mask broadcastable to (B, 1, Lq, Lk) in q's dtype;
lse (B, H, Lq) float32, natural log of the sum of exp(scale * q.k) over the allowed keys.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _cpu_forward(q, k, v, mask, is_causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, lse.float()


def _cpu_backward(dout, q, k, v, out, lse, mask, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )


def _scores(q, k, mask, is_causal, scale):
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1) if rep > 1 else k
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if is_causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), NEG_INF)
    if mask is not None:
        s = s + mask.float()
    return s, rep


def reference_forward(q, k, v, mask, is_causal, scale):
    """Plain-math kernel (fp32 inside): the ground truth the tests use, and the fallback off CPU."""
    s, rep = _scores(q, k, mask, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
    p = torch.exp(s - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])
    vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
    return torch.matmul(p, vr.float()).to(q.dtype), lse


def reference_backward(dout, q, k, v, out, lse, mask, is_causal, scale):
    s, rep = _scores(q, k, mask, is_causal, scale)
    p = torch.exp(s - lse[..., None])  # lse = +inf for rows with no allowed key: p = 0
    vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vr.float().transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True)) * scale
    kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k
    dq = torch.matmul(ds, kr.float())
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    if rep > 1:
        b, h, lk, d = dk.shape
        dk = dk.view(b, h // rep, rep, lk, d).sum(2)
        dv = dv.view(b, h // rep, rep, lk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def has_fused_kernel(device) -> bool:
    """Whether blocks run on a fused kernel that tiles internally (CPU flash); else the math kernel."""
    return torch.device(device).type == "cpu"


def kernel_forward(q, k, v, mask, is_causal: bool, scale: float):
    """One block of attention: returns (out in q's dtype, lse float32)."""
    if q.device.type == "cpu":
        return _cpu_forward(q, k, v, mask, is_causal, scale)
    return reference_forward(q, k, v, mask, is_causal, scale)


def kernel_backward(dout, q, k, v, out, lse, mask, is_causal: bool, scale: float):
    """Block gradients given the *merged* out and lse (rows with no key anywhere carry lse = +inf)."""
    if q.device.type == "cpu":
        return _cpu_backward(dout, q, k, v, out, lse, mask, is_causal, scale)
    return reference_backward(dout, q, k, v, out, lse, mask, is_causal, scale)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: (out, lse) <- LSE-merge of (out, lse) and (block_out, block_lse), in fp32.

    out (B, H, Lq, D) float32, lse (B, H, Lq) float32; rows with lse = -inf on both sides stay 0.
    """
    new = torch.logaddexp(lse, block_lse)
    base = new.masked_fill(new == NEG_INF, 0.0)
    w_old = torch.exp(lse - base)[..., None]
    w_new = torch.exp(block_lse - base)[..., None]
    out.mul_(w_old).add_(block_out.float() * w_new)
    lse.copy_(new)


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Rows whose keys were all masked (lse = -inf) get +inf so that exp(s - lse) = 0, never NaN."""
    return lse.masked_fill(lse == NEG_INF, float("inf"))
