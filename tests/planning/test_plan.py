"""hfcp.plan and its dry run, on the meta device in this process: the dry run at world sizes no real run here reaches
agrees with the plan's fit and sends what the communication model counts; the shipped configs, the command, the
search and the refusals."""
from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest
import transformers

import hfcp
from hfcp.attention.volume import comm_bytes
from hfcp.commands.cli import main
from hfcp.planning import dry_run
from hfcp.pipelining.runner import REDUCE_BUCKET
from hfcp.planning.configs import load_config, shipped

import workers_plan
from workers_plan import small

from hfcp.testing.dist_pool import map_in_processes


@pytest.fixture(scope="module")
def made():
    """The module's dry runs and plans that take seconds (workers_plan.py), two at a time in processes of their own."""
    names = ["world_64", "pipelined", "extrapolated", "searched"]
    return dict(zip(names, map_in_processes(workers_plan.make, [(n,) for n in names])))


@pytest.mark.parametrize("strategy, ulysses_size, checkpointing", [
    ("ring", None, True), ("ring", None, False), ("usp", 2, True), ("ulysses", None, True), ("allgather", None, True)])
def test_the_dry_run_sends_what_the_communication_model_counts(strategy, ulysses_size, checkpointing):
    t = dry_run(small(), 8192, 4, strategy, ulysses_size, gradient_checkpointing=checkpointing, lora_rank=8,
                lora_targets=["q_proj"], dtype="fp32")
    per_layer = comm_bytes(strategy, 1, 8192, 4, 4, 64, 4, ulysses_size, 4, recompute=checkpointing)
    loss = 2 * 2 * 3 / 4 * 4  # (the loss's two scalar all-reduces)
    assert t.sent == pytest.approx(2 * per_layer + loss, rel=1e-6), (t.sent, t.collectives)


@pytest.mark.parametrize("options", [dict(lora_rank=8, lora_targets=["q_proj"], tiled_mlp=True, dtype="bf16"),
                                     dict(strategy="ulysses", offload_checkpoints=True, dtype="fp32")])
def test_the_dry_runs_record_of_operator_outputs_changes_nothing(monkeypatch, options):
    """The dry run remakes an operator's outputs from its record of an earlier call with the same kinds of inputs
    (dry_run._MADE): the same trace, every byte, as the operators called each time (a mixture of experts too)."""
    dry = importlib.import_module("hfcp.planning.dry_run")
    config = small(2, num_key_value_heads=2, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=128)
    dry._MADE.clear()
    recorded = dry_run(config, 4096, 2, **options)
    assert any(r is not None for r in dry._MADE.values()), "nothing was recorded"
    monkeypatch.setattr(dry._DryMode, "_made", staticmethod(lambda func, args, kwargs: func(*args, **kwargs)))
    called = dry_run(config, 4096, 2, **options)
    fields = ("peak", "regions", "grads_end", "host_peak", "sent", "collectives")
    assert [getattr(recorded, f) for f in fields] == [getattr(called, f) for f in fields]


def test_a_dry_run_at_world_64_completes_and_agrees_with_the_plan(made):
    """cp 64 (a size no test runs for real), 3 layers, 4,096 tokens a rank, LoRA, checkpointing and tiled_mlp: hfcp's
    real step runs (in about 2 s here: reported, not asserted), and the plan (fitted from traces on a ring of 4)
    gives its peak: a ring's bytes a rank do not depend on its size (workers_plan.world_64). USP and the lengths of
    Llama-3.1-8B at cp 256: scripts/tools/dry_run.py."""
    w = made["world_64"]
    print(f"the dry run of a ring of 64 took {w['seconds']:.1f} s")
    # a layer: K and V sent each step of the forward, of the recompute and of backward, dK and dV sent home
    assert w["sends"] == 3 * 2 * (3 * 63 + 64)
    assert w["step_bytes"] == pytest.approx(w["peak"], rel=0.02), w
    assert w["planned_sent"] == pytest.approx(w["sent"], rel=0.01), w


def test_the_fit_extrapolates_in_layers_and_tokens(made):
    """A plan at 8 layers and 4x the traced tokens equals the dry run of that very step (workers_plan.extrapolated)."""
    e = made["extrapolated"]
    assert e["step_bytes"] == pytest.approx(e["peak"], rel=0.02), e


PUBLISHED = {"Llama-3.1-8B": 8.03e9, "Llama-3.1-70B": 70.6e9, "Qwen3-8B": 8.19e9, "Qwen3-32B": 32.8e9,
             "Qwen3-30B-A3B": 30.5e9, "Qwen2.5-VL-7B-LM": 7.6e9}


def test_the_shipped_configs_build_the_published_models():
    import torch

    assert sorted(PUBLISHED) == shipped()
    for name, count in PUBLISHED.items():
        config, label = load_config(name.lower())
        assert label == name
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(count, rel=0.01), name


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp_size=1), "cp_size=1"),
    (dict(seq_len=1001, cp_size=2), "seq_len=1001 must be a multiple of cp_size=2"),
    (dict(strategy="zigzag"), "strategy='zigzag'"),
    (dict(strategy="usp", cp_size=4), "needs ulysses_size dividing cp_size=4"),
    (dict(tp_size=0), "tp_size=0 must be a positive integer"),
    (dict(tp_size=3), "num_attention_heads=4 does not divide over tp_size=3"),
    (dict(tp_size=2, lora_rank=8), "tp_size=2 with lora_rank=8: hfcp's TP x CP is verified for full fine-tunes"),
    (dict(tp_size=2, tiled_mlp=True, optimizer_offload=True), "with tiled_mlp=True, optimizer_offload=True"),
    (dict(tp_size=2, sharded=True), "with sharded=True"),
    (dict(tp_size=2, step="alst", strategy="ulysses"), "ALST's step has no tensor parallelism"),
    (dict(pp_size=0), "pp_size=0 must be a positive integer"),
    (dict(pp_size=3), "pp_size=3 stages for 2 decoder layers"),
    (dict(pp_size=2, sharded=True), "pp_size=2 with sharded=True: hfcp.pipeline averages each stage's gradients"),
    (dict(pp_size=2, tp_size=2, optimizer_offload=True), "with tp_size=2, optimizer_offload=True"),
    (dict(pp_size=2, step="alst", strategy="ulysses"), "ALST's step has no pipeline stages"),
    (dict(pp_size=2, schedule="zero-bubble"), "schedule='zero-bubble' is not one of ['GPipe', '1F1B']"),
    (dict(pp_size=2, n_microbatches=3, batch_size=2), "n_microbatches=3 must divide batch_size=2"),
    (dict(n_microbatches=2, batch_size=2), "microbatches are a pipeline's"),
    (dict(device="h100"), None),
    (dict(device="tpu-v5"), "device='tpu-v5'"),
    (dict(device={"memory": 3}), "device spec field 'memory'"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(batch_size=0), "batch_size=0"),
])
def test_what_a_plan_refuses(kwargs, message):
    if message is None:  # (an alias that resolves)
        assert hfcp.planning.devices.resolve_device(kwargs["device"]).name == "h100-80gb"
        return
    with pytest.raises((ValueError, NotImplementedError)) as e:
        hfcp.plan(small(), **kwargs)
    assert message in str(e.value)


def test_an_unknown_config_names_the_shipped_ones():
    with pytest.raises(FileNotFoundError) as e:
        hfcp.plan("Llama-9-1T")
    assert "Llama-3.1-8B" in str(e.value)


def test_the_command_plans_lists_and_refuses(capsys, tmp_path):
    assert main(["plan", "--list"]) == 0
    assert "Qwen3-30B-A3B" in capsys.readouterr().out
    path = tmp_path / "config.json"
    small(2).to_json_file(str(path))
    assert main(["plan", str(path), "--cp-size", "2", "--lora-rank", "8", "--device", "a100-40gb", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["fits"] and got["max_seq_len"] > 0 and got["seq_len"] == got["max_seq_len"]
    assert got["peak_bytes"] <= 39.4 * 2 ** 30
    assert main(["plan", str(path), "--seq-len", str(got["max_seq_len"] * 4), "--lora-rank", "8",
                 "--device", "a100-40gb"]) == 1  # does not fit: exit 1, the table says so
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", str(path), "--cp-size", "1"]) == 2
    assert "cp_size=1" in capsys.readouterr().err


def test_the_search_ranks_the_layouts_and_the_options(made):
    s = made["searched"]  # (workers_plan.searched: 2 KV heads, tiles of 1,024 tokens)
    assert s["layouts"] == [(2, "ring", None), (2, "ulysses", None), (4, "ring", None), (4, "usp", 2)]  # (no
    # ulysses at 4: 2 KV heads)
    longest = [p[0] for p in s["plans"]]
    assert longest == sorted(longest, reverse=True) and len(longest) == 6
    by = {(strategy, tiled): n for n, strategy, tiled, offload in s["plans"] if not offload}
    assert by[("ring", True)] > by[("ring", False)]  # tiles reach further: the MLP's working set is the limit


def test_the_dry_run_tool_reports_each_run_and_a_failure_by_name(capsys, tmp_path):
    import dry_run as tool  # (scripts/tools/dry_run.py)

    path = tmp_path / "config.json"
    small(2, num_key_value_heads=2).to_json_file(str(path))
    tool.main(["--config", str(path), "--runs", "32768:8:ring", "32768:8:ulysses", "--layers", "1"])
    ok, refused = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert ok["ok"] and ok["collectives"]["send"] == 2 * (3 * 7 + 8) and ok["peak_gib"] > 0, ok
    assert not refused["ok"] and "not both divisible by cp_size=8" in refused["error"], refused


ALST_PUBLISHED = {1: 500_000, 8: 3_700_000, 32: 15_000_000}  # arXiv 2506.13996: Llama-3.1-8B on 80 GB H100s


@pytest.mark.parametrize("gpus", sorted(ALST_PUBLISHED))
def test_the_plan_of_alsts_own_step_reaches_alsts_published_lengths(gpus):
    """The plan's GPU model (what the dry run counts, the device's overhead and slack, the optimizer on the host)
    held to published GPU results: DeepSpeed ALST's own step (its Ulysses, TiledMLP and tiled loss, dry-run) with
    ALST's settings (bf16 full fine-tune, weights and optimizer states offloaded, checkpoints offloaded) reaches
    within 25% of what ALST reached on 1, 8 and 32 H100s. (hfcp's own step beside it: docs/performance.md.)"""
    pytest.importorskip("deepspeed")  # the optional extra hfcp[deepspeed]; CI installs it
    p = hfcp.plan("Llama-3.1-8B", cp_size=gpus, strategy="ulysses" if gpus > 1 else "ring", step="alst",
                  tiled_mlp=True, offload_checkpoints=True, param_offload=True, optimizer_offload=True,
                  device="h100-80gb")
    assert p.fits and p.layout["step"] == "alst"
    assert p.max_seq_len == pytest.approx(ALST_PUBLISHED[gpus], rel=0.25), (gpus, p.max_seq_len)


def test_alsts_dry_run_sends_what_ulysses_sends():
    """DeepSpeed's all-to-all is an operator of its own (its collective runs below the dry run's dispatch): counted
    as the c10d all-to-all it is. ALST moves what hfcp's Ulysses moves (Q, K, V there, the output back, again in the
    recompute and in backward), and all-gathers each layer's position ids (int64) in its forward and recompute."""
    pytest.importorskip("deepspeed")
    t = dry_run(small(), 8192, 4, "ulysses", step="alst", dtype="fp32")
    per_layer = comm_bytes("ulysses", 1, 8192, 4, 4, 64, 4, None, 4, recompute=True)
    positions = 2 * 2 * 2048 * 8 * 3  # (2 layers x forward and recompute; 2,048 int64 a rank, to 3 others)
    assert t.collectives["alltoall_base_"] == 2 * 4 * 3
    assert t.sent == pytest.approx(2 * per_layer + positions, rel=1e-9), (t.sent, t.collectives)


def test_alsts_step_is_refused_where_alst_does_not_run(tmp_path, capsys):
    with pytest.raises(ValueError, match="step='alst' runs ALST's Ulysses"):
        hfcp.plan(small(), cp_size=2, strategy="ring", step="alst")
    with pytest.raises(ValueError, match="step='deepspeed'"):
        hfcp.plan(small(), step="deepspeed")
    path = tmp_path / "config.json"
    small(2).to_json_file(str(path))
    assert main(["plan", str(path), "--gpus", "8", "--step", "alst"]) == 2
    assert "--step alst plans one layout" in capsys.readouterr().err


def test_alsts_step_refuses_what_alst_does_not_tile_or_exchange():
    pytest.importorskip("deepspeed")
    moe = small(2, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    with pytest.raises(ValueError, match="tiles dense MLPs"):
        hfcp.plan(moe, cp_size=2, strategy="ulysses", step="alst", tiled_mlp=True, device="cpu")
    hybrid = small(2, model_type="qwen3_next", num_key_value_heads=1,
                   layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                   linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)
    with pytest.raises(ValueError, match="no attention that ALST's"):
        hfcp.plan(hybrid, cp_size=2, strategy="ulysses", step="alst", device="cpu")


def test_a_tensor_parallel_rank_plans_its_share_of_the_weights_and_the_whole_logits():
    """Under TP a rank holds its share of every sharded weight (the norms whole) and of the heads, and, the head
    being sharded over the vocabulary, hfcp computes the loss from the gathered whole logits, which the dry run
    traces (the model's own loss): at 8,192 tokens a rank, bf16 logits and their fp32 copy at least."""
    config, n = small(2, hidden_size=512, intermediate_size=1024, vocab_size=8192), 16384
    one = hfcp.plan(config, seq_len=n, cp_size=2, sharded=False)
    two = hfcp.plan(config, seq_len=n, cp_size=2, tp_size=2)
    assert two.layout["tp_size"] == 2 and not two.layout["sharded"]
    assert 0.5 < two.breakdown["weights"] / one.breakdown["weights"] < 0.502
    whole = "loss (the TP head's whole logits)"
    assert two.breakdown[whole] >= n // 2 * config.vocab_size * (2 + 4) and two.step_bytes > 2 * one.step_bytes, two
    assert whole in two.limit and "tp_size=1" in two.limit
    assert two.time_parts["tensor-parallel communication"] > 0 and two.comm_bytes_per_step > one.comm_bytes_per_step


def test_tensor_parallelism_is_refused_where_hfcp_does_not_run_it_or_cannot_trace_it():
    with pytest.raises(ValueError, match="qwen3_next .recurrent or convolution layers. is refused tensor-parallel"):
        hfcp.plan(transformers.AutoConfig.for_model("qwen3_next"), tp_size=2)
    # OLMo-2's q_norm spans every head, whole on a TP rank: the narrowed config the dry run would trace differs
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_norm.weight: a tensor-parallel rank holds 256 "):
        hfcp.plan(transformers.AutoConfig.for_model(**{**workers_plan.SMALL, "model_type": "olmo2"},
                                                    num_hidden_layers=2), tp_size=2, seq_len=4096)


def test_the_search_ranks_tensor_parallel_layouts_of_a_full_fine_tune(monkeypatch):
    config = small(2, num_key_value_heads=2)
    assert [(x["cp_size"], x["strategy"], x.get("tp_size", 1)) for x in hfcp.planning.layouts(config, 8, (1, 2, 4))] \
        == [(2, "ring", 1), (2, "ulysses", 1), (4, "ring", 1), (4, "usp", 1), (8, "ring", 1), (8, "usp", 1),
            (2, "ring", 2), (4, "ring", 2)]  # (a TP rank of 2 has one KV head: no ulysses; 2 KV heads: no tp 4)
    planned = []  # (what the search plans: each layout with each option, TP x CP's without tiles or offload)
    plan_module = importlib.import_module("hfcp.planning.plan")
    monkeypatch.setattr(plan_module, "plan", lambda config, **kw: planned.append(kw) or SimpleNamespace(
        max_seq_len=kw.get("tp_size", 1), fits=True, step_time_s=1.0))
    assert [p.max_seq_len for p in plan_module.search(config, 4, top=100)][:2] == [2, 1]  # (longest first)
    tensor = [kw for kw in planned if kw.get("tp_size")]
    assert [(kw["cp_size"], kw["tp_size"]) for kw in tensor] == [(2, 2)] and len(planned) == 4 * 3 + 1 + 1
    assert not tensor[0].get("tiled_mlp") and not tensor[0].get("offload_checkpoints")
    plan_module.search(config, 4, lora_rank=8)  # (LoRA: hfcp's TP x CP is verified for full fine-tunes)
    assert not [kw for kw in planned[14:] if kw.get("tp_size")] and len(planned) == 14 + 12 + 1


def test_the_command_plans_tensor_parallelism_and_refuses_what_hfcp_does_not_run(capsys, tmp_path):
    path = tmp_path / "config.json"
    small(2).to_json_file(str(path))
    assert main(["plan", str(path), "--cp-size", "2", "--tp-size", "2", "--seq-len", "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["tp_size"] == 2
    assert main(["plan", str(path), "--cp-size", "2", "--tp-size", "2", "--lora-rank", "8"]) == 2
    assert "hfcp plan: error: tp_size=2 with lora_rank=8" in capsys.readouterr().err


def test_a_pipeline_plans_its_worst_stage_from_the_runners_own_schedule(made):
    """hfcp.pipeline's stages (a dry run of its runner's step on the first and the last stage; workers_plan.pipelined):
    a stage holds its layers' weights (the first the embedding, the last the head), GPipe keeps every microbatch's
    checkpoints where 1F1B keeps as many as stages, later microbatches run with the stage's gradients alive, the
    runner's fp32 reduction bucket is counted, and the bubble."""
    piped = made["pipelined"]["piped"]
    one = piped["1F1B"]
    assert one.layout["pp_size"] == 2 and one.layout["n_microbatches"] == 3 and not one.layout["sharded"]
    assert one.stage in (0, 1) and "pipeline stage" in str(one)
    layer = 4 * 512 * 512 + 3 * 512 * 1024 + 2 * 512  # (a layer: attention, MLP, two norms)
    assert one.breakdown["weights"] == (2 * layer + 8192 * 512 + (512 if one.stage else 0)) * 2
    # GPipe: three rows in flight on the last stage (60 MB of its layers' inputs); 1F1B: two on the first (44 MB)
    checkpoints = {k: (p.stage, p.breakdown["checkpoints (on device)"] / 2 ** 20) for k, p in piped.items()}
    assert checkpoints["1F1B"][0] == 0 and checkpoints["GPipe"][0] == 1, checkpoints
    assert checkpoints["GPipe"][1] > 1.3 * checkpoints["1F1B"][1], checkpoints
    assert piped["GPipe"].step_bytes > one.step_bytes
    assert one.time_parts["pipeline bubble"] > 0 and one.comm_bytes_per_step > 0
    # the third microbatch runs forward and backward with the first stage's gradients alive: at the traced size (two
    # layers a stage, 8,192 tokens a rank) the plan is the dry run's own peak
    assert one.step_bytes == made["pipelined"]["traced_peak"] and one.breakdown["gradients"] > 0, one
    # wider layers, a short sequence: the peak is at the step's end, the gradients and the runner's fp32 bucket
    short = made["pipelined"]["short"]
    stage = 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024) + 8192 * 1024 + 1024 * short.stage
    assert short.breakdown["gradients"] == 4 * stage and 4 * REDUCE_BUCKET < 4 * stage
    assert short.breakdown["gradient reduction (fp32 bucket)"] == 4 * REDUCE_BUCKET  # (a bucket, not all of them)


def test_a_pipeline_is_refused_for_what_hfcp_pipeline_refuses_and_searched_where_it_runs(capsys, tmp_path):
    # the refusal comes from hfcp.pipeline itself, run by the dry run
    with pytest.raises(ValueError, match=r"pp_size=2: hfcp.pipeline: Qwen3NextForCausalLM .* has sequence mixers "
                                         r"other than attention"):
        hfcp.plan(transformers.AutoConfig.for_model("qwen3_next", num_hidden_layers=4), pp_size=2, seq_len=4096)
    path = tmp_path / "config.json"
    small(4).to_json_file(str(path))
    assert main(["plan", str(path), "--pp-size", "2", "--n-microbatches", "2", "--batch-size", "2", "--seq-len",
                 "4096", "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert (layout["pp_size"], layout["n_microbatches"], layout["schedule"]) == (2, 2, "1F1B")
    assert main(["plan", str(path), "--pp-size", "2", "--sharded", "yes"]) == 2
    assert "hfcp plan: error: pp_size=2 with sharded=True" in capsys.readouterr().err
    config = small(4, num_key_value_heads=2)
    assert [(x["cp_size"], x.get("pp_size", 1), x.get("dp_replicate", 1))
            for x in hfcp.planning.layouts(config, 8, pp_sizes=(1, 2, 4)) if x.get("pp_size")] \
        == [(2, 2, 2), (4, 2, 1), (2, 4, 1)]  # (ring: a stage's ranks, cp x its replicas)
