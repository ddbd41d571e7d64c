"""A rank's step, traced by the dry run: the model built on the meta device from its config (with as many layers as
asked), made ready as a training run makes it (LoRA, gradient checkpointing, hfcp.patch with the plan's options),
run forward and backward on one rank of a fake world, what it allocates counted (dry_run.Ledger)."""
from __future__ import annotations

import copy
import dataclasses
import time

import torch

from . import alst
from .dry_run import dry_step, dry_world
from .tensor_parallel import head_is_sharded, narrowed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a traced step depends on (the plan's arguments that change a rank's activations)."""
    cp: int
    strategy: str = "ring"
    ulysses_size: int | None = None
    batch: int = 1
    lora_rank: int | None = None
    lora_targets: tuple | None = None
    checkpointing: bool = True
    tiled_mlp: bool | int = False
    offload_checkpoints: bool = False
    dtype: str = "bf16"
    kernels: str = "cuda"  # whose operators' workspaces count ("cpu" for a CPU plan)
    step: str = "hfcp"  # whose step: hfcp's, or DeepSpeed ALST's (alst.py)
    tp: int = 1  # tensor-parallel ranks: a TP rank's step is traced (tensor_parallel.py)
    pp: int = 1  # pipeline stages (hfcp.pipeline): the step of `stage`'s first rank is traced
    microbatches: int = 1
    schedule: str = "1F1B"
    stage: int = 0


@dataclasses.dataclass
class Trace:
    layers: int
    local_tokens: int
    peak: int  # the device's peak above the step's start (gradients included)
    regions: dict  # part of the step -> dry_run.Region (its activations' peak)
    grads_end: int  # the gradients when backward is done
    host_peak: int
    sent: float  # bytes the rank sent (dry_run.Ledger.collective)
    collectives: dict
    seconds: float
    whole_logits: bool = False  # the loss computed from whole logits (a tensor-parallel head gathers them)


def layer_period(config) -> int:
    """The shortest repeat of the config's layer pattern (config.layer_types: sliding / full / linear attention);
    1 when every layer is alike."""
    types = getattr(config, "layer_types", None)
    if not types:
        return 1
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return len(types)


def reduced(config, layers: int):
    """`config` with `layers` layers, its layer pattern repeated."""
    period = layer_period(config)
    config = copy.deepcopy(config)
    types = getattr(config, "layer_types", None)
    config.num_hidden_layers = layers
    if types:
        config.layer_types = [types[i % period] for i in range(layers)]
    for name in ("mlp_only_layers",):  # (layer indices past the reduced count mean nothing)
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, [i for i in getattr(config, name) if i < layers])
    return config


def _peft_default(model):
    """PEFT's default LoRA targets for the model's type, or None."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    return DEFAULTS.get(model.config.model_type)


def build(config, setup: Setup):
    """The model of `config` on the meta device, as a training run of `setup` holds it before hfcp.patch."""
    import transformers

    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[setup.dtype])
        if setup.lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            targets = list(setup.lora_targets) if setup.lora_targets else None
            if targets is None and _peft_default(model) is None:
                targets = "all-linear"  # (PEFT knows no default targets for this model type: every linear layer)
            model = get_peft_model(model, LoraConfig(r=setup.lora_rank, target_modules=targets))
    if setup.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def trace(config, setup: Setup, layers: int, local_tokens: int) -> Trace:
    """One rank's training step of `config` cut to `layers` layers, with `local_tokens` tokens a rank (the sequence
    is local_tokens x cp), on a fake world of cp ranks."""
    from ..api import patch

    started = time.perf_counter()
    seq_len = local_tokens * setup.cp
    config = reduced(config, layers * setup.pp)  # (under pipeline stages, `layers` each)
    if setup.tp > 1:  # (a TP rank's heads and MLP width)
        config = narrowed(config, setup.tp)
    if getattr(config, "max_position_embeddings", seq_len) < seq_len:
        config.max_position_embeddings = seq_len
    ids = torch.randint(0, config.vocab_size, (setup.batch, seq_len), generator=torch.Generator().manual_seed(0))
    with dry_world(setup.cp * setup.pp, rank=setup.stage * setup.cp):
        model = build(config, setup)
        if setup.pp > 1:
            ledger = _pipeline_step(model, setup, ids)
        elif setup.step == "alst":
            with alst.prepared(model, setup.cp, bool(setup.tiled_mlp), setup.offload_checkpoints) as step:
                with dry_step(model, setup.kernels) as ledger:  # (rank 0's tokens: ALST's ranks get them sharded)
                    loss = step(ids[:, :local_tokens], torch.arange(local_tokens).expand(setup.batch, -1))
                    ledger.phase = "backward"
                    loss.backward()
                    del loss
        else:
            # (a vocabulary-sharded head under TP gathers its logits: hfcp computes the loss from them, unchunked)
            chunk = None if setup.tp > 1 and head_is_sharded(model) else "auto"
            patch(model, strategy=setup.strategy, ulysses_size=setup.ulysses_size, check_inputs=False,
                  tiled_mlp=setup.tiled_mlp, offload_checkpoints=setup.offload_checkpoints, loss_chunk=chunk)
            with dry_step(model, setup.kernels, model_loss=chunk is None) as ledger:
                # (the output dropped before backward, as the Trainer's training_step and a loop that keeps only the
                # loss drop it: whole logits, where the loss is computed from them, are not held through backward)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                ledger.phase = "backward"
                loss.backward()
                del loss
        grads_end = ledger.grads
    return Trace(layers, local_tokens, ledger.peak, ledger.regions, grads_end, ledger.host_peak, ledger.sent,
                 ledger.collectives, time.perf_counter() - started, ledger.model_loss)


def _pipeline_step(model, setup: Setup, ids: torch.Tensor):
    """The step of the traced stage's first rank under hfcp.pipeline (pp stages x cp, one data group): the runner's
    own step, its schedule's forwards and backwards named for the ledger (a part of the step each; "forward, later"
    and "backward, later" after the first backward, where the same activations meet the stage's gradients); the
    gradient reduction after them a part of its own ("reduction", which the plan counts from the runner's
    bucket). Two answers a dry run cannot read
    from its fake group are given: which ranks of the stage have a gradient (the runner's one host read) is this
    rank's answer (every rank of a stage runs the same layers), and a send has completed by the next action."""
    from ..pipelining import pipeline

    runner = pipeline(model, pp_size=setup.pp, cp_size=setup.cp, schedule=setup.schedule,
                      n_microbatches=setup.microbatches, strategy=setup.strategy, ulysses_size=setup.ulysses_size,
                      check_inputs=False, tiled_mlp=setup.tiled_mlp, offload_checkpoints=setup.offload_checkpoints)
    runner._gradient_somewhere = lambda params: [p.grad is not None for p in params]
    runner._sent = lambda work: True  # (a fake send never completes; a real one has by the next action's, its peer
    # waiting for it: the neighbour's next action needs it)
    backwards = []  # (the backwards run: a forward or backward after the first runs with gradients alive)
    with dry_step(model, setup.kernels) as ledger:
        def named(method, phase: str, where: str | None = None):
            def run(*args, **kwargs):
                ledger.phase = f"{phase}, later" if backwards and phase in ("forward", "backward") else phase
                if where is not None:
                    ledger.where = where
                out = method(*args, **kwargs)
                backwards.extend(["B"] if phase == "backward" else [])
                return out
            return run

        runner._forward = named(runner._forward, "forward")
        runner._backward = named(runner._backward, "backward")
        runner._reduce_gradients = named(runner._reduce_gradients, "reduction", "gradients")
        runner.step(input_ids=ids, labels=ids)  # (the loss returned and dropped)
    return ledger


def dry_run(config, seq_len: int, cp_size: int, strategy: str = "ring", ulysses_size: int | None = None,
            layers: int | None = 2, batch_size: int = 1, lora_rank: int | None = None, lora_targets=None,
            gradient_checkpointing: bool = True, tiled_mlp: bool | int = False, offload_checkpoints: bool = False,
            dtype: str = "bf16", step: str = "hfcp") -> Trace:
    """hfcp's training step of `config` at `seq_len` tokens on one rank of a fake world of cp_size ranks, every
    layout computation, mask, index and collective as a real run has them, the tensors on the meta device (see
    dry_run.py); the model cut to `layers` layers (None: all of them; a layer's step is each layer's); step="alst":
    DeepSpeed ALST's step instead of hfcp's (alst.py). Returns the
    Trace: the device's peak, the host's, the bytes sent, the collectives called, the seconds it took."""
    from .configs import load_config

    config, _ = load_config(config)
    if seq_len % cp_size:
        raise ValueError(f"seq_len={seq_len} must be a multiple of cp_size={cp_size}")
    setup = Setup(cp_size, strategy, ulysses_size, batch_size, lora_rank, tuple(lora_targets) if lora_targets else None,
                  gradient_checkpointing, tiled_mlp, offload_checkpoints, dtype, step=step)
    return trace(config, setup, layers or config.num_hidden_layers, seq_len // cp_size)
