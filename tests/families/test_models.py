"""Patched vs unpatched tiny seeded models: loss, gathered logits, every parameter gradient."""
import pytest

import workers_model as W

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
STRATEGIES = ["ring", "allgather", "ulysses"]
TOL = 1e-5


def _check(results, grad_tol=TOL):
    errs = results[0]
    assert errs["loss"] < TOL and errs["seq"] < TOL and errs["grad"] < grad_tol, errs
    assert errs["n_grads"] > 0
    assert len({r["loss_value"] for r in results}) == 1, "loss differs between ranks"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_cp2(pool2, family, strategy):
    _check(pool2.run(W.run_case, dict(family=family, strategy=strategy, cp=2, B=2, L=29)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_family_cp4(pool4, family, strategy):
    case = dict(family=family, strategy=strategy, cp=4, B=2, L=38, config=dict(num_key_value_heads=4))
    _check(pool4.run(W.run_case, case))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp2_x_cp2(pool4, strategy):
    """World 4, cp 2: two CP groups, each with the same batch here; loss and grads exact in each."""
    _check(pool4.run(W.run_case, dict(family="llama", strategy=strategy, cp=2, B=2, L=29)))


VARIANTS = {
    "packed": dict(packed=True),
    "padded": dict(padded=True),
    "left_padded": dict(padded="left"),
    "packed_sliding": dict(family="mistral", packed=True),
    "lora": dict(lora=True),
    "lora_checkpointing": dict(lora=True, checkpointing=True),
    "checkpointing": dict(checkpointing=True),
    "eval_mode": dict(train=False),
    "batch_1": dict(B=1),
    "batch_3_odd": dict(B=3, L=31),
    "base_model": dict(base=True, labels=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_variants(pool2, strategy, variant):
    case = {**dict(family="llama", strategy=strategy, cp=2, B=2, L=29), **VARIANTS[variant]}
    _check(pool2.run(W.run_case, case))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ddp_dp2_x_cp2_each_cp_group_its_own_batch(pool4, strategy):
    """World 4, cp 2, DDP: each CP group runs its own batch; DDP-averaged grads == mean of single-device grads."""
    case = dict(family="llama", strategy=strategy, cp=2, B=2, L=29, ddp=True, dp_batches=True, lora=True)
    results = pool4.run(W.run_case, case)
    for r in results:
        assert r["loss"] < TOL and r["seq"] < TOL and r["grad"] < TOL, r
    assert results[0]["loss_value"] == results[1]["loss_value"] != results[2]["loss_value"] == results[3]["loss_value"]


def test_patch_before_get_peft_model(pool2):
    _check(pool2.run(W.run_case, dict(family="llama", strategy="ring", cp=2, B=2, L=29, lora=True, patch_first=True)))


def test_bf16_close_to_fp32_reference(pool2):
    results = pool2.run(W.run_case, dict(family="llama", strategy="ring", cp=2, B=2, L=29, dtype="bf16"))
    assert results[0]["loss"] < 2e-2 and results[0]["seq"] < 5e-2, results[0]


@pytest.mark.parametrize("variant", [dict(), dict(lora=True, checkpointing=True), dict(packed=True, B=3)])
def test_chunked_loss_matches_logits_path(pool2, variant):
    import workers_loss

    case = {**dict(family="llama", strategy="ring", cp=2, B=2, L=61), **variant}
    r = pool2.run(workers_loss.chunked_vs_logits, case, 8)[0]
    assert r["loss"] < 1e-6 and r["grad"] < 1e-5 and r["same_keys"] and r["logits_none"], r
    assert 0 < r["max_logit_rows"] <= 8 < r["max_logit_rows_unchunked"], r  # at most one chunk's logits at a time


def test_default_loss_chunk_is_chunked_in_training_only(pool2):
    import workers_loss

    r = pool2.run(workers_loss.auto_default, dict(family="llama", strategy="ring", cp=2, B=2, L=30))[0]
    assert r["train_logits_none"] and r["loss"] < 1e-6, r
    assert r["no_grad_logits"] == r["eval_logits"] == r["after_logits"] == (2, 16, 64), r  # local: 30 -> 32 / 2 ranks
    assert r["per_call_logits_none"], r  # hfcp_loss_chunk=8 chunks this forward only
    assert r["per_call_refused"].startswith("hfcp_loss_chunk=0 must be a positive number of tokens"), r


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", [{}, dict(packed=True), dict(padded="left")])
def test_usp_cp4_with_two_kv_heads(pool4, family, variant):
    """World 4 with 2 KV heads: plain Ulysses cannot split them over 4 ranks; usp runs Ulysses 2 x ring 2."""
    _check(pool4.run(W.run_case, dict(family=family, strategy="usp", cp=4, B=2, L=38, **variant)))
