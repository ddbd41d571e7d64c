"""CUDA checks (skipped without a GPU; run by scripts/gpu_check.sh on a GPU machine)."""
import pytest
import torch

import workers_attention as W

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cuda_kernel_passes_its_self_check(dtype):
    from hfcp.attention import kernels

    assert kernels.has_fused_kernel("cuda:0", dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_kernel_passes_its_self_check_and_takes_unmasked_tiles(dtype):
    """fp16 / bf16 tiles without a mask run on torch's flash kernel, masked ones on the memory-efficient kernel, fp32
    never on flash; no self-check warns."""
    import warnings

    from hfcp.attention import kernels

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.choose_kernel("cuda:0", dtype, 64, masked=False) == "flash"
        assert kernels.choose_kernel("cuda:0", dtype, 128, masked=True) == "masked"
        assert kernels.choose_kernel("cuda:0", torch.float32, 64, masked=False) == "masked"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [dict(causal=True, packed=True, window=9), dict(causal=False, padded=True),
                                  dict(causal=True), dict(causal=True, packed=True, D=20)])  # D=20: padded to 24
def test_cuda_tiles_match_dense(case, dtype):
    """Block planner + CUDA kernels (bf16: flash for unmasked tiles, memory-efficient for masked ones; fp32: the
    memory-efficient kernel), forward and backward, against fp32 dense attention (one GPU)."""
    from hfcp.attention import tiles as tiling
    from hfcp.layout import Layout, build_step_batch

    case = dict(B=2, H=4, Hkv=2, L=300, **case)
    q, k, v, dout, pos, mask = W.make_case(case)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = W.dense_attention(qr, kr, vr, W.dense_allowed(case, pos, mask), 8 ** -0.5)
    ref.backward(dout)
    dev = torch.device("cuda:0")
    q, k, v, dout = (t.to(dev, dtype) for t in (q, k, v, dout))
    pos = pos.to(dev) if pos is not None else None
    mask = mask.to(dev) if mask is not None else None
    sb = build_step_batch(Layout(300, 1, zigzag=False), 0, 2, pos, mask, dev)
    spec = tiling.MaskSpec(case["causal"], case.get("window"))
    tiles = tiling.plan_tiles(spec, sb, [(0, 150), (150, 150)], [(0, 150), (150, 150)], q.dtype, dev)
    out, lse = tiling.new_accumulators(q)
    tiling.forward_tiles(q, k, v, tiles, 8 ** -0.5, out, lse)
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    tiling.backward_tiles(dout, q, k, v, out.to(q.dtype), lse, tiles, 8 ** -0.5, dq, dk, dv)
    valid = W.dense_allowed(case, pos.cpu() if pos is not None else None,
                            mask.cpu() if mask is not None else None).any(-1)[..., None]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert float(((out.float().cpu() - ref.detach()) * valid).abs().max() / ref.detach().abs().max()) < tol
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert float((got.float().cpu() - want).abs().max() / want.abs().max()) < tol


def test_cuda_decode_attention_matches_one_rank_dense():
    """The decode step's attention (hfcp/attention/decode.py) on the GPU, one rank (a world of 1 over NCCL), against
    softmax attention over the same keys: causal by column, a window, softcap and GQA. (One process runs a patched
    model unchanged, so generation under CP itself needs 2 GPUs: tests/inference/test_inference.py's workers under
    NCCL.)"""
    import torch.distributed as dist

    from hfcp.layout.masks import MaskSpec
    from hfcp.attention.decode import decode_attention

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g).to(dev) for s in ((2, 4, 2, 8), (2, 2, 50, 8), (2, 2, 50, 8)))
    columns, new = torch.arange(50, device=dev), torch.tensor([48, 49], device=dev)
    valid = torch.ones(2, 50, dtype=torch.bool, device=dev)
    valid[0, :5] = False
    spec = MaskSpec(True, 20, 30.0)
    got = decode_attention(q, k, v, new, columns, valid, spec, 8 ** -0.5, dist.group.WORLD)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.tanh(q @ kk.transpose(-1, -2) * 8 ** -0.5 / 30.0) * 30.0
    gap = new[:, None] - columns[None]
    allowed = (gap >= 0) & (gap < 20) & valid[:, None, None, :]
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vv
    assert float((got - want).abs().max()) < 1e-5

