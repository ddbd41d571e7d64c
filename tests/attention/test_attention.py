"""CP attention vs dense single-device attention: outputs and every input gradient, each strategy x mask."""
import pytest
import torch

import workers_attention as W

STRATEGIES = ["ring", "allgather", "ulysses"]
MASKS = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "sliding_window": dict(causal=True, window=5),
    "packed": dict(causal=True, packed=True),
    "packed_window": dict(causal=True, packed=True, window=4),
    "padded": dict(causal=True, padded=True),
    "odd_length": dict(causal=True, L=23),
    "mha": dict(causal=True, mha=True),
    "chunked": dict(causal=True, chunk=6),  # Llama 4's chunked attention
    "packed_chunked": dict(causal=True, packed=True, chunk=5),
    "padded_chunked": dict(causal=True, padded=True, chunk=7),
    "offset_packed_chunked": dict(causal=True, packed=True, offset_packed=True, chunk=4),
}
TOL = 1e-5


def _case(strategy, mask, cp, **extra):
    heads = dict(H=2 * cp, Hkv=2 * cp if MASKS[mask].get("mha") else cp)  # GQA, divisible for ulysses
    return {**dict(B=2, L=40, cp=cp, strategy=strategy), **heads, **MASKS[mask], **extra}


def _check(errs):
    assert errs["finite"]
    assert errs["empty_rows_zero"] == 0.0
    for name in ("out", "dq", "dk", "dv"):
        assert errs[name] < TOL, (name, errs)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_attention_cp2(pool2, strategy, mask):
    _check(pool2.run(W.run_case, _case(strategy, mask, 2))[0])


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_attention_cp4(pool4, strategy, mask):
    _check(pool4.run(W.run_case, _case(strategy, mask, 4, **({} if mask == "odd_length" else {"L": 64})))[0])


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_split_tiles_are_exact(pool2, strategy):
    """Partial tiles larger than MAX_TILE^2 are split; the split plan gives the same result."""
    _check(pool2.run(W.run_case, _case(strategy, "packed_window", 2, L=96, max_tile=8))[0])


@pytest.mark.parametrize("mask", ["causal", "bidirectional", "packed_window"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kernel_pieces_are_exact(pool2, strategy, mask):
    """Forward and backward in kernel calls of at most 8 x 8 (KERNEL_TILE, 2048 by default): the same output and
    gradients."""
    _check(pool2.run(W.run_case, _case(strategy, mask, 2, L=56, kernel_tile=8))[0])


def test_kernel_pieces_cover_the_tile(monkeypatch):
    """A causal tile's pieces cover exactly its lower triangle, each once, none larger than KERNEL_TILE; a full
    tile's pieces cover it whole; a masked tile stays whole."""
    from hfcp.attention import tiles as tiling

    monkeypatch.setattr(tiling, "KERNEL_TILE", 8)
    for tile, want in ((tiling.Tile(3, 21, 5, 21, is_causal=True), torch.ones(21, 21).tril()),
                       (tiling.Tile(3, 21, 5, 17), torch.ones(21, 17))):
        seen = torch.zeros_like(want)
        pieces = tiling.kernel_pieces(tile)
        for p in pieces:
            assert p.q_len <= 8 and p.k_len <= 8 and (not p.is_causal or p.q_len == p.k_len), p
            block = torch.ones(p.q_len, p.k_len).tril() if p.is_causal else torch.ones(p.q_len, p.k_len)
            seen[p.q_off - 3 : p.q_off - 3 + p.q_len, p.k_off - 5 : p.k_off - 5 + p.k_len] += block
        assert len(pieces) > 3 and torch.equal(seen, want)
    masked = tiling.Tile(0, 20, 0, 20, mask=torch.zeros(1, 1, 20, 20))
    assert tiling.kernel_pieces(masked) == [masked]


def test_bf16_within_bf16_tolerance(pool2):
    errs = pool2.run(W.run_case, _case("ring", "packed", 2, dtype=torch.bfloat16))[0]
    assert errs["finite"]
    assert errs["out"] < 2e-2 and errs["dq"] < 5e-2 and errs["dk"] < 5e-2, errs


def test_fully_masked_rows_and_blocks_give_zero_not_nan(pool2):
    """Left padding of a third of the sequence: whole query rows and whole tiles have no key."""
    errs = pool2.run(W.run_case, _case("ring", "padded", 2, L=12))[0]
    _check(errs)


def test_ulysses_indivisible_heads_names_both_numbers(pool2):
    with pytest.raises(RuntimeError, match="num_key_value_heads=1 .*cp_size=2.*strategy='ring'"):
        pool2.run(W.run_case, {**_case("ulysses", "causal", 2), "Hkv": 1})


def test_math_kernel_tiles_match_dense(monkeypatch):
    """The plain-math tile kernel (used off CPU, every tile split to MAX_TILE) equals dense attention,
    forward and backward."""
    from hfcp.attention import kernels
    from hfcp.attention import tiles as tiling
    from hfcp.layout import Layout, build_step_batch

    case = dict(B=2, H=4, Hkv=2, L=40, causal=True, packed=True, window=9)
    q, k, v, dout, pos, mask = W.make_case(case)
    scale = 8 ** -0.5
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = W.dense_attention(qr, kr, vr, W.dense_allowed(case, pos, mask), scale)
    ref.backward(dout)
    monkeypatch.setattr(tiling, "has_fused_kernel", lambda device, dtype: False)  # the math-kernel path
    monkeypatch.setattr(tiling, "kernel_forward", kernels.reference_forward)
    monkeypatch.setattr(tiling, "kernel_backward", kernels.reference_backward)
    monkeypatch.setattr(tiling, "MAX_TILE", 8)
    sb = build_step_batch(Layout(40, 1, zigzag=False), 0, 2, pos, mask, "cpu")
    tiles = tiling.plan_tiles(tiling.MaskSpec(True, 9), sb, [(0, 40)], [(0, 40)], q.dtype, q.device)
    assert len(tiles) > 5 and all(t.q_len * t.k_len <= 64 for t in tiles)
    out, lse = tiling.new_accumulators(q)
    tiling.forward_tiles(q, k, v, tiles, scale, out, lse)
    assert float((out - ref).abs().max()) < 1e-5
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    tiling.backward_tiles(dout, q, k, v, out, lse, tiles, scale, dq, dk, dv)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_32k_tokens_merge_without_overflow(pool2):
    r = pool2.run(W.long_sequence, 32768, "ring", timeout=600)[0]
    assert r["finite"] and r["err"] < 1e-4, r


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("mask", ["causal", "padded"])
def test_attention_sink_exact(pool2, strategy, mask):
    case = dict(cp=2, B=2, L=37, H=4, Hkv=2, D=8, strategy=strategy, causal=True, sink=True,
                padded=mask == "padded")
    for errs in pool2.run(W.run_case, case):
        _check(errs)  # rows without keys put all their mass on the sink: output 0
        assert errs["dsink"] < TOL, errs


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("mask", ["causal", "packed_window", "padded"])
def test_attention_softcap_exact(pool2, strategy, mask):
    """Scores well beyond the cap (q scaled up), so the tanh bends them: without the cap the outputs differ."""
    case = _case(strategy, mask, 2, softcap=1.5, q_gain=4.0)
    _check(pool2.run(W.run_case, case)[0])
    assert pool2.run(W.run_case, {**case, "drop_cap": True})[0]["out"] > 1e-2  # the cap matters in this case


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("ulysses_size", [1, 2, 4])
def test_usp_cp4(pool4, mask, ulysses_size):
    """Ulysses groups of 1 (a ring), 2 (2 x ring 2) and 4 (all-to-all only) over 4 ranks, every mask."""
    case = _case("usp", mask, 4, ulysses_size=ulysses_size, **({} if mask == "odd_length" else {"L": 64}))
    _check(pool4.run(W.run_case, case)[0])


@pytest.mark.parametrize("extra", [dict(sink=True), dict(softcap=1.5, q_gain=4.0)])
def test_usp_sink_and_softcap(pool4, extra):
    errs = pool4.run(W.run_case, _case("usp", "padded", 4, ulysses_size=2, L=64, **extra))[0]
    _check(errs)
    assert errs.get("dsink", 0.0) < TOL, errs
