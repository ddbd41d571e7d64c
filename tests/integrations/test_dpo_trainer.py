"""HfcpDPOTrainer (TRL): 1 process (stock DPOTrainer, its fused LM head) vs cp 2 and dp 2 x cp 2."""
import pytest
import torch

import workers_dpo as W
from workers_balance import assert_imbalance_logged
from hfcp.testing.dist_pool import run_side_by_side

pytest.importorskip("trl")  # the optional extra hfcp[trl]; CI installs it


def assert_close(got: dict, ref: dict, tol=2e-5):
    assert got.keys() == ref.keys(), (got, ref)
    for k in ref:
        assert abs(got[k] - ref[k]) <= tol * max(1.0, abs(ref[k])), (k, got, ref)


def assert_same(got, ref):
    assert len(got["history"]) == len(ref["history"]) == 3, (got, ref)
    assert set(W.METRICS) <= ref["history"][0].keys(), ref["history"][0]  # every metric DPOTrainer logs
    for g, r in zip(got["history"], ref["history"]):
        assert_close(g, r)
    assert "eval_loss" in ref["eval"] and "eval_rewards/margins" in ref["eval"], ref["eval"]
    assert_close(got["eval"], ref["eval"])


@pytest.fixture(scope="module")
def dpo_reference(pool1):
    ref = pool1.run(W.dpo_run, 2)[0]
    assert ref["patched"] == (False, False), ref["patched"]  # one process: DPOTrainer as it is
    assert ref["history"][-1]["rewards/margins"] != 0, ref["history"]  # the policy moved away from the reference
    return ref


def test_dpo_cp2_equals_one_process(pool2, dpo_reference):
    """An explicit reference model (a copy of the initial policy), TRL's right padding."""
    runs = pool2.run(W.dpo_run, 2, 2)
    for got in runs:
        assert got["patched"] == (True, True), got["patched"]  # both models run CP, through hfcp's fused head
        assert_same(got, dpo_reference)
    assert_imbalance_logged(runs, dpo_reference)


def test_dpo_dp2_cp2_equals_one_process(pool4, dpo_reference):
    """Batches of 1 pair per DP group: the same global batches as one process with 2, each DP group counted once
    (num_tokens, the metrics' token-weighted means, the eval loss)."""
    for got in pool4.run(W.dpo_run, 1, 2):
        assert_same(got, dpo_reference)


def test_dpo_lora_left_padding_cp2_equals_one_process(pool1, pool2):
    """LoRA: the reference is the policy with its adapter disabled; rows padded on the left; DPOConfig's default
    gradient checkpointing; trainer.predict's logits (whole sequences, made whole from each rank's)."""
    checkpointing = {"gradient_checkpointing": True}
    (ref,), got_pool2 = run_side_by_side((pool1, W.dpo_run, 2, None, "lora", checkpointing, True, True),
                                         (pool2, W.dpo_run, 2, 2, "lora", checkpointing, True, True))
    for got in got_pool2:
        assert got["patched"] == (True, None), got["patched"]
        assert_same(got, ref)
        (logits, labels), (ref_logits, ref_labels) = got["predictions"], ref["predictions"]
        assert torch.equal(labels, ref_labels) and logits.shape == ref_logits.shape, (logits.shape, ref_logits.shape)
        assert float((logits - ref_logits).abs().max()) < 1e-4


def test_dpo_lora_reentrant_checkpointing_cp2_equals_one_process(pool1, pool2):
    """use_reentrant=True: DDP (CP always wraps the model in it) crashed in the first backward ("mark a variable
    ready only once") until hfcp gave it static_graph=True."""
    checkpointing = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    (ref,), got_pool2 = run_side_by_side((pool1, W.dpo_run, 2, None, "lora", checkpointing),
                                         (pool2, W.dpo_run, 2, 2, "lora", checkpointing))
    for got in got_pool2:
        assert_same(got, ref)


def test_dpo_full_weights_reentrant_checkpointing_accumulation_cp2_equals_one_process(pool1, pool2):
    """Every weight trains, use_reentrant=True, 2 micro-batches per step: DDP with the static_graph=True hfcp once
    chose failed its internal assert (expect_autograd_hooks_) in the first synced backward."""
    overrides = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True},
                 "gradient_accumulation_steps": 2}
    (ref,), got_pool2 = run_side_by_side((pool1, W.dpo_run, 1, None, "model", overrides),
                                         (pool2, W.dpo_run, 1, 2, "model", overrides))
    for got in got_pool2:
        assert_same(got, ref)


def test_dpo_precomputed_reference_gradient_accumulation_cp2_equals_one_process(pool1, pool2):
    """Reference log-probs computed before training (one copy per DP group), 2 micro-batches per step."""
    overrides = {"gradient_accumulation_steps": 2}
    (ref,), got_pool2 = run_side_by_side((pool1, W.dpo_run, 1, None, "precompute", overrides),
                                         (pool2, W.dpo_run, 1, 2, "precompute", overrides))
    for got in got_pool2:
        assert_same(got, ref)


def test_dpo_every_loss_type_cp2_equals_one_process(pool1, pool2):
    """Every loss type DPOTrainer offers (and RPO's sigmoid + sft, the f-divergences, ld_alpha, WPO weighting): the
    loss, the gradient norm and every logged metric of one batch, against a reference model that differs."""
    ref = pool1.run(W.loss_table)[0]
    assert len({round(r["loss"], 6) for r in ref}) > 10, ref  # the cases compute different things
    assert any(r["mean_token_accuracy"] > 0 for r in ref), ref
    for got in pool2.run(W.loss_table, 2):
        for case, g, r in zip(W.LOSS_CASES, got, ref):
            assert g.keys() == r.keys(), case
            for k in r:
                assert abs(g[k] - r[k]) <= 2e-5 * max(1.0, abs(r[k])), (case, k, g[k], r[k])


@pytest.mark.parametrize("kind, named", [("prompt_tuning", ["prompt-learning PEFT adapter", "use LoRA"]),
                                         ("moe_aux", ["router auxiliary loss", "router_aux_loss_coef=0.0"])])
def test_dpo_refuses_by_name_on_every_rank(pool2, kind, named):
    for message in pool2.run(W.refused, kind):
        assert message is not None and all(n in message for n in named), message
