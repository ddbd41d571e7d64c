"""HfcpGRPOTrainer (TRL): TRL's GRPOTrainer in one process (dp 1) or two (dp 2) vs HfcpGRPOTrainer at cp 2 (dp 1)
and dp 2 x cp 2 on the same data and seed: the same sampled completions, per-step losses, grad norms and every
logged metric."""
import pytest
import torch

import workers_grpo as W
from workers_balance import assert_imbalance_logged

pytest.importorskip("trl")  # the optional extra hfcp[trl]; CI installs it


def assert_same_run(got, ref, tol=2e-5, what=""):
    assert len(got["completions"]) == len(ref["completions"]) > 0, what
    for g, r in zip(got["completions"], ref["completions"]):
        assert torch.equal(g, r), (what, g, r)  # token ids and completion masks
    assert len(got["history"]) == len(ref["history"]) > 1, (what, got["history"], ref["history"])
    for g, r in zip(got["history"], ref["history"]):
        assert g.keys() == r.keys(), (what, g.keys() ^ r.keys())
        for k in r:
            assert abs(g[k] - r[k]) <= tol * max(1.0, abs(r[k])), (what, k, g[k], r[k])
    assert got["widest"] < ref["widest"], (what, got["widest"], ref["widest"])  # each rank embedded its shard only


@pytest.fixture(scope="module")
def grpo_reference(pool1):
    return pool1.run(W.grpo_run, 8, False, None, None, False, False, True)[0]


def test_grpo_cp2_equals_one_process(pool2, grpo_reference):
    """Left-padded prompts of 3 to 11 words, completions stopped at eos or 8 tokens, gradient checkpointing
    (GRPOConfig's default), 3 steps of one generation each, then an evaluation (generation and loss on 12 other
    prompts): both ranks draw what one process draws, and log what it logs."""
    logged = grpo_reference["history"][0].keys()
    assert {"loss", "grad_norm", "reward", "reward_std", "entropy", "num_tokens", "completions/mean_length",
            "clip_ratio/region_mean"} <= logged, logged
    assert {"eval_loss", "eval_reward", "eval_entropy"} <= grpo_reference["history"][-1].keys(), grpo_reference
    got = pool2.run(W.grpo_run, 8, True, None, None, False, False, True)
    for g in got:
        assert_same_run(g, grpo_reference)
    assert_imbalance_logged(got, grpo_reference)  # (left out of the histories compared: logged under CP only)
    # the rewards are computed once per CP group, by its first rank
    assert [g["reward_calls"] for g in got] == [grpo_reference["reward_calls"], 0], got
    assert len(grpo_reference["completions"]) == 3 + 6  # 3 training steps, 6 evaluation batches


def test_grpo_cp4_equals_one_process(pool4, grpo_reference):
    """The same run at cp 4 (dp 1): every rank holds a quarter of each sequence and draws what one process draws."""
    got = pool4.run(W.grpo_run, 8, True, None, None, False, False, True)
    for g in got:
        assert_same_run(g, grpo_reference)
    assert got[0]["widest"] < grpo_reference["widest"] / 2, (got[0]["widest"], grpo_reference["widest"])
    assert [g["reward_calls"] for g in got] == [grpo_reference["reward_calls"], 0, 0, 0], got


_STEP = {"max_steps": 2, "gradient_checkpointing": False, "epsilon": 0.05}
LOSS_CASES = [  # each loss type TRL offers, with the options that change what it normalises over
    {"overrides": {**_STEP, "loss_type": "grpo", "num_iterations": 2, "beta": 0.1, "max_steps": 3}, "reference": True},
    {"overrides": {**_STEP, "loss_type": "bnpo", "importance_sampling_level": "sequence",
                   "mask_truncated_completions": True}},
    {"overrides": {**_STEP, "loss_type": "dr_grpo", "gradient_accumulation_steps": 2, "scale_rewards": "batch"}},
    {"overrides": {**_STEP, "loss_type": "dapo", "epsilon_high": 0.28, "top_entropy_quantile": 0.5,
                   "num_iterations": 2}},
    {"overrides": {**_STEP, "loss_type": "cispo", "num_iterations": 2, "epsilon_high": 1.05}},
    {"overrides": {**_STEP, "loss_type": "sapo", "num_iterations": 2}},
    {"overrides": {**_STEP, "loss_type": "luspo", "num_iterations": 2, "importance_sampling_level": "sequence",
                   "epsilon": 0.5, "off_policy_mask_threshold": 0.5}},
    {"overrides": {**_STEP, "loss_type": "vespo", "num_iterations": 2, "delta": 1.5}},
]


def test_grpo_loss_types_cp2_equal_one_process(pool1, pool2):
    """Table-driven, one worker call per side: grpo with beta > 0 (TRL's reference model, patched alike) and two
    iterations over each generation (old-policy log-probs, clipping; the second generation's prompts are the next
    group's only if the generation batch is taken per DP group), bnpo with sequence-level importance
    sampling, dr_grpo with gradient accumulation, dapo over the high-entropy tokens, cispo, sapo, luspo, vespo."""
    refs = pool1.run(W.grpo_table, 8, False, LOSS_CASES)[0]
    assert refs[0]["reference"] == "unpatched" and refs[0]["history"][1]["kl"] > 0, refs[0]["history"]
    assert all(r["history"][1]["grad_norm"] > 0 for r in refs), [r["history"][1] for r in refs]
    for rank in pool2.run(W.grpo_table, 8, True, LOSS_CASES):
        assert rank[0]["reference"] == "patched"
        for case, g, r in zip(LOSS_CASES, rank, refs):
            assert_same_run(g, r, what=case["overrides"]["loss_type"])


def test_grpo_lora_with_kl_cp2_equals_one_process(pool1, pool2):
    """LoRA with beta > 0 (the reference log-probs come from the policy with its adapter disabled), under the
    allgather strategy (prefill, training forwards and backward)."""
    case = [{"overrides": {**_STEP, "beta": 0.2, "num_iterations": 2}, "lora": True, "strategy": "allgather"}]
    ref = pool1.run(W.grpo_table, 8, False, case)[0][0]
    assert ref["history"][1]["kl"] > 0, ref["history"]
    for rank in pool2.run(W.grpo_table, 8, True, case):
        assert rank[0]["strategy"] == "allgather"
        assert_same_run(rank[0], ref)


def test_grpo_dp2_cp2_equals_two_processes(pool2, pool4):
    """dp 2 x cp 2 against TRL's GRPOTrainer in two processes (dp 2): DP group d draws what process d draws, in
    training and in an evaluation."""
    case = [{"overrides": {"max_steps": 2, "gradient_checkpointing": False}, "evaluate": True}]
    refs = [r[0] for r in pool2.run(W.grpo_table, 4, False, case)]
    for rank, got in enumerate(pool4.run(W.grpo_table, 4, True, case, 2)):
        assert_same_run(got[0], refs[rank // 2], what=f"rank {rank}")


def test_grpo_refusals_on_every_rank(pool2):
    """Settings HfcpGRPOTrainer cannot run exactly are refused by name on every rank, before any collective; a
    reward function that raises on the rank computing the group's rewards is raised on every rank (none waits)."""
    for kind, (_, word) in W.REFUSED.items():
        for message in pool2.run(W.grpo_refused, kind, timeout=120):
            assert message.startswith("ValueError") and word in message, (kind, message)
    first, second = pool2.run(W.grpo_refused, "reward error", timeout=120)
    assert first.startswith("KeyError") and "no such column" in first, first
    assert second.startswith("RuntimeError") and "no such column" in second and "rank 0" in second, second


def test_grpo_explicit_generation_batch_is_said(pool2):
    """GRPOConfig divides an explicit generation_batch_size over all processes; under CP a CP group shares one
    batch, so the batch taken (and the steps_per_generation that would give the asked one) is said in a warning.
    Left unset, the generation batch is per_device x DP groups x gradient_accumulation_steps, and nothing is said."""
    for size, steps, logged in pool2.run(W.grpo_generation_batch, {"generation_batch_size": 16}, timeout=120):
        assert (size, steps) == (8, 2), (size, steps)  # GRPOConfig: 16 / (4 x 2 processes) = 2 steps
        assert "generates 8 completions" in logged and "steps_per_generation=4" in logged, logged
    for size, steps, logged in pool2.run(W.grpo_generation_batch, {"gradient_accumulation_steps": 2}, timeout=120):
        assert (size, steps, logged) == (8, 2, ""), (size, steps, logged)
