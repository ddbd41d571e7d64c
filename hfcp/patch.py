"""hfcp.patch / hfcp.unpatch / hfcp.gather_sequence: the one-line surgery and its inverse."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from accelerate.hooks import SequentialHook, add_hook_to_module, remove_hook_from_module
from transformers import PreTrainedModel
from transformers.models.auto import modeling_auto

from .attention import STRATEGIES, build_usp_groups, check_heads, check_ulysses_size
from .collectives import all_gather
from .hf_attention import KEY, register_with_transformers
from .introspect import (interface_attention_classes, logit_transform, not_through_interface, other_mixers,
                         router_aux_loss)
from . import generation, mixers, rope, vision_hooks, vlm_hooks
from .lm_hooks import ShardSequenceHook
from .vision_split import VisionTowerSplitHook, splits_frames, splits_tower
from .vlm_hooks import LanguageModelHook, find_language_model, module_with_config
from .linear_ce import IDENTITY, LogitTransform
from .forward_data import ForwardData
from .layout import StepBatch
from .mesh import Mesh, as_timedelta, build_mesh, cp_group_of_device_mesh, tp_ranks_of_device_mesh
from .registry import REGISTRY, Patcher, UnsupportedModelError
from .router_loss import RouterStatsHook
from .tensor_parallel import is_sharded, tensor_parallel_ranks

log = logging.getLogger("hfcp")


@dataclass(eq=False)
class CPState:
    """Everything hfcp holds for one patched model: the step's layout in `step`, the forward's data in `fwd` (both
    replaced each forward; no globals)."""

    mesh: Mesh
    strategy: str
    patcher: Patcher
    head: str  # "causal_lm", "classification" or "base"
    original_attn: str
    settings: dict
    check_inputs: bool = True
    loss_chunk: int | str | None = "auto"
    logit_transform: LogitTransform = IDENTITY  # what the model does to its head's output (the chunked loss applies it)
    modules: list = field(default_factory=list)
    hooks: list = field(default_factory=list)  # [(module, hook)] attached by patch
    rope_restores: list = field(default_factory=list)  # dynamic RoPE modules wrapped by patch (hfcp/rope.py)
    mixer_restores: list = field(default_factory=list)  # what hfcp.mixers.bind changed (modules, hooks, wrappers)
    layer_steps: object = None  # hfcp.mixers.LayerSteps: the step each mixer call (and its recompute) belongs to
    step: StepBatch | None = None
    fwd: ForwardData = field(default_factory=ForwardData)
    attn_owner: object = None  # the model whose attn_implementation patch set (a VLM: its language model only)
    outer_forward: object = None  # a VLM: restores the outer model's wrapped forward (vlm_hooks.clear_layout_after)
    attention_group: object = None  # what the strategy communicates over: the CP group, or usp's sub-groups
    router_aux: object = None  # RouterAux, None (no aux loss in the forward) or why hfcp cannot compute it
    want_token_stats: bool = False  # set by integrations whose metrics need them (HfcpSFTTrainer)

    def __deepcopy__(self, memo):
        raise RuntimeError(
            "copy.deepcopy of a hfcp-patched model is not supported (its hooks and process groups cannot be "
            "copied correctly): deepcopy before hfcp.patch, or hfcp.unpatch, copy, and patch both"
        )


def find_pretrained(model) -> PreTrainedModel:
    """The transformers model inside PEFT / DDP / accelerate wrappers."""
    m = model
    for _ in range(8):
        if isinstance(m, PreTrainedModel):
            return m
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        elif isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        else:
            break
    raise TypeError(f"hfcp.patch expects a transformers PreTrainedModel (optionally PEFT/DDP-wrapped), got {type(model).__name__}")


_HEADS = {  # transformers' auto mappings -> how hfcp treats the head
    "causal_lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    "classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES"),
    "base": ("MODEL_MAPPING_NAMES",),
}


def patcher_for(inner: PreTrainedModel) -> Patcher:
    """The model type's Patcher, with its attention classes read from this model for a family registered with
    read_from_model. Every record, whoever registered it, is held to the same model checks: its attention classes
    compute attention through transformers' AttentionInterface, they are the only sequence mixers, and the model
    does not compute positions from input_ids. A record with skip_model_checks=True skips them (its author takes
    responsibility; hfcp logs a warning).

    Raises:
        UnsupportedModelError: no record, a known refusal, or a model that needs what hfcp does not implement.
    """
    patcher = REGISTRY.lookup(inner.config.model_type)
    target = inner
    if patcher.language_model == "auto":  # read from the model: the module whose config is the VLM's text config
        patcher = dataclasses.replace(patcher, language_model=module_with_config(inner, inner.config.get_text_config())
                                      or "")
        if not patcher.language_model:
            raise UnsupportedModelError(f"{type(inner).__name__} (model_type={inner.config.model_type!r}): hfcp found no "
                                        "single module whose config is its text config (the language model)")
    if patcher.vision_tower == "auto":  # the module whose config is the vision config, split if its type is known to
        vision = getattr(inner.config, "vision_config", None)  # encode each image alone (else it runs whole)
        patcher = dataclasses.replace(patcher, vision_tower=(module_with_config(inner, vision) or "")
                                      if splits_tower(vision) else "")
    if patcher.language_model:  # a VLM: its language model mixes the merged sequence (the vision tower runs whole)
        target = find_language_model(inner, patcher.language_model)
        if target is None:
            raise UnsupportedModelError(f"{type(inner).__name__} (model_type={inner.config.model_type!r}): its record "
                                        f"names the language model {patcher.language_model!r}, but the model has no "
                                        "such module whose config is its text config")
        patcher = with_text_record(patcher, target)
        if patcher.vision_tower and not _has_module(inner, patcher.vision_tower):
            raise UnsupportedModelError(f"{type(inner).__name__}: its record splits the vision tower at "
                                        f"{patcher.vision_tower!r}, which the model does not have")
    if patcher.read_from_model:
        _warn_if_verified_elsewhere(patcher)
        classes = interface_attention_classes(target)
    else:
        classes = patcher.attention_classes
    if patcher.skip_model_checks:
        log.warning("hfcp: the record for model_type=%r skips hfcp's model checks (skip_model_checks=True): a sequence "
                    "mixer other than its attention classes would see only its rank's shard, silently",
                    patcher.model_type)
        return dataclasses.replace(patcher, attention_classes=classes, read_from_model=False)
    reason = None if classes or patcher.mixers else ("none of its modules computes attention through transformers' "
                                                     "AttentionInterface (its sequence mixing happens elsewhere)")
    reason = reason or not_through_interface(target, classes) or other_mixers(
        target, classes, tuple(name for name, _ in patcher.mixers), patcher.token_wise_classes)
    if reason is not None:
        how = "" if patcher.read_from_model else (" (checked for the record registered for it; a record that "
                                                  "knows better can pass skip_model_checks=True)")
        raise UnsupportedModelError(f"{type(inner).__name__} (model_type={inner.config.model_type!r}) is not "
                                    f"supported by hfcp: {reason}{how}")
    return dataclasses.replace(patcher, attention_classes=classes, read_from_model=False)


def _has_module(model, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def with_text_record(patcher: Patcher, language_model) -> Patcher:
    """A VLM record with its language model's family knowledge: the text model_type must have a record of its own
    (REGISTRY.lookup raises for an unknown or refused one), whose length limit, position rule and sequence mixers
    other than attention apply."""
    text = REGISTRY.lookup(language_model.config.model_type)
    return dataclasses.replace(patcher, max_seq_len=text.max_seq_len, max_seq_len_reason=text.max_seq_len_reason,
                               positions_from_mask=text.positions_from_mask, causal=text.causal,
                               token_side_inputs=patcher.token_side_inputs + text.token_side_inputs,
                               mixers=patcher.mixers + text.mixers,
                               token_wise_classes=patcher.token_wise_classes + text.token_wise_classes)


def _warn_if_verified_elsewhere(patcher: Patcher) -> None:
    import transformers

    if patcher.verified_with is not None and transformers.__version__ != patcher.verified_with:
        log.warning("hfcp: model_type=%r was shown exact with transformers %s, this is %s; the runtime checks still "
                    "refuse what hfcp does not implement, and scripts/support_matrix.py reruns the sweep",
                    patcher.model_type, patcher.verified_with, transformers.__version__)


def _head_kind(model: PreTrainedModel, model_type: str, token_model: bool) -> str:
    names = [c.__name__ for c in type(model).__mro__]  # FSDP2 swaps in a dynamic subclass (FSDPLlamaForCausalLM)
    name = type(model).__name__
    allowed = ("classification", "base") if token_model else ("causal_lm", "base")
    supported = []
    for kind in allowed:
        for mapping in _HEADS[kind]:
            cls = getattr(modeling_auto, mapping).get(model_type)
            if cls is not None and cls in names:
                return kind
            if cls is not None:
                supported.append(cls)
    raise UnsupportedModelError(
        f"{name} (model_type={model_type!r}) has a head hfcp does not support under CP; supported: {supported}"
    )


def _head_counts(inner: PreTrainedModel, patcher: Patcher, tp_ranks) -> tuple[int, int]:
    """(query heads, KV heads) of one rank's attention, from the config fields the record names.

    Raises:
        UnsupportedModelError: the text config has no such field (ulysses / usp need the head counts).
    """
    cfg = inner.config.get_text_config()
    heads = getattr(cfg, patcher.num_heads_attr, None)
    if not isinstance(heads, int):
        raise UnsupportedModelError(f"{type(inner).__name__} (model_type={inner.config.model_type!r}): ulysses and usp "
                                    f"split attention heads, but its config has no {patcher.num_heads_attr!r} (the "
                                    "record's num_heads_attr) to read them from; use strategy='ring' or 'allgather'")
    kv_heads = getattr(cfg, patcher.num_kv_heads_attr, None) or heads
    if tp_ranks is not None:  # each TP rank's attention holds its share of the heads
        heads, kv_heads = heads // len(tp_ranks), max(kv_heads // len(tp_ranks), 1)
    return heads, kv_heads


def patch(model, cp_size: int | None = None, strategy: str = "ring", process_group=None, timeout=None,
          check_inputs: bool = True, loss_chunk: int | str | None = "auto", ulysses_size: int | None = None,
          device_mesh=None):
    """Make `model` context-parallel in place and return it.

    Args:
        model: a transformers PreTrainedModel, PEFT-wrapped or not, optionally inside DDP.
        cp_size: ranks per CP group (None: the whole world, or the size of `process_group`).
        strategy: "ring", "allgather", "ulysses" or "usp" (Ulysses inside groups of `ulysses_size` consecutive
            ranks of the CP group, ring across them).
        process_group: an existing group to use as the CP group: any set of ranks. Every rank of the world then
            calls patch: the groups are compared, and their data-parallel coordinates read, in one all-gather.
        timeout: seconds or timedelta bounding every collective on the CP group.
        check_inputs: verify each step (one tiny all-gather) that every rank of a CP group got the same batch.
        loss_chunk: how a causal LM's loss is computed when labels are given. An int: this many tokens at a
            time from the last hidden states, so (tokens x vocab) logits are never materialised (out.logits is
            then None). None: the model computes its logits as usual and hfcp the loss from them. "auto"
            (default): 1024-token chunks in training forwards (train mode, grad enabled), logits otherwise.
        ulysses_size: usp only: ranks per Ulysses group (None: the largest divisor of cp that divides both head
            counts).
        device_mesh: a torch DeviceMesh whose group is the CP group: a 1-D mesh such as `mesh["cp"]`, or a mesh
            with a dimension named "cp". Instead of `process_group`.

    A model that transformers loaded tensor-parallel (`tp_plan`, DistributedConfig) keeps its TP: each rank's
    attention sees its TP rank's heads, and the CP groups run across TP groups (hfcp builds them so with
    `cp_size`; a given group must share no rank with the TP group).
    Returns:
        The same model object. With one process or cp_size 1 the model is left unchanged.
    Raises:
        UnsupportedModelError: no patcher for config.model_type, or an unsupported head.
        ValueError: unknown strategy, bad cp_size / timeout / check_inputs / loss_chunk, ulysses with indivisible
            heads, a process_group without this rank, groups the ranks disagree on, a device_mesh without a CP
            dimension, a CP group inside the TP group, a tensor-parallel model with recurrent layers, a VLM or a
            vision model, pipeline stages, already patched with other settings.
    """
    if loss_chunk not in (None, "auto") and (not isinstance(loss_chunk, int) or isinstance(loss_chunk, bool) or loss_chunk < 1):
        raise ValueError(f"loss_chunk={loss_chunk!r} must be a positive number of tokens, 'auto' or None")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {sorted(STRATEGIES)}")
    inner = find_pretrained(model)
    model_type = inner.config.model_type
    patcher = patcher_for(inner)  # raises on every rank before any collective
    head = _head_kind(inner, model_type, token_model=bool(patcher.embeddings_classes))
    chunk = loss_chunk if head == "causal_lm" else None
    transform = logit_transform(inner) if chunk is not None else None
    if chunk is not None and transform is None:
        log.info("hfcp: %s changes its logits after the output head in a way hfcp does not read; its loss is "
                 "computed from those logits (loss_chunk=None)", type(inner).__name__)
        chunk = None
    if not isinstance(check_inputs, bool):
        raise ValueError(f"check_inputs={check_inputs!r} must be True or False")
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group= or device_mesh= (the CP group), not both")
        process_group = cp_group_of_device_mesh(device_mesh)
    tp_ranks = tensor_parallel_ranks(inner)
    mesh_tp = tp_ranks_of_device_mesh(device_mesh) if device_mesh is not None else None
    if mesh_tp is not None and mesh_tp != tp_ranks:  # TP that hfcp cannot read (torch's parallelize_module), or another
        raise ValueError(f"device_mesh has a 'tp' dimension over ranks {mesh_tp}, but {type(inner).__name__}'s "
                         f"tensor-parallel group is {tp_ranks or 'none (transformers records no tp_size)'}: hfcp reads "
                         "TP from transformers (tp_plan / DistributedConfig); load the model with it over that mesh")
    if tp_ranks is not None and (patcher.mixers or patcher.language_model or patcher.embeddings_classes):
        what = ("it has recurrent or convolution layers" if patcher.mixers else
                "a vision-language model" if patcher.language_model else "a vision model")
        raise ValueError(f"{type(inner).__name__} ({what}) is loaded tensor-parallel (tp_size={len(tp_ranks)}): "
                         "hfcp's TP x CP is verified for causal LMs whose sequence mixers are all attention; load it "
                         "without tp_plan / DistributedConfig")
    if tp_ranks is not None and chunk is not None and is_sharded(inner.get_output_embeddings().weight):
        if loss_chunk != "auto":
            raise ValueError(f"loss_chunk={loss_chunk!r}: the output head of this tensor-parallel model is sharded "
                             "over the vocabulary, which hfcp's chunked loss does not split; use loss_chunk=None "
                             "(or 'auto'): the head gathers its logits and hfcp computes the loss from them")
        log.info("hfcp: the output head is tensor-parallel: the loss is computed from its gathered logits")
        chunk = None
    settings = dict(cp_size=cp_size, strategy=strategy, process_group=process_group, timeout=as_timedelta(timeout),
                    check_inputs=check_inputs, loss_chunk=loss_chunk, ulysses_size=ulysses_size,
                    device_mesh=device_mesh)
    existing = getattr(inner, "_hfcp_state", None)
    if existing is not None:
        if existing.settings == settings:
            return model
        differ = {k: (existing.settings[k], v) for k, v in settings.items() if existing.settings[k] != v}
        raise ValueError(
            f"model is already patched with other settings ({', '.join(f'{k}={a!r}, now {b!r}' for k, (a, b) in differ.items())}); "
            "call hfcp.unpatch(model) before patching with other settings"
        )
    owner = find_language_model(inner, patcher.language_model) if patcher.language_model else inner  # whose attention
    modules = [m for m in owner.modules() if type(m).__name__ in patcher.attention_classes]
    if not modules and not patcher.mixers:  # (a record's mixers alone: a model without attention, such as Mamba-2)
        raise UnsupportedModelError(
            f"the {model_type!r} patcher looks for {patcher.attention_classes} but {type(inner).__name__} has none"
        )
    mesh = build_mesh(cp_size, process_group, timeout, tp_ranks)
    if mesh is None:
        log.info("hfcp: one process or cp_size=1: %s runs unchanged", type(inner).__name__)
        return model
    u = None
    if modules and strategy in ("ulysses", "usp"):  # (a model without attention, such as Mamba, has no heads to split)
        heads, kv_heads = _head_counts(inner, patcher, tp_ranks)
        try:
            if strategy == "ulysses":
                check_heads(heads, kv_heads, mesh.cp_size)
            u = check_ulysses_size(ulysses_size, mesh.cp_size, heads, kv_heads) if strategy == "usp" else None
        except ValueError as e:
            if tp_ranks is None:
                raise
            raise ValueError(f"{e} (the head counts of one tensor-parallel rank: the model's over tp={len(tp_ranks)})") from None
    attention_group = mesh.cp_group
    if u is not None:  # usp: every rank builds every sub-group (collective), after the checks that can raise
        attention_group = build_usp_groups(mesh.cp_groups, u, as_timedelta(timeout))
    elif ulysses_size is not None and strategy != "usp":
        raise ValueError(f"ulysses_size={ulysses_size!r} applies to strategy='usp' only (strategy={strategy!r})")
    embeddings = None
    if patcher.embeddings_classes:
        embeddings = next((m for m in inner.modules() if type(m).__name__ in patcher.embeddings_classes), None)
        if embeddings is None:
            raise UnsupportedModelError(f"the {model_type!r} patcher found no {patcher.embeddings_classes} module")
    register_with_transformers()
    state = CPState(mesh, strategy, patcher, head,
                    original_attn=owner.config._attn_implementation, settings=settings, attn_owner=owner,
                    check_inputs=check_inputs, loss_chunk=chunk, attention_group=attention_group,
                    modules=modules, logit_transform=transform or IDENTITY,
                    router_aux=router_aux_loss(inner) if head == "causal_lm" else None)
    if patcher.language_model and state.router_aux is not None:
        state.router_aux = "hfcp does not compute the router aux loss of a vision-language model yet"
    state.mixer_restores = mixers.bind(state, owner, patcher)  # the record's other mixers (may refuse: first)
    owner.set_attn_implementation(KEY)
    inner._hfcp_state = state
    for m in modules:
        m._hfcp_state = state
    if embeddings is not None:
        state.hooks = vision_hooks.attach(inner, state, embeddings)
    elif patcher.language_model:  # the loss at the outer model, the sharding at its language model's input
        state.hooks = [(inner, ShardSequenceHook(state, shards=False)), (owner, LanguageModelHook(state))]
        for module, hook in state.hooks:
            add_hook_to_module(module, hook, append=True)
        state.outer_forward = vlm_hooks.clear_layout_after(inner, state)
        if hasattr(inner, "generate"):
            generation.wrap_generate(inner, mesh.cp_group)
        if patcher.vision_tower:  # each rank encodes its share of the images
            tower = inner.get_submodule(patcher.vision_tower)
            state.hooks.append((tower, VisionTowerSplitHook(state, splits_frames(getattr(tower, "config", None)))))
            add_hook_to_module(state.hooks[-1][0], state.hooks[-1][1], append=True)
    else:
        state.hooks = [(inner, ShardSequenceHook(state))]
        add_hook_to_module(inner, state.hooks[0][1], append=True)
        if head == "causal_lm" and hasattr(inner, "generate"):
            generation.wrap_generate(inner, mesh.cp_group)
        if state.router_aux is not None and not isinstance(state.router_aux, str):
            if inner.base_model is inner:
                state.router_aux = f"{type(inner).__name__} has no base model whose router logits hfcp can take"
            else:
                state.hooks.append((inner.base_model, RouterStatsHook(state)))
                add_hook_to_module(inner.base_model, state.hooks[-1][1], append=True)
    if embeddings is None:  # the language model's rotary modules (a VLM's vision tower is not sharded)
        state.rope_restores = rope.attach(rope.dynamic_rope_modules(owner), state)
    log.info("hfcp: %s patched: strategy=%s cp=%d (dp=%d), %d attention modules",
             type(inner).__name__, strategy, mesh.cp_size, mesh.dp_size, len(modules))
    return model


def unpatch(model):
    """Undo `patch`: original attention implementation, no hfcp hook (other hooks kept). Returns model."""
    inner = find_pretrained(model)
    state = getattr(inner, "_hfcp_state", None)
    if state is None:
        return model
    if state.outer_forward is not None:
        state.outer_forward()
    for module, ours in state.hooks:
        if hasattr(ours, "restore_pending_head"):  # a chunked forward that raised may have left the head swapped
            ours.restore_pending_head()
        _remove_hook(module, ours)
    rope.detach(state.rope_restores)
    mixers.unbind(state.mixer_restores)
    generation.unwrap_generate(inner)
    state.attn_owner.set_attn_implementation(state.original_attn)
    for m in state.modules:
        del m._hfcp_state
    del inner._hfcp_state
    return model


def _remove_hook(module, ours) -> None:
    """Remove `ours` from module, keeping any other accelerate hook chained with it."""
    hook = getattr(module, "_hf_hook", None)
    others = [h for h in hook.hooks if h is not ours] if isinstance(hook, SequentialHook) else []
    remove_hook_from_module(module)
    if "forward" in module.__dict__ and not others:
        del module.forward  # back to the class's forward
    for h in others:
        add_hook_to_module(module, h, append=True)


def cp_state(model) -> CPState | None:
    """The CP state of a patched model, or None."""
    return getattr(find_pretrained(model), "_hfcp_state", None)


def gather_sequence(tensor: torch.Tensor, model, dim: int = 1) -> torch.Tensor:
    """The full sequence (original order and length) of a local sequence output such as logits.

    Applies to outputs of the model's latest forward (the layout is per step); gather before the next forward.
    The model's own outputs carry their step: one from an earlier forward, or a dim other than their sequence
    dimension, is refused (ValueError).

    Differentiable: the backward sums over the CP group and returns each rank its slice (consistent with the
    loss convention, so mean-over-group grads stay exact). Unpatched models: returns `tensor` unchanged.
    """
    state = cp_state(model)
    if state is None or getattr(tensor, "hfcp_whole", False):  # (logits_to_keep's logits: the same on every rank)
        return tensor
    if state.step is None:
        raise RuntimeError("gather_sequence needs the output of a forward of the patched model")
    layout = state.step.layout
    stamp = getattr(tensor, "hfcp_step", None)  # set on the model's own sequence outputs
    if stamp is not None and stamp is not state.step:
        raise ValueError("gather_sequence got an output of an earlier forward; the layout is per step, so gather "
                         "each output before the next forward of the model")
    if stamp is not None and dim % tensor.dim() != 1:
        raise ValueError(f"gather_sequence(dim={dim}) of a model output of shape {tuple(tensor.shape)}: its sequence "
                         "dimension is 1 (batch, seq, ...); pass dim=1")
    if tensor.shape[dim] != layout.local_len:
        raise ValueError(f"tensor has {tensor.shape[dim]} tokens along dim {dim}; the local slice has {layout.local_len}")
    full = all_gather(tensor, state.mesh.cp_group, dim)
    return full.index_select(dim, layout.gathered_inverse(full.device))
