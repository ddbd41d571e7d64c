"""HfcpTrainer: 1 process vs 2 (cp 2) and 4 (dp 2 x cp 2) processes give the same logged run."""
import pytest
import torch

import hfcp
from hfcp.testing.dist_pool import run_side_by_side
import workers_trainer as W
from workers_model import tiny_model

KEYS = ("loss", "grad_norm", "learning_rate", "num_input_tokens_seen", "eval_loss", "total_flos")


def assert_same_run(got, ref, tol=2e-5, skip=()):
    assert len(got["history"]) == len(ref["history"]), (got["history"], ref["history"])
    for g, r in zip(got["history"], ref["history"]):
        assert g.keys() == r.keys(), (g, r)
        for k in set(g) - set(skip):
            assert abs(g[k] - r[k]) <= tol * max(1.0, abs(r[k])), (k, g, r)
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= tol * abs(ref["eval_loss"])
    assert got["predictions"].shape == ref["predictions"].shape, (got["predictions"].shape, ref["predictions"].shape)
    assert float((got["predictions"] - ref["predictions"]).abs().max()) < 1e-4
    assert torch.equal(got["label_ids"], ref["label_ids"])
    assert got["total_batch"] == ref["total_batch"]


@pytest.fixture(scope="module")
def reference(pool1):
    return {accum: pool1.run(W.train_run, 4, None, "ring", False, {"gradient_accumulation_steps": accum})[0]
            for accum in (1, 2)}


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_cp2_equals_one_process(pool2, reference, strategy):
    for got in pool2.run(W.train_run, 4, None, strategy):
        assert_same_run(got, reference[1])


CHECKPOINTING_CASES = {  # (weights, reentrant, enabled on the model, TrainingArguments overrides, hfcp.patch options)
    "lora-reentrant": ("lora", True, False, {}, {}),
    "lora-reentrant-on-model": ("lora", True, True, {}, {}),
    "lora-reentrant-accumulation": ("lora", True, False, {"gradient_accumulation_steps": 2}, {}),
    "lora-accumulation": ("lora", False, False, {"gradient_accumulation_steps": 2}, {}),
    "full-reentrant": ("full", True, False, {}, {}),
    "full-reentrant-accumulation-tiled-offload": ("full", True, False, {"gradient_accumulation_steps": 2},
                                                  {"tiled_mlp": True, "offload_checkpoints": True}),
    "full-accumulation": ("full", False, False, {"gradient_accumulation_steps": 2}, {}),
}


@pytest.mark.parametrize("case", list(CHECKPOINTING_CASES))
def test_checkpointing_cp2_equals_one_process(pool1, pool2, case):
    """LoRA and full weights, reentrant checkpointing or not, with and without gradient accumulation. Under CP the
    model is always in DDP: with reentrant checkpointing, find_unused_parameters=True (the Trainer's default for a
    PEFT model) marked each checkpointed weight ready twice, and the static_graph=True hfcp gave it instead failed
    DDP's internal assert (expect_autograd_hooks_) under accumulation, LoRA or full weights; hfcp now sets
    find_unused_parameters=False for reentrant checkpointing."""
    weights, reentrant, on_model, overrides, options = CHECKPOINTING_CASES[case]
    run = (4, None, overrides, on_model, weights, reentrant)
    (ref,), cp2 = run_side_by_side((pool1, W.checkpointing_run, *run), (pool2, W.checkpointing_run, *run, options))
    assert len({h["loss"] for h in ref["history"] if "loss" in h}) > 1, ref  # it trains
    for got in cp2:
        if reentrant:
            assert got["ddp"] == {"static_graph": False, "find_unused_parameters": False}, got["ddp"]
        assert len(got["history"]) == len(ref["history"])
        for g, r in zip(got["history"], ref["history"]):
            for k in ("loss", "grad_norm"):
                if k in r:
                    assert abs(g[k] - r[k]) <= 2e-5 * max(1.0, abs(r[k])), (k, g, r)


def test_torch_compile_cp2_equals_one_process(pool2, reference):
    # TrainingArguments(torch_compile=True): accelerate compiles the DDP-wrapped patched model as a whole; the
    # reference is one process, eager
    import torch

    for got in pool2.run(W.train_run, 4, None, "ring", False, {"torch_compile": True,
                                                               "torch_compile_backend": "aot_eager"}):
        assert got["wrapped_class"] == "OptimizedModule", got["wrapped_class"]
        assert_same_run(got, reference[1])
    pool2.run(torch._dynamo.reset)


def test_tiled_mlp_with_checkpointing_cp2_equals_one_process(pool2, reference):
    # HfcpTrainer(tiled_mlp=4): every MLP in tiles of 4 of the rank's tokens, inside checkpointed layers
    for got in pool2.run(W.train_run, 4, None, "ring", False, {"gradient_checkpointing": True}, False,
                         {"tiled_mlp": 4}):
        assert_same_run(got, reference[1])


def test_dp2_cp2_equals_one_process_with_the_global_batch(pool4, reference):
    for got in pool4.run(W.train_run, 2, 2):
        assert_same_run(got, reference[1])


def test_gradient_accumulation_dp2_cp2(pool4, reference):
    for got in pool4.run(W.train_run, 2, 2, "ring", False, {"gradient_accumulation_steps": 2}):
        assert_same_run(got, reference[2])


# transformers counts FLOPs from param.numel(), which is 0 for a parameter ZeRO-3 has partitioned away: the stock
# Trainer logs total_flos 0 under ZeRO-3 too
ZERO3_FLOS = ("total_flos",)


def test_deepspeed_zero3_cp2_equals_one_process(pool2, reference):
    """ZeRO-3 averages gradients over all ranks, which is hfcp's convention: no correction needed."""
    pytest.importorskip("deepspeed")  # installed by .ci/run
    for got in pool2.run(W.deepspeed_run, 4, None, timeout=600):
        assert_same_run(got, reference[1], skip=ZERO3_FLOS)


def test_deepspeed_zero3_cp2_with_tiled_mlp_equals_one_process(pool2, reference):
    """issue 44: every MLP in tiles of 4 tokens under ZeRO-3, every weight trained: hfcp.patch (in the trainer, before
    deepspeed.initialize) marks the MLPs ZeRO-3 leaves, so their weights are gathered once per call, and each
    weight's gradient, accumulated tile by tile, is reduced once (after the last tile)."""
    pytest.importorskip("deepspeed")
    for got in pool2.run(W.deepspeed_run, 4, None, 1, {"tiled_mlp": 4}, timeout=600):
        assert_same_run(got, reference[1], skip=ZERO3_FLOS)


@pytest.mark.parametrize("options", [None, {"tiled_mlp": 4}])
def test_deepspeed_zero3_moe_with_router_aux_loss_cp2_equals_one_process(pool1, pool2, options):
    """A Qwen2-MoE (router aux loss on) under ZeRO-3: hfcp's global aux loss, not the model's own from a rank's
    router logits (ZeRO-3's forward hook wrote the logits hfcp had hidden back into the output, and the model's
    aux-loss code then met hfcp's mask); with tiled_mlp, its experts and shared expert in tiles."""
    pytest.importorskip("deepspeed")
    (ref,), got_pool2 = run_side_by_side((pool1, W.train_run, 4, None, "ring", False, None, False, None, "qwen2_moe"),
                                         (pool2, W.deepspeed_run, 4, None, 1, options, "qwen2_moe"), timeout=600)
    for got in got_pool2:
        assert_same_run(got, ref, skip=ZERO3_FLOS)


def test_deepspeed_zero3_dp2_cp2_with_gradient_accumulation(pool4, reference):
    pytest.importorskip("deepspeed")
    for got in pool4.run(W.deepspeed_run, 2, 2, 2, timeout=600):
        assert_same_run(got, reference[2], skip=ZERO3_FLOS)


def test_accelerate_fsdp2_cp2_equals_one_process(pool2, reference):
    """accelerate's own FSDP2 preparation (fully_shard per decoder layer and on the model, the Trainer's FSDP
    branches) over a patched model. accelerate enables FSDP only on accelerators, so the worker sets its FSDP
    state on CPU (gloo); everything after that is accelerate's and the Trainer's code."""
    for got in pool2.run(W.accelerate_fsdp2_run, 4, None):
        assert got["model_class"] == "FSDPLlamaForCausalLM", got["model_class"]
        assert_same_run(got, reference[1])


def test_accelerate_fsdp2_dp2_cp2_with_gradient_accumulation(pool4, reference):
    for got in pool4.run(W.accelerate_fsdp2_run, 2, 2, 2):
        assert got["model_class"] == "FSDPLlamaForCausalLM", got["model_class"]
        assert_same_run(got, reference[2])


def test_iterable_dataset_dp2_cp2(pool4, pool1):
    (ref,), got_pool4 = run_side_by_side((pool1, W.train_run, 4, None, "ring", True),
                                         (pool4, W.train_run, 2, 2, "ring", True))
    for got in got_pool4:
        assert_same_run(got, ref)


def test_resume_continues_the_same_losses(pool4):
    for runs in pool4.run(W.resume_run, "w4", 2):
        straight, resumed = dict(runs["straight"]), dict(runs["resumed"])
        assert sorted(straight) == list(range(1, 9)) and sorted(resumed) == list(range(1, 9)), runs
        for step in (6, 7, 8):  # trained after the resume
            assert abs(resumed[step] - straight[step]) <= 1e-5 * abs(straight[step]), runs


def test_bf16_trainer_matches_the_unpatched_model_within_bf16(pool1, pool2):
    (ref,), got_pool2 = run_side_by_side((pool1, W.bf16_run, 4), (pool2, W.bf16_run, 4))
    for got in got_pool2:
        for g, r in zip(got["history"], ref["history"]):
            for k in g:
                assert abs(g[k] - r[k]) <= 2e-2 * max(1.0, abs(r[k])), (k, g, r)
        assert abs(got["eval_loss"] - ref["eval_loss"]) < 2e-2


@pytest.mark.parametrize("kind, message", [
    ("stock_trainer", "train with hfcp.integrations.HfcpTrainer"),
    ("label_smoothing", "label_smoothing_factor=0.1"),
    ("compute_loss_func", "compute_loss_func"),
    ("dispatch_batches", "dispatch_batches=True"),
    ("split_batches", "split_batches=True"),
    ("neftune", "neftune_noise_alpha=5.0"),
    ("fsdp", "accelerate did not enable FSDP"),
    ("fsdp1", "FSDP version 1"),
    ("reentrant_find_unused_without_static_graph", "find_unused_parameters=True without ddp_static_graph"),
    ("reentrant_static_graph_accumulation", "ddp_static_graph=True with gradient_accumulation_steps=2"),
])
def test_unsupported_settings_are_refused(pool2, kind, message):
    for msg in pool2.run(W.refused, kind):
        assert msg and message in msg, msg


def test_saved_model_loads_without_hfcp(pool2):
    assert pool2.run(W.save_and_reload)[0] == '["sdpa", false]'


def test_padding_free_collator_is_exact(pool1, pool2):
    (ref,), got_pool2 = run_side_by_side((pool1, W.flattened_run, 4), (pool2, W.flattened_run, 4))
    for got in got_pool2:
        assert len(got["history"]) == len(ref["history"])
        for g, r in zip(got["history"], ref["history"]):
            for k in g:
                assert abs(g[k] - r[k]) <= 2e-5 * max(1.0, abs(r[k])), (k, g, r)
        assert abs(got["eval_loss"] - ref["eval_loss"]) <= 2e-5 * ref["eval_loss"]
        assert got["imbalance_logged"] == [True] * 4, got["imbalance_logged"]  # with each loss, under CP only
    assert ref["imbalance_logged"] == [False] * 4, ref["imbalance_logged"]


@pytest.mark.parametrize("balance", ["auto", "row"])
def test_trainer_logs_the_steps_attention_imbalance(pool2, balance):
    """cp_imbalance beside each loss: the mean over the logging interval's steps (2 here) of each step's max / mean
    attention work over the ranks, equal on both ranks and to hfcp.balance_report's count of the same batches. On rows
    of one long document and short ones, balance="auto" evens the work; "row" (zigzag) leaves it uneven."""
    from workers_balance import trainer_imbalance_run

    runs = pool2.run(trainer_imbalance_run, balance)
    assert runs[0]["logged"] == runs[1]["logged"] and runs[0]["losses"] == 2, runs[0]
    batches = runs[0]["batches"]
    assert len(batches) == 4 and runs[0]["work_counts"] == 4, runs[0]["work_counts"]  # once a step: the planner's
    counted = [hfcp.balance_report(tiny_model("llama"), cp_size=2, balance=balance, input_ids=ids,
                                   position_ids=pos)["imbalance"] for ids, pos in batches]
    assert [step for step, _ in runs[0]["logged"]] == [2, 4], runs[0]["logged"]
    for (_, logged), pair in zip(runs[0]["logged"], (counted[:2], counted[2:])):
        assert abs(logged - sum(pair) / 2) <= 1e-12, (logged, counted)
    assert all(c <= 1.02 for c in counted) if balance == "auto" else all(c > 1.1 for c in counted), counted


def test_random_data_pipeline_with_workers_gives_one_batch_per_cp_group(pool1, pool2):
    ref = pool1.run(W.cropped_run, 4)[0]  # the session pools' workers may start DataLoader workers (not daemons)
    for got in pool2.run(W.cropped_run, 4):
        for g, r in zip(got["history"], ref["history"]):
            for k in g:
                assert abs(g[k] - r[k]) <= 2e-5 * max(1.0, abs(r[k])), (k, g, r)


def test_vision_predictions_are_whole_sequences(pool1, pool2):
    (ref,), got_pool2 = run_side_by_side((pool1, W.vision_predict), (pool2, W.vision_predict))
    assert ref.shape == (4, 17, 32)
    for got in got_pool2:
        assert got.shape == ref.shape and float((got - ref).abs().max()) < 1e-5


def test_options_conflicting_with_a_patched_model_are_refused(pool2):
    for msg in pool2.run(W.conflicting_options):
        assert msg and "patched already with other settings" in msg and "ulysses" in msg, msg


@pytest.fixture(scope="module")
def eval_reference(pool1):
    return {kind: pool1.run(W.iterable_eval_run, 4, None, kind, None, False)[0] for kind in W.EVAL_DATA}


def test_one_process_evaluates_as_the_stock_trainer(pool1, eval_reference):
    """HfcpTrainer in one process (no CP) is the reference of every test here: its eval and prediction losses are
    the stock Trainer's. It once weighted an unsized stream's last batch as a full one (its data loader did not
    count that batch, as accelerate's dispatcher does for one process): test_loss 4.153608 for 4.159759."""
    stock = pool1.run(W.iterable_eval_run, 4, None, "iterable", None, False, True)[0]
    assert abs(stock["test_loss"] - eval_reference["map"]["test_loss"]) <= 2e-6 * stock["test_loss"]
    for kind, ref in eval_reference.items():
        assert len(set(ref["targets"])) > 1, ref["targets"]  # a last batch weighted otherwise moves the mean
        for k in ("eval_loss", "test_loss", "small_loss"):
            assert abs(ref[k] - stock[k]) <= 2e-6 * stock[k], (kind, k, ref[k], stock[k])


@pytest.mark.parametrize("kind", list(W.EVAL_DATA))
def test_eval_and_predict_dp2_cp2_give_each_row_once(pool4, eval_reference, kind):
    """A dataset whose last batch does not fill both DP groups: accelerate repeats samples to fill it (of an
    IterableDataset it does not know how many); predictions have each row once and the losses are one process's.
    The rows have different numbers of targets, so a repeated row, or a last batch weighted by other than its own
    rows, moves the mean. One process weights the last batch by its own rows, map-style or iterable, with or without
    a length: a stream without one at dp 2 x cp 2 once weighted it as a full batch."""
    ref = eval_reference[kind]
    assert ref["predictions"].shape == (5, W.L, 64) and ref["small_predictions"].shape == (3, W.L, 64)
    for got in pool4.run(W.iterable_eval_run, 2, 2, kind, None, kind != "map"):
        for k in ("eval_loss", "test_loss", "small_loss"):
            assert abs(got[k] - ref[k]) <= 2e-6 * ref[k], (k, got[k], ref[k])
        for k in ("predictions", "small_predictions"):
            assert got[k].shape == ref[k].shape and float((got[k] - ref[k]).abs().max()) < 1e-4, k
        assert torch.equal(got["label_ids"], ref["label_ids"])
        if kind != "map":
            assert got["refused"] and "dataloader_num_workers=2" in got["refused"], got["refused"]


def test_eval_of_an_unsized_stream_cp2_equals_one_process(pool2, eval_reference):
    """dp 1 x cp 2: nothing is repeated, and the unsized stream's last batch weighs its own rows, as one process."""
    ref = eval_reference["iterable"]
    for got in pool2.run(W.iterable_eval_run, 4, 2, "iterable", None, False):
        for k in ("eval_loss", "test_loss", "small_loss"):
            assert abs(got[k] - ref[k]) <= 2e-6 * ref[k], (k, got[k], ref[k])


def test_a_stream_of_as_many_shards_as_dp_groups_is_refused_not_hung(pool4):
    # accelerate would hand whole shards to DP groups: 5 rows in 2 shards timed out (a hang) at dp 2 x cp 2
    for msg in pool4.run(W.sharded_stream_refused, 2, timeout=120):
        assert msg and "n_shards=2 over 2 DP groups" in msg, msg


@pytest.mark.parametrize("with_images", [True, False])
def test_vlm_lora_fine_tune_cp2_equals_one_process(pool1, pool2, with_images):
    # HfcpTrainer with LLaVA batches (images at different places; or text-only batches to the VLM), LoRA on the
    # language model: the losses, gradient norms and eval loss of one process
    assert_multimodal_lora_equal(pool1.run(W.vlm_run, 4, None, with_images)[0],
                                 pool2.run(W.vlm_run, 4, None, with_images))


def assert_multimodal_lora_equal(ref, gots):
    """LoRA on the language model only; it trains; each rank's losses, gradient norms and eval loss are one
    process's."""
    assert ref["lora_only_in_language_model"], ref
    assert len({h["loss"] for h in ref["history"] if "loss" in h}) > 1, ref  # it trains
    for got in gots:
        assert len(got["history"]) == len(ref["history"])
        for g, r in zip(got["history"], ref["history"]):
            for k in ("loss", "grad_norm", "eval_loss"):
                if k in r:
                    assert abs(g[k] - r[k]) <= 1e-4 * max(1.0, abs(r[k])), (k, g, r)
        assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-5 * abs(ref["eval_loss"]), (got, ref)


def test_audio_lora_fine_tune_cp2_equals_one_process(pool1, pool2):
    # HfcpTrainer with Qwen2-Audio batches (a clip per row at different places), LoRA on the language model
    assert_multimodal_lora_equal(pool1.run(W.audio_run, 4, None)[0], pool2.run(W.audio_run, 4, None))


# ---- accelerate's ParallelismConfig as the front door (issue 21) ------------------------------------------------
import workers_layout as L  # noqa: E402


def test_parallelism_config_cp2_equals_one_process(pool2, reference):
    """TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2)): hfcp takes the cp dimension, accelerate
    gets no layout (DDP over the processes), so torch's CP is never enabled."""
    for got in pool2.run(L.layout_run, 4, dict(cp_size=2)):
        assert got["cp"] == 2 and got["handed"] is None, got["handed"]
        assert_same_run(got, reference[1])


@pytest.mark.parametrize("how", ["prepatched", "cp_size_none"])
def test_parallelism_config_with_a_patched_model_or_cp_size_none(pool2, reference, how):
    """A model patched beforehand over the whole world, or cp_size=None (the whole world) given beside
    ParallelismConfig(cp_size=2) on 2 processes: the same groups, accepted."""
    extra = (False, False, False, True) if how == "prepatched" else (False, False, False, False, None)
    for got in pool2.run(L.layout_run, 4, dict(cp_size=2), *extra):
        assert got["cp"] == 2
        assert_same_run(got, reference[1])


def test_accelerate_launch_parallelism_flags_cp2(pool2, reference):
    """The environment `accelerate launch --use_parallelism_config --parallelism_config_cp_size 2` sets."""
    for got in pool2.run(L.layout_run, 4, None, False, True):
        assert got["cp"] == 2 and got["handed"] is None, got["handed"]
        assert_same_run(got, reference[1])


def test_parallelism_config_dp_shard2_x_cp2_under_fsdp2(pool4, reference):
    """ParallelismConfig(dp_shard_size=2, cp_size=2) on 4 processes: accelerate is handed dp_shard 4 (= dp_shard x cp,
    the same ranks), builds its mesh and shards with FSDP2 over it; hfcp does cp; the run equals one process's."""
    for got in pool4.run(L.layout_run, 2, dict(dp_shard_size=2, cp_size=2), True):
        assert got["model_class"] == "FSDPLlamaForCausalLM" and got["handed"] == (4, 1, False), got
        assert got["cp"] == 2
        assert_same_run(got, reference[1])


def test_hsdp_layout_is_handed_to_accelerate_with_cp_folded_into_dp_shard():
    """dp_replicate 2 x dp_shard 2 x cp 2 (HSDP, 8 ranks): accelerate gets dp_replicate 2 x dp_shard 4 and no cp, the
    same ranks in the same order (hfcp's CP groups are consecutive pairs inside each dp_shard x cp block of 4);
    accelerate itself refuses dp_replicate with cp and dp_shard 1 (pure replication), so only HSDP reaches hfcp."""
    from accelerate import ParallelismConfig

    from hfcp.integrations.parallelism import UNSET, accelerate_view, layout_problems

    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2)
    assert layout_problems(pc, 8, UNSET) == []
    view = accelerate_view(pc)
    assert (view.dp_replicate_size, view.dp_shard_size, view.cp_size, view.tp_size) == (2, 4, 1, 1)
    assert not view.cp_enabled
    assert accelerate_view(ParallelismConfig(cp_size=2)) is None  # cp alone: DDP over every process
    with pytest.raises(ValueError, match="pure data parallelism"):
        ParallelismConfig(dp_replicate_size=2, cp_size=2)


def test_parallelism_config_with_lora_under_fsdp2(pool1, pool4):
    """The pieces together: LoRA (PEFT), FSDP2 over dp_shard x cp and hfcp's CP, all from one ParallelismConfig."""
    (ref,), got_pool4 = run_side_by_side((pool1, L.layout_run, 4, None, False, False, True),
                                         (pool4, L.layout_run, 2, dict(dp_shard_size=2, cp_size=2), True, False, True))
    for got in got_pool4:
        assert got["model_class"].startswith("FSDPPeftModel") and got["handed"] == (4, 1, False), got["model_class"]
        assert_same_run(got, ref)


@pytest.mark.parametrize("kind, message", [
    ("conflict", "cp_size=1 given to the trainer, but parallelism_config.cp_size=2"),
    ("sp", "has sp_size=2"),
    ("size", "covers 4 processes, but 2 run"),
    ("tp", "has tp_size=2"),
    ("dp_shard_on_cpu", "which accelerate refused: ParallelismConfig is only compatible"),
    ("alltoall", "cp_comm_strategy='alltoall' (torch's CP, which hfcp replaces) asks for an all-to-all, but hfcp "
                 "would run strategy='ring'"),
    ("alltoall_ulysses", None),  # the all-to-all asked for is hfcp's ulysses: accepted
])
def test_parallelism_config_refusals(pool2, kind, message):
    for msg in pool2.run(L.layout_refused, kind):
        assert (msg is None) if message is None else (msg and message in msg), msg


def test_parallelism_config_refuses_a_model_patched_with_other_groups(pool4):
    """A model patched with cp_size=2 on 4 processes, then ParallelismConfig(cp_size=4): refused on every rank."""
    for msg in pool4.run(L.layout_refused, "patched_other_groups"):
        assert msg and "the model is patched already with CP groups [(0, 1), (2, 3)], but" in msg, msg
        assert "puts its cp dimension on [(0, 1, 2, 3)]: pass the model unpatched, or patch it with cp_size=4" in msg


def test_parallelism_config_refused_when_a_configured_accelerator_keeps_cp(pool2):
    for msg in pool2.run(L.configured_accelerator_kept_cp):
        assert msg and "accelerate kept ParallelismConfig(" in msg and "cp_size=2" in msg, msg
