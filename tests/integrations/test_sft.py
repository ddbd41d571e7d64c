"""HfcpSFTTrainer (TRL): 1 process (stock SFTTrainer, fused LM head) vs cp 2 and dp 2 x cp 2."""
import pytest
import torch

import workers_trainer as W
from workers_balance import assert_imbalance_logged
from hfcp.testing.dist_pool import run_side_by_side

pytest.importorskip("trl")  # the optional extra hfcp[trl]; CI installs it


def assert_same(got, ref, tol=2e-5):
    assert len(got["history"]) == len(ref["history"]) == 4, (got, ref)
    for g, r in zip(got["history"], ref["history"]):
        assert g.keys() == r.keys() and {"mean_token_accuracy", "entropy", "num_tokens"} <= g.keys(), (g, r)
        for k in g:
            assert abs(g[k] - r[k]) <= tol * max(1.0, abs(r[k])), (k, g, r)
    assert got["eval"].keys() == ref["eval"].keys() and len(ref["eval"]) == 3, (got["eval"], ref["eval"])
    for k in ref["eval"]:
        assert abs(got["eval"][k] - ref["eval"][k]) <= tol * max(1.0, abs(ref["eval"][k])), (k, got, ref)


@pytest.fixture(scope="module")
def sft_reference(pool1):
    return pool1.run(W.sft_run, 4)[0]


def test_sft_cp2_equals_one_process(pool2, sft_reference):
    for got in pool2.run(W.sft_run, 4):
        assert_same(got, sft_reference)
        # the same batches as one process (dp 1), so the same padding: predictions compare as arrays
        assert got["predictions"].shape == sft_reference["predictions"].shape
        assert float((got["predictions"] - sft_reference["predictions"]).abs().max()) < 1e-4
        assert (got["label_ids"] == sft_reference["label_ids"]).all()


def test_sft_packing_cp2_equals_one_process(pool1, pool2):
    (ref,), runs = run_side_by_side((pool1, W.sft_run, 2, None, {"packing": True, "max_length": 48}),
                                    (pool2, W.sft_run, 2, None, {"packing": True, "max_length": 48}))
    for got in runs:
        assert_same(got, ref)
    assert_imbalance_logged(runs, ref)


def test_sft_dp2_cp2_equals_one_process(pool4, sft_reference):
    for got in pool4.run(W.sft_run, 2, 2):
        assert_same(got, sft_reference)


def test_sft_eval_batch_without_targets_counts_as_zero(pool1, pool2, pool4):
    """SFTTrainer's eval loss is sum / max(targets, 1): a batch without targets counts as 0. A NaN there would be
    dropped by the Trainer (here: the eval loss doubled). The training loss is not changed (no such batch there)."""
    no_truncation = {"max_length": None}  # TRL drops rows that truncation leaves without targets
    (ref,), got_pool2, got_pool4 = run_side_by_side((pool1, W.sft_run, 4, None, no_truncation, True),
                                                    (pool2, W.sft_run, 4, None, no_truncation, True),
                                                    (pool4, W.sft_run, 2, 2, no_truncation, True))
    assert 0 < ref["eval"]["eval_loss"] < 3.0, ref["eval"]  # about half the loss of the rows with targets
    for got in got_pool2 + got_pool4:
        assert_same(got, ref)


def test_sft_lora_with_a_trained_head_cp2_equals_one_process(pool1, pool2):
    """PEFT modules_to_save=["lm_head"]: the head is no nn.Linear, so hfcp's chunked loss runs it under activation
    checkpointing, whose saved inputs must not change in place (the token statistics once did: backward failed)."""
    (ref,), got_pool2 = run_side_by_side((pool1, W.sft_run, 4, None, None, False, True),
                                         (pool2, W.sft_run, 4, None, None, False, True))
    for got in got_pool2:
        assert_same(got, ref)


def test_sft_vision_dataset_with_trl_collator_cp2_equals_one_process(pool1, pool2):
    """TRL's vision SFT: a dataset of PIL images and text, TRL's DataCollatorForVisionLanguageModeling with a LLaVA
    processor (rows with 0, 1 and 2 images of different sizes, right padding), LoRA on the language model."""
    (ref,), got_pool2 = run_side_by_side((pool1, W.vlm_sft_run, 2), (pool2, W.vlm_sft_run, 2))
    assert len(ref["history"]) == 4 and sum(ref["images_encoded"]) >= 8, ref  # the collator's pixel values reached it
    for got in got_pool2:
        assert sum(got["images_encoded"]) < sum(ref["images_encoded"]), got  # each rank encoded its share
        for g, r in zip(got["history"], ref["history"]):
            assert g.keys() == r.keys(), (g, r)
            for k in g:
                assert abs(g[k] - r[k]) <= 2e-5 * max(1.0, abs(r[k])), (k, got, ref)
        assert abs(got["eval_loss"] - ref["eval_loss"]) <= 2e-5 * ref["eval_loss"], (got, ref)


def test_sft_audio_rows_cp2_equals_one_process(pool1, pool2):
    """HfcpSFTTrainer on Qwen2-Audio rows (a clip per row at different places; TRL's SFT prepares no audio, so the
    rows pass through with skip_prepare_dataset and a collator), LoRA on the language model: one process's history
    and eval loss, each rank encoding its share of the clips."""
    (ref,), got_pool2 = run_side_by_side((pool1, W.audio_sft_run, 2), (pool2, W.audio_sft_run, 2))
    assert len(ref["history"]) == 4 and len({h["loss"] for h in ref["history"]}) > 1, ref  # it trains
    for got in got_pool2:
        assert sum(got["clips_encoded"]) < sum(ref["clips_encoded"]), got
        for g, r in zip(got["history"], ref["history"], strict=True):
            for k in r:
                assert abs(g[k] - r[k]) <= 1e-4 * max(1.0, abs(r[k])), (k, got, ref)
        assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-5 * ref["eval_loss"], (got, ref)


def test_sft_with_a_parallelism_config_cp2_equals_one_process(pool2, sft_reference):
    """SFTConfig(parallelism_config=ParallelismConfig(cp_size=2)): hfcp's CP (TRL would refuse packing with
    accelerate's torch CP, and hfcp hands accelerate no cp dimension)."""
    import workers_layout as L

    for got in pool2.run(L.sft_layout_run, 4, dict(cp_size=2)):
        assert_same(got, sft_reference)


def test_sft_predict_on_a_sized_iterable_dp2_cp2_equals_one_process(pool1, pool4):
    """HfcpSFTTrainer shares HfcpTrainer's evaluation: an IterableDataset with a length, 5 rows with different
    numbers of targets, whose last batch accelerate fills with repeated rows at dp 2 x cp 2; one process weights
    that batch by its own row (as map-style data). The predictions differ only where TRL's collator pads each DP
    group's batch to its own length: compared on the targets."""
    ref = pool1.run(W.sft_eval_run, 4, None, "sized")[0]
    assert len(set(ref["targets"])) > 1, ref["targets"]
    assert abs(ref["test_loss"] - pool1.run(W.sft_eval_run, 4, None, "map")[0]["test_loss"]) <= 2e-6 * ref["test_loss"]
    for got in pool4.run(W.sft_eval_run, 2, 2, "sized"):
        assert abs(got["test_loss"] - ref["test_loss"]) <= 2e-6 * ref["test_loss"], (got["test_loss"], ref["test_loss"])
        assert torch.equal(got["label_ids"], ref["label_ids"]) and got["predictions"].shape == ref["predictions"].shape
        targets = ref["label_ids"] != -100
        assert float((got["predictions"] - ref["predictions"])[targets].abs().max()) < 1e-4
