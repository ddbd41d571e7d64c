"""Local attention kernels that return the log-sum-exp, with their backward, and the LSE merge.

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H % Hkv == 0 (GQA: K/V are never repeated before
this point); mask None or an additive float mask broadcastable to (B, 1, Lq, Lk) in q's dtype;
lse (B, H, Lq) float32 (float64 for a float64 model: see acc_dtype), natural log of the sum of exp(scale * q.k) over the
allowed keys.

On CUDA, hfcp.attention.cuda_kernels: torch's flash kernel for tiles without a mask (fp16 / bf16), the
memory-efficient kernel for masked tiles and fp32; each runs only after its self-check against the math kernel
(`choose_kernel` decides per tile; a failed check warns and names what runs instead).

Memory layout: transformers hands attention (B, L, H, D) memory viewed as (B, H, L, D), and the CPU flash
kernel is 10-15% faster on that layout than on contiguous (B, H, L, D) (measured, torch 2.13, one thread), so
hfcp keeps it: accumulators are allocated like q, and K/V blocks travel in their own layout.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from . import cuda_kernels

NEG_INF = float("-inf")


def autocast_off(device_type: str):
    """Autocast off on `device_type`; nothing to turn off on a device without autocast (meta: hfcp's dry run)."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def autocast_on(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


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


# the self-checks' cases: (name, key length, causal, masked); the masked kernel also runs unmasked tiles when the
# flash kernel is unavailable, so its check covers both
_CHECK_CASES = {"flash": ((40, True, False), (24, False, False)), "masked": ((40, True, False), (40, False, True))}
_FALLBACK = {"flash": "the masked kernel (memory-efficient SDPA) runs unmasked tiles",
             "masked": "the exact math kernel runs every tile (slower, tiles of at most MAX_TILE x MAX_TILE)"}


def _check_mask(device, dtype, g):
    """(2, 1, 40, 40) additive mask with ~30% of keys masked and row 5 of batch 1 fully masked (an empty row)."""
    mask = torch.zeros(2, 1, 40, 40).masked_fill_(torch.rand(2, 1, 40, 40, generator=g) < 0.3, NEG_INF)
    mask[..., 0] = 0.0
    mask[1, :, 5] = NEG_INF
    return mask.to(device, dtype)


def self_check(name: str, forward, backward, device, dtype: torch.dtype) -> None:
    """Compare a tile kernel (forward, backward) with the math kernel on small GQA shapes, as the blocks call it
    (backward from the merged out and lse, +inf on empty rows). Raises RuntimeError naming what disagreed."""
    g = torch.Generator(device="cpu").manual_seed(0)
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    for lk, causal, masked in _CHECK_CASES[name]:
        q, do = (torch.randn(2, 4, 40, 16, generator=g).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(2, 2, lk, 16, generator=g).to(device, dtype) for _ in range(2))
        m = _check_mask(device, dtype, g) if masked else None
        keep = (m.amax(-1) > NEG_INF) if masked else torch.ones(1, 1, 40, dtype=torch.bool, device=device)
        o1, l1 = forward(q, k, v, m, causal, 0.25)
        o2, l2 = reference_forward(q, k, v, m, causal, 0.25)
        lse_b = lse_for_backward(l2)
        g1 = backward(do, q, k, v, o2, lse_b, m, causal, 0.25)
        g2 = reference_backward(do, q, k, v, o2, lse_b, m, causal, 0.25)
        pairs = {"out": (o1 * keep[..., None], o2 * keep[..., None]), "dq": (g1[0], g2[0]), "dk": (g1[1], g2[1]),
                 "lse": (l1.masked_fill(~keep, 0), l2.masked_fill(~keep, 0)), "dv": (g1[2], g2[2])}
        for what, (a, b) in pairs.items():
            if a.shape != b.shape or not bool(torch.isfinite(a).all()):
                raise RuntimeError(f"{what}: shape {tuple(a.shape)} (want {tuple(b.shape)}) or non-finite values")
            err = float((a.float() - b.float()).abs().max())
            if err > tol * (1 + float(b.float().abs().max())):
                raise RuntimeError(f"{what} differs from the math kernel by {err:.3g} (causal={causal}, mask={masked})")


def _checked(name: str, device: str, dtype: torch.dtype) -> bool:
    """Run the self-check of CUDA kernel `name` once; on any error or mismatch warn, naming the kernel and what runs
    instead, and return False."""
    try:
        self_check(name, getattr(cuda_kernels, f"{name}_forward"), getattr(cuda_kernels, f"{name}_backward"), device,
                   dtype)
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        fallback = _FALLBACK[name] if name == "masked" or _masked_ok(device, dtype) else _FALLBACK["masked"]
        warnings.warn(f"hfcp: the {name} attention kernel failed its self-check on {device} for {dtype} ({e}); "
                      f"{fallback}")
        return False


@functools.lru_cache(maxsize=None)
def _masked_ok(device: str, dtype: torch.dtype) -> bool:
    """Whether the masked (memory-efficient SDPA) kernel passed its self-check on this device and dtype."""
    return _checked("masked", device, dtype)


@functools.lru_cache(maxsize=None)
def _flash_ok(device: str, dtype: torch.dtype) -> bool:
    """Whether the flash kernel passed its self-check on this device and dtype (fp16 / bf16 only)."""
    return dtype in cuda_kernels.FLASH_DTYPES and _checked("flash", device, dtype)


def choose_kernel(device, dtype: torch.dtype, head_dim: int, masked: bool, softcap: float | None = None,
                  rect_causal: bool = False) -> str:
    """The kernel of one tile: "math" (a softcap, or no fused kernel passed its check), "cpu" (the CPU flash kernel),
    "flash" (CUDA, a tile without a mask in fp16 / bf16) or "masked" (CUDA memory-efficient SDPA: masked tiles, fp32,
    and unmasked tiles the flash kernel does not take). rect_causal: a causal tile with Lq != Lk, which flash would
    align bottom-right (the planner makes none). A kernel switched off in torch's SDPA switches
    (torch.backends.cuda.enable_flash_sdp(False), enable_mem_efficient_sdp(False)) is not used."""
    device = torch.device(device)
    if softcap is not None:
        return "math"
    if device.type in ("cpu", "meta"):  # (meta: hfcp's dry run, which takes the CPU kernel's shapes)
        return "cpu"
    if device.type != "cuda":
        return "math"
    flash_may = not masked and not rect_causal and dtype in cuda_kernels.FLASH_DTYPES
    if flash_may and torch.backends.cuda.flash_sdp_enabled() and cuda_kernels.flash_head_dim_ok(device, head_dim) \
            and _flash_ok(str(device), dtype):
        return "flash"
    return "masked" if _masked_usable(device, dtype) else "math"


def _masked_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """The memory-efficient kernel: enabled in torch's SDPA switches (torch.backends.cuda.enable_mem_efficient_sdp;
    hfcp follows them as SDPA does) and past its self-check."""
    return torch.backends.cuda.mem_efficient_sdp_enabled() and _masked_ok(str(device), dtype)


def has_fused_kernel(device, dtype=torch.float32) -> bool:
    """Whether masked tiles run on a fused kernel that tiles internally (CPU flash, CUDA memory-efficient SDPA after
    its self-check); else the plain-math kernel, whose tiles the planner keeps small."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):  # (meta: hfcp's dry run, which takes the CPU kernels)
        return True
    return device.type == "cuda" and _masked_usable(device, dtype)


def _kernel(q, k, mask, is_causal: bool):
    """(forward, backward) of the kernel this tile takes (choose_kernel), looked up at call time."""
    kind = choose_kernel(q.device, q.dtype, q.shape[-1], mask is not None, None, is_causal and q.shape[2] != k.shape[2])
    return {"cpu": (_cpu_forward, _cpu_backward), "math": (reference_forward, reference_backward),
            "flash": (cuda_kernels.flash_forward, cuda_kernels.flash_backward),
            "masked": (cuda_kernels.masked_forward, cuda_kernels.masked_backward)}[kind]


def kernel_forward(q, k, v, mask, is_causal: bool, scale: float, softcap: float | None = None):
    """One block of attention: returns (out in q's dtype, lse in acc_dtype). q, k, v share one dtype; autocast
    is off inside (the caller brought q/k/v to the autocast dtype, as SDPA does). A softcap takes the math kernel."""
    with autocast_off(q.device.type):
        if softcap is not None:
            return reference_forward(q, k, v, mask, is_causal, scale, softcap)
        out, lse = _kernel(q, k, mask, is_causal)[0](q, k, v, mask, is_causal, scale)
        return out, lse.to(acc_dtype(q.dtype))


def kernel_backward(dout, q, k, v, out, lse, mask, is_causal: bool, scale: float, softcap: float | None = None):
    """Block gradients given the *merged* out and lse (rows with no key anywhere carry lse = +inf)."""
    with autocast_off(q.device.type):
        if softcap is not None:
            return reference_backward(dout, q, k, v, out, lse, mask, is_causal, scale, softcap)
        return _kernel(q, k, mask, is_causal)[1](dout, q, k, v, out, lse, mask, is_causal, scale)


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
