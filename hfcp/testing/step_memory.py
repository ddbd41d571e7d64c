"""A training step's memory measured as bench/reach.py measures it, for any config and any of hfcp.plan's options:
on every rank of a gloo group (a DistPool task, or a torchrun worker), the model built from the config on the CPU
in fp32, made ready as a training run makes it (LoRA, gradient checkpointing, hfcp.patch), one warm-up step, then
the peak RSS growth of each step from a model at rest with no gradients (glibc's mmap threshold fixed), the worst
rank's. What tests/sweeps/test_plan_memory.py holds hfcp.plan(..., device="cpu") to."""
from __future__ import annotations

import torch

from .memory import PeakRSS, fix_mmap_threshold


def measure_steps(config_dict: dict, seq_lens: list[int], strategy: str = "ring", ulysses_size: int | None = None,
                  lora_rank: int | None = None, lora_targets=None, checkpointing: bool = True,
                  tiled_mlp: bool | int = False, offload_checkpoints: bool = False) -> list[int]:
    """The worst rank's peak RSS growth (bytes) of a step at each length of `seq_lens` (after one warm-up step at
    the first: what a first step allocates once, the host's heap grown for that length's small tensors included, is
    not a step's), on the calling group's ranks."""
    import hfcp

    config, model = _built(config_dict, seq_lens)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=list(lora_targets or []) or None))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    hfcp.patch(model, strategy=strategy, ulysses_size=ulysses_size, check_inputs=False, tiled_mlp=tiled_mlp,
               offload_checkpoints=offload_checkpoints)
    return _worst_growth(model, config.vocab_size, seq_lens)


def _built(config_dict: dict, seq_lens: list[int]):
    """(config, model): the model of `config_dict` on the CPU in fp32 (seeded), its positions reaching the lengths;
    glibc's mmap threshold fixed first."""
    import transformers

    fix_mmap_threshold()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**config_dict)
    config.max_position_embeddings = max(seq_lens + [getattr(config, "max_position_embeddings", 0) or 0])
    return config, transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def measure_tensor_parallel_steps(path: str, seq_lens: list[int], tp: int) -> list[int]:
    """measure_steps' figures for the checkpoint at `path` loaded tensor-parallel over tp consecutive ranks
    (transformers' DistributedConfig), CP over the rest of the group's ranks (hfcp.patch's cp_size), a full
    fine-tune with gradient checkpointing."""
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    import hfcp

    fix_mmap_threshold()
    cp = dist.get_world_size() // tp
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_size=tp, dp_replicate_size=cp))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    hfcp.patch(model, cp_size=cp, check_inputs=False)
    return _worst_growth(model, model.config.vocab_size, seq_lens)


def measure_pipeline_steps(config_dict: dict, seq_lens: list[int], pp: int, microbatches: int, rows: int,
                           schedule: str = "1F1B") -> list[int]:
    """measure_steps' figures for hfcp.pipeline's step (`pp` stages x cp over the rest of the group's ranks, one
    data group), `rows` rows a batch in `microbatches` microbatches, a full fine-tune with gradient checkpointing:
    the step the runner takes, its gradient reduction included."""
    import torch.distributed as dist

    import hfcp

    config, model = _built(config_dict, seq_lens)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    runner = hfcp.pipeline(model, pp_size=pp, cp_size=dist.get_world_size() // pp, schedule=schedule,
                           n_microbatches=microbatches, check_inputs=False)

    def step(seq_len: int) -> None:
        ids = torch.randint(0, config.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(seq_len))
        runner.step(input_ids=ids, labels=ids)

    return _worst_of(step, runner.zero_grad, seq_lens)


def _worst_growth(model, vocab_size: int, seq_lens: list[int]) -> list[int]:
    """The worst rank's peak RSS growth of a step at each length (the output dropped before backward, as the
    Trainer drops it); the model unpatched after."""
    import hfcp

    def step(seq_len: int) -> None:
        ids = torch.randint(0, vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    worst = _worst_of(step, model.zero_grad, seq_lens)
    hfcp.unpatch(model)
    return worst


def _worst_of(step, zero_grad, seq_lens: list[int]) -> list[int]:
    """The worst rank's peak RSS growth of step(seq_len) at each length, from no gradients, after a warm-up step at
    the first."""
    import torch.distributed as dist

    step(seq_lens[0])
    worst = []
    for seq_len in seq_lens:
        zero_grad(set_to_none=True)
        with PeakRSS(torch.device("cpu")) as mem:
            step(seq_len)
        growth = [None] * dist.get_world_size()
        dist.all_gather_object(growth, mem.growth)
        worst.append(max(growth))
    zero_grad(set_to_none=True)
    return worst


def plan_case(case: tuple, seq_lens: list[int]) -> list[int]:
    """hfcp.plan(...).step_bytes at each length for a case (config_dict, cp, plan options); device "cpu", no FSDP
    (the measured runs hold whole models). In a process without a process group (the dry run makes its own)."""
    import transformers

    import hfcp

    config, cp, options = case
    return [hfcp.plan(transformers.AutoConfig.for_model(**config), seq_len=n, cp_size=cp, device="cpu", sharded=False,
                      **options).step_bytes for n in seq_lens]
