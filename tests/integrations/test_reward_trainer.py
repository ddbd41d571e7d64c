"""HfcpRewardTrainer (TRL): 1 process (stock RewardTrainer) vs cp 2 and dp 2 x cp 2, on a tiny Llama reward model."""
import pytest

import workers_reward as W
from workers_balance import assert_imbalance_logged
from hfcp.testing.dist_pool import run_side_by_side

pytest.importorskip("trl")  # the optional extra hfcp[trl]; CI installs it

EVAL_KEYS = {"eval_" + k for k in W.METRICS if k not in ("grad_norm", "learning_rate", "num_input_tokens_seen")}


def assert_same(got, ref, tol=2e-5):
    assert len(got["history"]) == len(ref["history"]) == 3, (got, ref)
    for g, r in zip(got["history"], ref["history"]):
        assert g.keys() == r.keys() == set(W.METRICS), (g, r)
        for k in g:
            assert abs(g[k] - r[k]) <= tol * max(1.0, abs(r[k])), (k, g, r)
    assert got["eval"].keys() == ref["eval"].keys() == EVAL_KEYS, (got["eval"], ref["eval"])
    for k in ref["eval"]:
        assert abs(got["eval"][k] - ref["eval"][k]) <= tol * max(1.0, abs(ref["eval"][k])), (k, got, ref)


@pytest.fixture(scope="module")
def reward_reference(pool1):
    """center_rewards_coefficient 0.01, TRL's collator (right padding); 4 pairs a step, the eval's last batch 2."""
    return pool1.run(W.reward_run, 4)[0]


def test_reward_cp2_equals_one_process(pool2, reward_reference):
    runs = pool2.run(W.reward_run, 4)
    for got in runs:
        assert got["last_token_ranks"] == {0, 1}  # the scores come from either rank, depending on the row
        assert_same(got, reward_reference)
    assert_imbalance_logged(runs, reward_reference)


def test_reward_dp2_cp2_equals_one_process(pool4, reward_reference):
    """2 pairs per DP group; the eval's last step has 2 pairs of the dataset, and accelerate fills the second DP
    group with repeated pairs, which the loss and the metrics leave out as one process never sees them."""
    for got in pool4.run(W.reward_run, 2, 2):
        assert_same(got, reward_reference)


def test_reward_cp4_equals_one_process(pool4, reward_reference):
    for got in pool4.run(W.reward_run, 4, 4):
        assert_same(got, reward_reference)


def test_reward_streamed_eval_dp2_cp2_equals_one_process(pool1, pool4):
    """An evaluation set without a length (a datasets.IterableDataset): one process (accelerate's dispatcher) weighs
    its last, partial step by the rows of the collated batch, two a pair (here as a full batch), and so does the
    gather here (the eval loss is the whole step's on every rank), also without average_tokens_across_devices."""
    case = (None, {"average_tokens_across_devices": False}, False, False, False, True)
    (ref,), got_pool4 = run_side_by_side((pool1, W.reward_run, 4, *case), (pool4, W.reward_run, 2, 2, *case[1:]))
    for got in got_pool4:
        assert_same(got, ref)


def test_reward_left_padding_accumulation_margin_cp2_equals_one_process(pool1, pool2):
    """Left padding (a collator of one's own), gradient accumulation over 2 micro-batches, a margin column (it
    reaches the loss, never the model's attention)."""
    case = (4, None, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, True, False, True)
    (ref,), got_pool2 = run_side_by_side((pool1, W.reward_run, *case), (pool2, W.reward_run, *case))
    for got in got_pool2:
        assert_same(got, ref)


def test_reward_lora_cp2_equals_one_process(pool1, pool2):
    """PEFT LoRA (task_type SEQ_CLS: the score head trained in full) given to the trainer as peft_config, with
    gradient checkpointing (the decoder layers recomputed in backward)."""
    case = (4, None, {"gradient_checkpointing": True}, False, True)
    (ref,), got_pool2 = run_side_by_side((pool1, W.reward_run, *case), (pool2, W.reward_run, *case))
    for got in got_pool2:
        assert_same(got, ref)


def test_reward_refuses_a_model_that_is_no_sequence_classifier(pool2):
    for message in pool2.run(W.refused_causal_lm):
        assert "needs a sequence classifier" in message and "LlamaForCausalLM" in message, message
        assert "LlamaForSequenceClassification" in message, message
