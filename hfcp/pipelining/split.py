"""hfcp.pipeline as a short script: everything that can refuse, then the groups, CP, the stage's layers and
parameters, the runner."""
from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from ..api import apply_memory_options, patch
from ..families.introspect import decoder_layers, forward_source
from ..families.registry import UnsupportedModelError
from ..families.resolve import patcher_for, plan_patch, router_aux_for
from ..state import Settings, cp_state, find_pretrained
from ..memory.tiled_mlp import mlps_to_tile, tile_tokens
from .runner import PipelineRunner
from .schedule import check_schedule
from .stage import bind_stage, free_other_parameters, layer_ranges, stage_parameters

log = logging.getLogger("hfcp")



def pipeline(model, pp_size: int, cp_size: int = 1, schedule: str = "1F1B", n_microbatches: int = 1,
             strategy: str = "ring", **patch_options) -> PipelineRunner:
    """Split a causal LM into `pp_size` pipeline stages, each context-parallel over `cp_size` ranks.

    Every rank passes the same whole model (PEFT-wrapped or not, gradient checkpointing on or off); from then on it
    serves this rank's stage (the other stages' parameters are freed). The world is laid out (pp, dp, cp), cp
    innermost: rank = (stage * dp + d) * cp + c, dp = world / (pp * cp).

    Args:
        model: a transformers causal LM whose decoder layers return their hidden states.
        pp_size: pipeline stages (contiguous ranges of decoder layers, as even as can be).
        cp_size: ranks per CP group inside a stage (1: no CP).
        schedule: "GPipe" or "1F1B".
        n_microbatches: microbatches per step; they must divide the rows of each batch.
        strategy, patch_options: hfcp.patch's (timeout, loss_chunk, check_inputs, balance, tiled_mlp,
            offload_checkpoints); tiled_mlp and offload_checkpoints apply at cp_size 1 too.
    Returns:
        A PipelineRunner: step(**batch) / eval_step(**batch) return the batch's one-process loss on every rank;
        named_parameters() / parameters() are this stage's; zero_grad(), train(), eval().
    Raises:
        ValueError: no process group, pp_size * cp_size not dividing the world, a bad pp_size, schedule or
            n_microbatches, more stages than layers; and what hfcp.patch raises.
        UnsupportedModelError: a model that is not a causal LM of decoder layers returning their hidden states, a
            MoE router aux loss, recurrent mixers, a vision-language model.
    """
    world, rank = _check_world(pp_size, cp_size, schedule, n_microbatches)
    inner = find_pretrained(model)
    layers = _check_model(model, inner, pp_size, cp_size, strategy)
    _check_patched(inner, cp_size, dict(strategy=strategy, **patch_options))
    memory = _memory_options_without_cp(inner, strategy, patch_options) if cp_size == 1 else None
    dp = world // (pp_size * cp_size)
    stage = rank // (dp * cp_size)
    groups = _groups(pp_size, dp, cp_size, rank, inner)
    if cp_size > 1 and cp_state(inner) is None:
        patch(model, cp_size=cp_size, strategy=strategy, **patch_options)
    elif memory is not None:
        memory()
    own = layer_ranges(len(layers), pp_size)[stage]
    first, last = stage == 0, stage == pp_size - 1
    mine = stage_parameters(model, inner, layers, own, first, last)
    tied = inner.get_input_embeddings().weight if groups.get("tied") is not None and (first or last) else None
    layout = dict(stage=stage, stages=pp_size, dp=dp, cp=cp_size, rank=rank)
    runner = PipelineRunner(model, mine, layout, groups, schedule, n_microbatches, tied,
                            patch_options.get("check_inputs", True))
    bind_stage(layers, own, inner.get_input_embeddings(), runner.receive_hidden, first)
    state = cp_state(inner)
    if state is not None:  # each forward runs this stage's attention modules only (the layout plans for all)
        owned = {id(m) for i in own for m in layers[i].modules()}
        state.ran_modules = [m for m in state.modules if id(m) in owned]
    inner._hfcp_pipeline_data = ((rank // cp_size) % dp, dp)  # hfcp.data_parallel_rank_and_size: the data groups
    freed = free_other_parameters(model, mine)
    log.info("hfcp: pipeline stage %d of %d (layers %d-%d), dp=%d x cp=%d, %s, %d microbatches; %d parameters freed",
             stage, pp_size, own.start, own.stop - 1, dp, cp_size, schedule, n_microbatches, freed)
    return runner


def _check_world(pp_size, cp_size, schedule, n_microbatches) -> tuple[int, int]:
    for name, value in (("pp_size", pp_size), ("cp_size", cp_size), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"hfcp.pipeline: {name}={value!r} must be a positive integer")
    try:
        check_schedule(schedule)
    except ValueError as e:
        raise ValueError(f"hfcp.pipeline: {e}") from None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("hfcp.pipeline needs torch.distributed: launch with torchrun or accelerate launch")
    world = dist.get_world_size()
    if world % (pp_size * cp_size):
        raise ValueError(f"hfcp.pipeline: pp_size={pp_size} x cp_size={cp_size} must divide the world size {world}")
    return world, dist.get_rank()


def _check_model(model, inner, pp_size, cp_size, strategy) -> list:
    """The decoder layers, after every refusal (no collective yet)."""
    name = type(inner).__name__
    if inner.get_output_embeddings() is None or inner.get_input_embeddings() is None:
        raise UnsupportedModelError(f"hfcp.pipeline runs causal LMs (input embeddings, decoder layers, output head); "
                                    f"{name} has no output head")
    patcher = patcher_for(inner)
    plan = plan_patch(inner, patcher, Settings(cp_size=cp_size, strategy=strategy))
    why = ("is a vision-language or vision model" if plan.kind != "lm" else
           f"has a {plan.head} head" if plan.head != "causal_lm" else
           "has sequence mixers other than attention (their states would have to cross stages)" if patcher.mixers else
           "adds a MoE router aux loss in its forward (a term over every layer's router in one forward)"
           if router_aux_for(inner, plan) is not None else None)
    if why:
        raise UnsupportedModelError(f"hfcp.pipeline: {name} (model_type={inner.config.model_type!r}) {why}, which the "
                                    "pipeline does not run exactly; use hfcp.patch without pipeline stages")
    config = inner.config.get_text_config()
    layers = decoder_layers(inner, config.num_hidden_layers)
    holder = next((m for m in inner.modules() if layers and isinstance(m, nn.ModuleList) and m[0] is layers[0]), None)
    body = next((m for m in inner.modules() if any(c is holder for c in m.children())), None)  # (LlamaModel)
    source = forward_source(body) if body is not None else None
    if layers is None or source is None or "= decoder_layer(" not in source or "layer_outputs[0]" in source:
        raise UnsupportedModelError(f"hfcp.pipeline: {name}'s forward does not take each decoder layer's output as "
                                    "its hidden states (hidden_states = decoder_layer(...)), which a stage passes on")
    if pp_size > len(layers):
        raise ValueError(f"hfcp.pipeline: pp_size={pp_size} stages for {len(layers)} decoder layers; at most one "
                         "stage per layer")
    _check_parameters_around_layers(body, holder, inner.get_input_embeddings(), source, name)
    return layers


def _check_parameters_around_layers(body, holder, embeddings, source: str, name: str) -> None:
    """Stage 0 holds the input embeddings, the last stage what the forward calls after the layers (the final norm):
    a module with parameters that the forward calls before the layers (OPT's position embeddings, an embedding
    norm) would run on stages that do not hold it. Read from the forward's source; refused by name."""
    loop = source.index("= decoder_layer(")
    for child_name, child in body.named_children():
        if child is holder or child is embeddings or not any(True for _ in child.parameters()):
            continue
        used = f"self.{child_name}"
        if used in source[:loop] or used not in source[loop:]:
            raise UnsupportedModelError(
                f"hfcp.pipeline: {name}'s forward calls {child_name} ({type(child).__name__}, with parameters) "
                "before its decoder layers, or not after them: a pipeline stage holds the input embeddings (the "
                "first) or what runs after the layers (the last), so this model is not supported by hfcp.pipeline")


def _memory_options_without_cp(inner, strategy: str, patch_options: dict):
    """At cp_size 1 hfcp.patch leaves the model unchanged: tiled_mlp and offload_checkpoints, checked here (every
    refusal before any collective), are applied by the callable returned (None: neither asked for)."""
    settings = Settings(cp_size=1, strategy=strategy, **patch_options)
    if not settings.tiled_mlp and not settings.offload_checkpoints:
        return None
    owner = plan_patch(inner, patcher_for(inner), settings).owner
    tile = tile_tokens(settings.tiled_mlp, owner.config)
    mlps = mlps_to_tile(owner) if tile else []
    return lambda: apply_memory_options(inner, owner, tile, mlps, settings.offload_checkpoints)


def _check_patched(inner, cp_size: int, options: dict) -> None:
    """A model patched already must be patched with this CP size and these options (no collective)."""
    state = cp_state(inner)
    if state is None:
        return
    if cp_size == 1 or state.mesh.cp_size != cp_size or state.settings.differences(options):
        raise ValueError(f"hfcp.pipeline: the model is patched already (cp {state.mesh.cp_size}, "
                         f"{state.settings.strategy}), not as cp_size={cp_size} with {options}: pass the model "
                         "unpatched (hfcp.unpatch(model)); hfcp.pipeline patches each stage itself")


def _groups(pp, dp, cp, rank, inner) -> dict:
    """The process groups of this rank (every rank creates every group, in the same order): its stage's dp x cp
    ranks, its (d, c) line across the stages, and that line's first and last stage when they share a tied weight."""
    stride = dp * cp
    tied = pp > 1 and inner.get_input_embeddings().weight is inner.get_output_embeddings().weight
    out = {}
    for s in range(pp):
        ranks = list(range(s * stride, (s + 1) * stride))
        group = dist.new_group(ranks)
        if rank in ranks:
            out["stage"] = group
    for line in range(stride):
        ranks = [s * stride + line for s in range(pp)]
        group = dist.new_group(ranks)
        pair = dist.new_group([ranks[0], ranks[-1]]) if tied and pp > 2 else group
        if rank in ranks:
            out.update(pipe=group, pipe_ranks=ranks, tied=pair if tied else None)
    return out
