"""hfcp.plan(..., device="cpu")'s step_bytes against the measured peak RSS growth of the same step (the worst rank's,
measured as bench/reach.py measures it: hfcp.testing.step_memory), at 2K and 4K tokens a rank, for configurations that
cover a GQA Llama, an MHA family, a mixture of experts, a hybrid with a recurrent mixer, a sliding-window family and
a VLM's language model; cp 2 and 4; ring and Ulysses; LoRA and full fine-tune; tiled_mlp on and off; checkpointing
on and off. The models are as transformers builds them from these configs; their attention is narrow (heads of 16:
two, four for the MHA family) so that a step takes seconds on a CPU, their widths are what the plan counts. (The
plan's fit holds from its loss chunk, 1,024 tokens a rank, upward: at 1,024 a rank it counts the whole chunk.)"""
from __future__ import annotations

import pytest

from hfcp.testing.dist_pool import DistPool, map_in_processes
from hfcp.testing.step_memory import measure_pipeline_steps, measure_steps, measure_tensor_parallel_steps, plan_case

LOCAL = [2048, 4096]  # tokens a rank
TOLERANCE = 0.10
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
             vocab_size=2048)

CASES = {
    # name: (config, cp, plan options)
    "llama_gqa_ring_lora_tiled": (dict(SMALL, model_type="llama", num_key_value_heads=1), 2,
                                  dict(lora_rank=8, lora_targets=ATTN, tiled_mlp=1024)),
    "qwen3_next_hybrid_ring_lora": (dict(SMALL, model_type="qwen3_next", num_key_value_heads=1,
                                         layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                                         linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                         shared_expert_intermediate_size=128), 2,
                                    dict(lora_rank=8, lora_targets=ATTN)),
    "llama_cp4_ring_lora_no_checkpointing": (dict(SMALL, model_type="llama", num_key_value_heads=1), 4,
                                             dict(lora_rank=8, lora_targets=ATTN, gradient_checkpointing=False)),
    "llama_ulysses_full_tiled": (dict(SMALL, model_type="llama", num_key_value_heads=2), 2,
                                     dict(strategy="ulysses", tiled_mlp=1024)),
    "gpt_neox_mha_ulysses_full": (dict(model_type="gpt_neox", hidden_size=64, intermediate_size=1024,
                                       num_hidden_layers=2, num_attention_heads=4, vocab_size=2048), 2,
                                  dict(strategy="ulysses")),
    "qwen3_moe_ring_lora_tiled": (dict(SMALL, model_type="qwen3_moe", num_key_value_heads=1, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=128), 2,
                                  dict(lora_rank=8, lora_targets=ATTN, tiled_mlp=True)),
    "mistral_sliding_window_ring_lora": (dict(SMALL, model_type="mistral", num_key_value_heads=1, sliding_window=2048),
                                         2, dict(lora_rank=8, lora_targets=ATTN)),
    "qwen2_vl_language_model_ring_full": (dict(SMALL, model_type="qwen2", num_key_value_heads=1), 2, {}),
}


def lengths(cp: int) -> list[int]:
    return [n * cp for n in LOCAL]


@pytest.fixture(scope="module")
def measuring():
    """Pools of their own (a measurement fixes glibc's mmap threshold for the rest of a process's life, which would
    slow the shared pools' later tests), closed after this module."""
    pools = {}

    def pool(cp: int) -> DistPool:
        if cp not in pools:
            pools[cp] = DistPool(cp)
        return pools[cp]

    yield pool
    for pool in pools.values():
        pool.close()


FOUR_RANKS = dict(SMALL, model_type="llama", num_attention_heads=4, num_key_value_heads=2)  # (tp / pp 2 x cp 2)
PLANNED = {**CASES, "tensor_parallel": (FOUR_RANKS, 2, dict(tp_size=2)),
           "pipeline": (FOUR_RANKS, 2, dict(pp_size=2, n_microbatches=2, batch_size=2))}


@pytest.fixture(scope="module")
def plans():
    """Every case's plan at each length, made before the measurements (made beside the measured ranks, the plans'
    dry runs would share the cores with them, and the ranks would wait for each other), in two processes."""
    made = map_in_processes(plan_case, [(case, lengths(case[1])) for case in PLANNED.values()])
    return dict(zip(PLANNED, made))


@pytest.mark.parametrize("name", list(CASES))
def test_plan_step_bytes_match_the_measured_step(name, measuring, plans):
    config, cp, options = CASES[name]
    measured = measuring(cp).run(measure_steps, config, lengths(cp), options.get("strategy", "ring"), None,
                                 options.get("lora_rank"), options.get("lora_targets"),
                                 options.get("gradient_checkpointing", True), options.get("tiled_mlp", False),
                                 timeout=600)[0]
    for n, p, m in zip(lengths(cp), plans[name], measured):
        print(f"{name} {n}: plan {p / 2**20:.1f} MB, measured {m / 2**20:.1f} MB")
    for n, p, m in zip(lengths(cp), plans[name], measured):
        assert abs(p - m) <= TOLERANCE * m, (name, n, p, m)


def test_plan_step_bytes_match_a_tensor_parallel_step(measuring, plans, tmp_path):
    """tp 2 x cp 2 on 4 ranks: the model loaded tensor-parallel by transformers (DTensor weights, the head gathering
    its logits), hfcp's CP across the TP groups, a full fine-tune; the plan traces a TP rank's narrowed step and the
    loss from the whole logits (hfcp.planning.tensor_parallel)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**FOUR_RANKS)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    measured = measuring(4).run(measure_tensor_parallel_steps, str(tmp_path), lengths(2), 2, timeout=600)[0]
    for n, p, m in zip(lengths(2), plans["tensor_parallel"], measured):
        print(f"tp 2 x cp 2 {n}: plan {p / 2**20:.1f} MB, measured {m / 2**20:.1f} MB")
        assert abs(p - m) <= TOLERANCE * m, (n, p, m)


def test_plan_step_bytes_match_a_pipeline_step(measuring, plans):
    """pp 2 x cp 2 on 4 ranks (hfcp.pipeline; one layer a stage), two microbatches of one row under 1F1B, a full
    fine-tune: the plan dry-runs the runner's step on the first and the last stage (the first holds two rows'
    checkpoints and the embedding, the last the loss; traced with two layers a stage, the fit taken down to one)
    and adds the runner's fp32 reduction bucket; the worst rank measured."""
    measured = measuring(4).run(measure_pipeline_steps, FOUR_RANKS, lengths(2), 2, 2, 2, timeout=600)[0]
    for n, p, m in zip(lengths(2), plans["pipeline"], measured):
        print(f"pp 2 x cp 2 {n}: plan {p / 2**20:.1f} MB, measured {m / 2**20:.1f} MB")
        assert abs(p - m) <= TOLERANCE * m, (n, p, m)
