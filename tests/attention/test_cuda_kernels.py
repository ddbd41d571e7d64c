"""The CUDA tile kernels without a GPU: which kernel a tile takes, the self-checks and their fallbacks (CPU stand-ins
for the CUDA ops), the ops' signatures against the installed torch (meta tensors), and the GPU check's CPU smoke."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from hfcp.attention import cuda_kernels, kernels
from hfcp.attention import tiles as tiling

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def fresh_checks():
    """The self-check results are cached per (device, dtype): every test starts and ends without them."""
    kernels._flash_ok.cache_clear()
    kernels._masked_ok.cache_clear()
    yield
    kernels._flash_ok.cache_clear()
    kernels._masked_ok.cache_clear()


@pytest.mark.parametrize("device, dtype, head_dim, masked, extra, flash_ok, masked_ok, want", [
    ("cpu", BF16, 64, False, {}, True, True, "cpu"),
    ("cpu", F32, 64, True, {}, True, True, "cpu"),
    ("cuda:0", BF16, 64, False, {}, True, True, "flash"),
    ("cuda:0", torch.float16, 128, False, {}, True, True, "flash"),
    ("cuda:0", BF16, 64, True, {}, True, True, "masked"),  # a mask: never flash
    ("cuda:0", F32, 64, False, {}, True, True, "masked"),  # fp32: flash has none
    ("cuda:0", BF16, 20, False, {}, True, True, "masked"),  # head dim not a multiple of 8
    ("cuda:0", BF16, 64, False, {"rect_causal": True}, True, True, "masked"),  # flash would align it bottom-right
    ("cuda:0", BF16, 64, False, {}, False, True, "masked"),  # flash failed its check
    ("cuda:0", BF16, 64, True, {}, True, False, "math"),  # the masked kernel failed its check
    ("cuda:0", BF16, 64, False, {}, False, False, "math"),
    ("cuda:0", torch.float64, 64, False, {}, True, False, "math"),
    ("cuda:0", BF16, 64, False, {"softcap": 30.0}, True, True, "math"),  # no fused kernel caps scores
    ("cpu", F32, 64, False, {"softcap": 30.0}, True, True, "math"),
    ("mps", F32, 64, False, {}, True, True, "math"),
])
def test_choose_kernel(monkeypatch, device, dtype, head_dim, masked, extra, flash_ok, masked_ok, want):
    asked = []
    monkeypatch.setattr(kernels, "_flash_ok", lambda d, t: asked.append(("flash", t)) or flash_ok)
    monkeypatch.setattr(kernels, "_masked_ok", lambda d, t: asked.append(("masked", t)) or masked_ok)
    assert kernels.choose_kernel(device, dtype, head_dim, masked, **extra) == want
    if dtype not in cuda_kernels.FLASH_DTYPES or masked:
        assert ("flash", dtype) not in asked  # never self-checks flash where it cannot run


@pytest.mark.parametrize("flash_on, efficient_on, masked, want", [
    (False, True, False, "masked"), (True, False, False, "flash"), (True, False, True, "math"),
    (False, False, False, "math"),
])
def test_torch_sdpa_switches_are_followed(monkeypatch, flash_on, efficient_on, masked, want):
    """torch.backends.cuda.enable_flash_sdp(False) / enable_mem_efficient_sdp(False) keep hfcp off that kernel too."""
    monkeypatch.setattr(kernels, "_flash_ok", lambda d, t: True)
    monkeypatch.setattr(kernels, "_masked_ok", lambda d, t: True)
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: flash_on)
    monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: efficient_on)
    assert kernels.choose_kernel("cuda:0", BF16, 64, masked) == want
    assert kernels.has_fused_kernel("cuda:0", BF16) == efficient_on  # the planner then keeps tiles small


def test_has_fused_kernel_follows_the_masked_kernels_check(monkeypatch):
    """The planner keeps tiles small (math kernel) exactly when masked tiles have no fused kernel."""
    monkeypatch.setattr(kernels, "_masked_ok", lambda d, t: t == BF16)
    assert kernels.has_fused_kernel("cpu", F32)
    assert kernels.has_fused_kernel("cuda:0", BF16) and not kernels.has_fused_kernel("cuda:0", F32)
    assert not kernels.has_fused_kernel("mps", F32)


def _scaled(forward, factor):
    """A wrong kernel: `forward`'s output times `factor`."""
    def wrong(q, k, v, mask, is_causal, scale):
        out, lse = forward(q, k, v, mask, is_causal, scale)
        return out * factor, lse
    return wrong


def _stand_in(monkeypatch, flash_forward=kernels._cpu_forward, masked_forward=kernels._cpu_forward):
    """The CPU flash kernel (exact) stands in for the CUDA ops, unless a wrong forward is given."""
    monkeypatch.setattr(cuda_kernels, "flash_forward", flash_forward)
    monkeypatch.setattr(cuda_kernels, "flash_backward", kernels._cpu_backward)
    monkeypatch.setattr(cuda_kernels, "masked_forward", masked_forward)
    monkeypatch.setattr(cuda_kernels, "masked_backward", kernels._cpu_backward)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_self_checks_pass_an_exact_kernel_and_run_once(monkeypatch, dtype):
    calls = []
    def counting(*args):
        calls.append(1)
        return kernels._cpu_forward(*args)
    _stand_in(monkeypatch, flash_forward=counting)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        assert kernels._flash_ok("cpu", dtype) and kernels._masked_ok("cpu", dtype)
        n = len(calls)
        assert n == len(kernels._CHECK_CASES["flash"])
        assert kernels._flash_ok("cpu", dtype) and len(calls) == n  # cached per (device, dtype)


def test_flash_is_never_checked_in_fp32(monkeypatch):
    _stand_in(monkeypatch, flash_forward=lambda *a: pytest.fail("flash ran in fp32"))
    assert not kernels._flash_ok("cpu", F32)


def test_a_wrong_flash_kernel_falls_back_to_the_masked_kernel_with_a_warning(monkeypatch):
    _stand_in(monkeypatch, flash_forward=_scaled(kernels._cpu_forward, 1.5))
    with pytest.warns(UserWarning) as record:
        assert not kernels._flash_ok("cpu", BF16)
    (w,) = [str(r.message) for r in record]
    assert "the flash attention kernel failed its self-check" in w and "out differs from the math kernel" in w
    assert "the masked kernel (memory-efficient SDPA) runs unmasked tiles" in w
    assert kernels._masked_ok("cpu", BF16)


def test_a_wrong_backward_is_caught(monkeypatch):
    _stand_in(monkeypatch)
    monkeypatch.setattr(cuda_kernels, "flash_backward", lambda *a: tuple(g * 2 for g in kernels._cpu_backward(*a)))
    with pytest.warns(UserWarning, match=r"flash attention kernel failed .*dq differs"):
        assert not kernels._flash_ok("cpu", BF16)


def test_both_kernels_wrong_fall_back_to_math_and_name_it(monkeypatch):
    wrong = _scaled(kernels._cpu_forward, 0.5)
    _stand_in(monkeypatch, flash_forward=wrong, masked_forward=wrong)
    with pytest.warns(UserWarning) as record:
        assert not kernels._flash_ok("cpu", BF16)
    messages = [str(r.message) for r in record]
    assert any(m.startswith("hfcp: the masked attention kernel failed") for m in messages), messages
    flash = [m for m in messages if "the flash attention kernel failed" in m]
    assert len(flash) == 1 and "the exact math kernel runs every tile" in flash[0], messages


def test_a_kernel_that_raises_falls_back(monkeypatch):
    def raises(*a):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    _stand_in(monkeypatch, masked_forward=raises)
    with pytest.warns(UserWarning, match="the masked attention kernel failed.*Ampere.*exact math kernel"):
        assert not kernels._masked_ok("cpu", F32)


@pytest.mark.parametrize("kind, masked", [("flash", False), ("masked", True), ("masked", False)])
def test_tiles_run_on_the_chosen_kernel(monkeypatch, kind, masked):
    """kernel_forward / kernel_backward call the functions of the kernel choose_kernel names."""
    ran = []
    def record(name, fn):
        return lambda *a: ran.append(name) or fn(*a)
    monkeypatch.setattr(kernels, "choose_kernel", lambda *a, **k: kind)
    for other in ("flash", "masked"):
        monkeypatch.setattr(cuda_kernels, f"{other}_forward", record(f"{other} fwd", kernels._cpu_forward))
        monkeypatch.setattr(cuda_kernels, f"{other}_backward", record(f"{other} bwd", kernels._cpu_backward))
    g = torch.Generator().manual_seed(0)
    q, do = torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 4, 8, 16, generator=g)
    k, v = torch.randn(1, 2, 8, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g)
    mask = torch.zeros(1, 1, 8, 8) if masked else None
    out, lse = kernels.kernel_forward(q, k, v, mask, not masked, 0.25)
    kernels.kernel_backward(do, q, k, v, out, lse, mask, not masked, 0.25)
    assert ran == [f"{kind} fwd", f"{kind} bwd"]


def test_cuda_ops_match_the_installed_torch(monkeypatch):
    """The aten calls parse against torch's schemas and give the shapes hfcp relies on (meta tensors, no GPU):
    flash keeps K/V's heads (GQA) and an unpadded (B, H, Lq) lse; the masked kernel's padded lse is cut to Lq and its
    dk/dv are summed back to the KV heads."""
    monkeypatch.setattr(cuda_kernels, "flash_head_dim_ok", lambda d, n: True)
    q = torch.empty(2, 4, 40, 16, device="meta", dtype=BF16)
    k = torch.empty(2, 2, 24, 16, device="meta", dtype=BF16)
    mask = torch.zeros(2, 1, 40, 24, device="meta", dtype=BF16)
    for forward, backward, m in ((cuda_kernels.flash_forward, cuda_kernels.flash_backward, None),
                                 (cuda_kernels.masked_forward, cuda_kernels.masked_backward, mask)):
        out, lse = forward(q, k, k, m, False, 0.25)
        assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == F32
        dq, dk, dv = backward(q, q, k, k, out, lse, m, False, 0.25)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    with pytest.raises(AssertionError, match="causal only square"):
        cuda_kernels.flash_forward(q, k, k, None, True, 0.25)
    q20 = torch.empty(2, 4, 40, 20, device="meta", dtype=BF16)
    k20 = torch.empty(2, 2, 24, 20, device="meta", dtype=BF16)
    out, lse = cuda_kernels.masked_forward(q20, k20, k20, mask, False, 0.25)  # head dim 20: padded to 24 inside
    assert out.shape == q20.shape and lse.shape == (2, 4, 40)
    assert [g.shape for g in cuda_kernels.masked_backward(q20, q20, k20, k20, out, lse, mask, False, 0.25)] == \
        [q20.shape, k20.shape, k20.shape]


def test_views_reach_the_kernels_aligned():
    """Views that start or step off a 16-byte boundary are copied, head dims padded with zeros, aligned views kept."""
    x = torch.randn(1, 40, 4, 16).transpose(1, 2)  # (B, H, L, D) view of (B, L, H, D) memory, as transformers hands it
    assert cuda_kernels.aligned(x[:, :, 8:], 16).data_ptr() == x[:, :, 8:].data_ptr()  # a tile's slice: no copy
    odd = torch.randn(3 * 40 * 16 + 4)[4:].view(1, 3, 40, 16)  # starts 4 elements into its storage
    fixed = cuda_kernels.aligned(odd, 16)
    assert fixed.storage_offset() % 8 == 0 and torch.equal(fixed, odd)
    padded = cuda_kernels.aligned(torch.ones(1, 2, 5, 20), 24)
    assert padded.shape == (1, 2, 5, 24) and padded[..., 20:].abs().sum() == 0 and padded[..., :20].eq(1).all()


def test_flash_head_dims():
    assert not cuda_kernels.flash_head_dim_ok("cuda:0", 20) and not cuda_kernels.flash_head_dim_ok("cuda:0", 264)
    assert cuda_kernels.flash_head_dim_ok("cuda:0", 64) and cuda_kernels.flash_head_dim_ok("cuda:0", 192)


def test_masked_tile_bias_is_the_tiles_size_and_not_copied_when_aligned():
    allowed = torch.rand(2, 1, 5, 21, generator=torch.Generator().manual_seed(0)) < 0.6
    mask = cuda_kernels.aligned_mask(allowed, BF16)
    plain = torch.zeros(allowed.shape, dtype=BF16).masked_fill_(~allowed, float("-inf"))
    assert mask.shape == allowed.shape and mask.stride(-2) == 32 and torch.equal(mask, plain)
    assert mask.untyped_storage().nbytes() == 2 * 5 * 32 * 2  # the tile, its rows padded to 16 elements
    bias = cuda_kernels._bias(mask, 2, 4, 5, 21)
    assert bias.shape == (2, 4, 5, 21) and bias.data_ptr() == mask.data_ptr()  # a view: no copy per call
    copied = cuda_kernels._bias(plain, 2, 4, 5, 21)
    assert copied.stride(-2) % 16 == 0 and torch.equal(copied[:, 0], plain[:, 0])


def test_planner_masks_stay_plain_on_cpu():
    """The CPU path is unchanged: contiguous masks (the aligned ones are built for CUDA devices only)."""
    from hfcp.layout import Layout, build_step_batch

    pos = torch.cat([torch.arange(30), torch.arange(34)])[None]
    sb = build_step_batch(Layout(64, 1, zigzag=False), 0, 1, pos, None, "cpu")
    tiles = tiling.plan_tiles(tiling.MaskSpec(True, None), sb, [(0, 64)], [(0, 64)], F32, torch.device("cpu"))
    masked = [t for t in tiles if t.mask is not None]
    assert masked and all(t.mask.is_contiguous() for t in masked)


def test_gpu_kernels_check_cpu_smoke(tmp_path):
    """scripts/tools/gpu_kernels_check.py --cpu-smoke: both parts run (imports and torch APIs as on the GPU) and
    report."""
    out = tmp_path / "kernels.json"
    r = subprocess.run([sys.executable, "scripts/tools/gpu_kernels_check.py", "--cpu-smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == [] and [w["tokens"] for w in res["whole_row"]] == [128, 256]
    for w in res["whole_row"]:
        assert w["kernel"] == "cpu" and max(w["rel_err"].values()) < 1e-5 and w["ratio"] > 0, w
    assert {(r["workload"], r["cp"]) for r in res["emulated_ranks"]} == {(w, c) for w in ("long-tail", "one-long")
                                                                         for c in (2, 4)}
    for row in res["emulated_ranks"]:
        assert len(row["auto"]["rank_s"]) == len(row["row"]["rank_s"]) == row["cp"]
        assert row["auto"]["work_max_mean"] <= row["row"]["work_max_mean"] + 1e-9, row
    tail = [r for r in res["emulated_ranks"] if r["workload"] == "long-tail"]
    assert all(r["auto"]["layout"] == "balanced" and r["auto"]["work_max_mean"] < 1.05 for r in tail), tail
    assert "| 512 tokens, long-tail | 2 | auto (balanced) |" in r.stdout
