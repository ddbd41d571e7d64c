"""hfcp.pipeline (issue 43): pipeline stages x CP in one mesh, on 4 gloo processes, against one process: the losses,
every gradient of each stage by its name in the model (clipped by the whole model's norm, as one process clips),
the parameters after two AdamW steps and an eval loss."""
import pytest

import workers_pipeline as W


def assert_exact(runs):
    for r in runs:
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["eval_err"] < 1e-5 and r["norm_err"] < 1e-5, r
        assert r["param_err"] < 1e-4 and not r["missing"] and r["grads"] > 0, r


@pytest.mark.parametrize("pp, cp, schedule, micro, family, options", [
    (2, 2, "GPipe", 2, "llama", dict(bucket=1000)),  # pp 2 x cp 2; the gradients reduced in slices of 1,000
    (2, 2, "1F1B", 4, "llama", dict(lora=True, checkpointing=True, packed=True)),     # LoRA, checkpointing, packing
    (2, 2, "1F1B", 2, "gemma2", dict(tied=True)),  # softcaps, scaled embeddings, sliding and full layers, tied head
    (4, 1, "1F1B", 4, "qwen3", dict(tied=True)),   # pp 4: q/k norms, the tied weight between stages 0 and 3
    (2, 1, "GPipe", 2, "mistral", dict(packed=True)),                                 # pp 2 x dp 2, sliding window
    (2, 1, "1F1B", 2, "llama", dict(lora=True, checkpointing="reentrant")),           # pp 2 x dp 2, LoRA
    (2, 2, "1F1B", 2, "gemma2_split", dict(packed=True)),  # stages with other masks, one balanced layout for all
])
def test_pipeline_equals_one_process(pool4, pp, cp, schedule, micro, family, options):
    assert_exact(pool4.run(W.compare, pp, cp, schedule, micro, family, *[options.get(k, False) for k in
                                                                          ("lora", "checkpointing", "packed", "tied")],
                           "ring", None, options.get("bucket")))


@pytest.mark.parametrize("cp", [1, 2])
def test_pipeline_tiled_mlp_and_offload_apply_at_every_cp_size(pool4, cp):
    """tiled_mlp and offload_checkpoints through hfcp.pipeline: at cp_size 1 they were passed to no hfcp.patch and
    silently did nothing; now every stage's MLPs run in tiles and its checkpoints are offloaded, exact as before."""
    memory = {"tiled_mlp": 8, "offload_checkpoints": True}
    runs = pool4.run(W.compare, 2, cp, "1F1B", 2, "llama", True, True, False, False, "ring", memory)
    assert_exact(runs)
    for r in runs:
        assert r["tiled_calls"] > 0 and r["offloaded"], r


@pytest.mark.parametrize("kind, message", [
    ("world", "pp_size=3 x cp_size=1 must divide the world size 2"),
    ("schedule", "schedule='zigzag' is not one of ['GPipe', '1F1B']"),
    ("stages", "pp_size=2 stages for 1 decoder layers"),
    ("rows", "4 rows do not divide into n_microbatches=3"),
    ("hybrid", "Lfm2ForCausalLM (model_type='lfm2') has sequence mixers other than attention"),
    ("vlm", "LlavaForConditionalGeneration (model_type='llava') is a vision-language or vision model"),
    ("moe", "MixtralForCausalLM (model_type='mixtral') adds a MoE router aux loss"),
    ("opt", "OPTForCausalLM's forward calls embed_positions (OPTLearnedPositionalEmbedding, with parameters) before"),
    ("ignore_index", "ignore_index passed to a step"),
    ("patched", "the model is patched already (cp 2, ring), not as cp_size=1"),
    ("other_batches", "the stages of one data group got different batches (global ranks [1] differ from rank 0)"),
])
def test_pipeline_refuses_by_name_on_every_rank(pool2, kind, message):
    for msg in pool2.run(W.refused, kind):
        assert msg and message in msg, msg


def test_the_gradient_reduction_buckets_cut_gradients_into_slices():
    import torch

    from hfcp.pipelining.runner import _buckets

    a, b, c = torch.zeros(5), torch.zeros(3, 4), torch.zeros(2)
    got = [[(id(g), start, stop) for g, start, stop in bucket] for bucket in _buckets([a, b, c], 8)]
    assert got == [[(id(a), 0, 5), (id(b), 0, 3)], [(id(b), 3, 11)], [(id(b), 11, 12), (id(c), 0, 2)]]
