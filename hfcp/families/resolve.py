"""What hfcp.patch reads from a model before it changes anything: its record, head, loss and mesh inputs.

Everything here raises on every rank alike (it reads the model and the options only), before any collective;
`attention_group` builds usp's sub-groups (a collective) after its checks.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.models.auto import modeling_auto

from ..attention import build_usp_groups, check_heads, check_ulysses_size
from .forward_reading import logit_transform, router_aux_loss
from .introspect import (audio_config, interface_attention_classes, not_through_interface, other_mixers,
                         token_convolution)
from ..loss.linear_ce import LogitTransform
from .registry import REGISTRY, Patcher, UnsupportedModelError
from ..distributed.tensor_parallel import is_sharded, tensor_parallel_ranks
from ..distributed.mesh import tp_ranks_of_device_mesh, cp_group_of_device_mesh
from .heads import classification_head_name
from .introspect import find_language_model, module_with_config
from .towers import splits_tower, syncs_batch_norm

log = logging.getLogger("hfcp")

_HEADS = {  # transformers' auto mappings -> how hfcp treats the head
    "causal_lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                  "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"),  # (audio-language models: only there)
    "classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES"),
    "sequence_classification": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",),
    "token_classification": ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",),
    "base": ("MODEL_MAPPING_NAMES",),
}
# the heads of a model over a token sequence (vision, video) and of a language model (a causal LM's sequence)
_TOKEN_MODEL_HEADS = ("classification", "base")
_LANGUAGE_MODEL_HEADS = ("causal_lm", "sequence_classification", "token_classification", "base")


def patcher_for(inner: PreTrainedModel) -> Patcher:
    """The model type's Patcher, with its attention classes read from this model for a family registered with
    read_from_model. Every record, whoever registered it, is held to the same model checks: its attention classes
    compute attention through transformers' AttentionInterface, they are the only sequence mixers (no convolution
    over tokens outside the record's mixers and token embeddings either), and the model does not compute positions
    from input_ids. A record with skip_model_checks=True skips them (its author takes responsibility; hfcp logs a
    warning).

    Raises:
        UnsupportedModelError: no record, a known refusal, or a model that needs what hfcp does not implement.
    """
    patcher = REGISTRY.lookup(inner.config.model_type)
    target = inner
    if patcher.language_model == "auto":  # read from the model: the module whose config is the VLM's text config
        patcher = dataclasses.replace(patcher, language_model=module_with_config(inner, inner.config.get_text_config())
                                      or "")
        if not patcher.language_model:
            raise UnsupportedModelError(f"{type(inner).__name__} (model_type={inner.config.model_type!r}): hfcp found "
                                        "no single module whose config is its text config (the language model)")
    if patcher.vision_tower == "auto":  # the module whose config is the vision config, split if its type is known to
        vision = getattr(inner.config, "vision_config", None)  # encode each image alone (else it runs whole)
        patcher = dataclasses.replace(patcher, vision_tower=(module_with_config(inner, vision) or "")
                                      if splits_tower(vision) else "")
    if patcher.audio_tower == "auto":  # the same for the audio encoder and its clips
        audio = audio_config(inner.config)
        patcher = dataclasses.replace(patcher, audio_tower=(module_with_config(inner, audio) or "")
                                      if splits_tower(audio) else "")
    if patcher.language_model:  # a VLM: its language model mixes the merged sequence (the vision tower runs whole)
        target = find_language_model(inner, patcher.language_model)
        if target is None:
            raise UnsupportedModelError(f"{type(inner).__name__} (model_type={inner.config.model_type!r}): its record "
                                        f"names the language model {patcher.language_model!r}, but the model has no "
                                        "such module whose config is its text config")
        patcher = with_text_record(patcher, target)
        for kind, path in (("vision tower", patcher.vision_tower), ("audio encoder", patcher.audio_tower)):
            if path:
                _check_split_tower(inner, kind, path)
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
    handled = tuple(name for name, _ in patcher.mixers)
    reason = (reason or not_through_interface(target, classes)
              or other_mixers(target, classes, handled, patcher.token_wise_classes)
              or token_convolution(target, handled + patcher.embeddings_classes))
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


def _check_split_tower(inner, kind: str, path: str) -> None:
    """A tower hfcp splits by items must be one the model has, and none of its layers may mix items (batch norm's
    training statistics are over every item of the call: split, each rank would normalise by its own share)."""
    if not _has_module(inner, path):
        raise UnsupportedModelError(f"{type(inner).__name__}: its record splits the {kind} at {path!r}, which the "
                                    "model does not have")
    tower = inner.get_submodule(path)
    norms = sorted({type(m).__name__ for m in tower.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)})
    if norms and not syncs_batch_norm(getattr(tower, "config", None)):
        raise UnsupportedModelError(f"{type(inner).__name__}: its {kind} at {path!r} is registered as encoding each "
                                    f"item alone, but it normalises with {norms} over the batch of items: split over "
                                    "the CP group, each rank would normalise by its own share. Register it with "
                                    "register_per_clip_encoder(..., batch_norm=True) (the statistics summed over "
                                    "the group), or without splitting (it then runs whole on every rank)")
    hooked = sorted({type(m).__name__ for m in tower.modules()
                     if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and "forward" in m.__dict__})
    if norms and hooked:  # (hfcp sums their statistics through a forward of its own)
        raise UnsupportedModelError(f"{type(inner).__name__}: the batch norms {hooked} of its {kind} at {path!r} "
                                    "already have a forward of their own (a hook of another library): hfcp cannot sum "
                                    "their statistics over the CP group")


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
                    "refuse what hfcp does not implement, and scripts/tools/support_matrix.py reruns the sweep",
                    patcher.model_type, patcher.verified_with, transformers.__version__)


def _head_kind(model: PreTrainedModel, model_type: str, token_model: bool) -> str:
    names = [c.__name__ for c in type(model).__mro__]  # FSDP2 swaps in a dynamic subclass (FSDPLlamaForCausalLM)
    name = type(model).__name__
    allowed = _TOKEN_MODEL_HEADS if token_model else _LANGUAGE_MODEL_HEADS
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


@dataclass(frozen=True)
class Plan:
    """What hfcp.patch will do to one model, read from the model and the settings."""

    patcher: Patcher  # the record, with what it reads from the model filled in
    head: str  # "causal_lm", "sequence_classification", "token_classification", "classification" or "base"
    loss_chunk: int | str | None  # the setting kept, or None where the model's logits are needed
    transform: LogitTransform | None  # what the model does to its head's output (None: not read)
    process_group: object  # the CP group given (device_mesh's), or None: build one
    tp_ranks: tuple | None  # the model's tensor-parallel group
    owner: PreTrainedModel  # whose attention hfcp replaces (a VLM: its language model)
    modules: tuple  # the owner's attention modules
    embeddings: object  # a token model's patch embeddings, else None

    @property
    def kind(self) -> str:
        """"vision" (a token model: ViT, video), "vlm" (sharded at its language model) or "lm" (a causal LM)."""
        return "vision" if self.embeddings is not None else "vlm" if self.patcher.language_model else "lm"


def plan_patch(inner: PreTrainedModel, patcher: Patcher, settings) -> Plan:
    """The plan for `inner` under `settings` (hfcp.state.Settings).

    Raises:
        UnsupportedModelError: an unsupported head, no attention module, a token model without its embeddings.
        ValueError: device_mesh / tensor-parallel combinations hfcp cannot run exactly.
    """
    model_type = inner.config.model_type
    head = _head_kind(inner, model_type, token_model=bool(patcher.embeddings_classes))
    if head in ("sequence_classification", "token_classification") and patcher.language_model:
        raise UnsupportedModelError(f"{type(inner).__name__} (model_type={model_type!r}): hfcp runs classification "
                                    "heads of language models, not of vision-language models")
    classification_head_name(inner, head)
    chunk, transform = _loss_chunk(inner, head, settings.loss_chunk)
    mesh = settings.device_mesh
    group = cp_group_of_device_mesh(mesh) if mesh is not None else settings.process_group
    tp_ranks = tensor_parallel_ranks(inner)
    _check_tensor_parallel(inner, patcher, tp_ranks, tp_ranks_of_device_mesh(mesh) if mesh is not None else None)
    if tp_ranks is not None and chunk is not None and is_sharded(inner.get_output_embeddings().weight):
        if settings.loss_chunk != "auto":
            raise ValueError(f"loss_chunk={settings.loss_chunk!r}: the output head of this tensor-parallel model is "
                             "sharded over the vocabulary, which hfcp's chunked loss does not split; use "
                             "loss_chunk=None (or 'auto'): the head gathers its logits and hfcp computes the loss "
                             "from them")
        log.info("hfcp: the output head is tensor-parallel: the loss is computed from its gathered logits")
        chunk = None
    owner = find_language_model(inner, patcher.language_model) if patcher.language_model else inner
    modules = tuple(m for m in owner.modules() if type(m).__name__ in patcher.attention_classes)
    if not modules and not patcher.mixers:  # (a record's mixers alone: a model without attention, such as Mamba-2)
        raise UnsupportedModelError(
            f"the {model_type!r} patcher looks for {patcher.attention_classes} but {type(inner).__name__} has none")
    embeddings = None
    if patcher.embeddings_classes:
        embeddings = next((m for m in inner.modules() if type(m).__name__ in patcher.embeddings_classes), None)
        if embeddings is None:
            raise UnsupportedModelError(f"the {model_type!r} patcher found no {patcher.embeddings_classes} module")
    return Plan(patcher, head, chunk, transform, group, tp_ranks, owner, modules, embeddings)


def _loss_chunk(inner: PreTrainedModel, head: str, setting):
    """(the loss chunk setting to keep, the model's logit transform): the chunked loss applies the transform, so a
    model whose transform hfcp cannot read computes its logits (chunk None)."""
    chunk = setting if head == "causal_lm" else None
    if head != "causal_lm" and isinstance(setting, int):
        log.info("hfcp: loss_chunk=%d applies to a causal LM's loss over its vocabulary; %s (head %s) has no such "
                 "loss: its logits are computed as usual", setting, type(inner).__name__, head)
    transform = logit_transform(inner) if chunk is not None else None
    if chunk is not None and transform is None:
        log.info("hfcp: %s changes its logits after the output head in a way hfcp does not read; its loss is "
                 "computed from those logits (loss_chunk=None)", type(inner).__name__)
        chunk = None
    return chunk, transform


def tensor_parallel_unverified(patcher: Patcher) -> str | None:
    """What keeps hfcp from running the family's model tensor-parallel ("recurrent or convolution layers", "a
    vision-language model", "a vision model": its TP x CP is verified for causal LMs whose sequence mixers are all
    attention), or None."""
    if patcher.mixers:
        return "recurrent or convolution layers"
    if patcher.language_model:
        return "a vision-language model"
    return "a vision model" if patcher.embeddings_classes else None


def _check_tensor_parallel(inner, patcher: Patcher, tp_ranks, mesh_tp) -> None:
    if mesh_tp is not None and mesh_tp != tp_ranks:  # TP that hfcp cannot read (torch's parallelize_module), or another
        raise ValueError(f"device_mesh has a 'tp' dimension over ranks {mesh_tp}, but {type(inner).__name__}'s "
                         f"tensor-parallel group is {tp_ranks or 'none (transformers records no tp_size)'}: hfcp reads "
                         "TP from transformers (tp_plan / DistributedConfig); load the model with it over that mesh")
    what = tensor_parallel_unverified(patcher)
    if tp_ranks is not None and what is not None:
        what = f"it has {what}" if patcher.mixers else what
        raise ValueError(f"{type(inner).__name__} ({what}) is loaded tensor-parallel (tp_size={len(tp_ranks)}): "
                         "hfcp's TP x CP is verified for causal LMs whose sequence mixers are all attention; load it "
                         "without tp_plan / DistributedConfig")


def router_aux_for(inner: PreTrainedModel, plan: Plan):
    """How hfcp computes the model's router aux loss: a RouterAux, None (the model has none), or why it cannot."""
    if plan.head != "causal_lm":
        return None
    aux = router_aux_loss(inner)
    if aux is None:
        return None
    if not isinstance(aux, str) and inner.base_model is inner:  # (a VLM's: its multimodal base model's output)
        return f"{type(inner).__name__} has no base model whose router logits hfcp can take"
    return aux


def attention_group(inner: PreTrainedModel, plan: Plan, mesh, settings):
    """What the strategy communicates over: the CP group, or usp's sub-groups (every rank builds every sub-group,
    a collective, after the checks that can raise).

    Raises:
        ValueError: head counts the strategy cannot split over the group, ulysses_size without usp.
    """
    strategy, u = settings.strategy, None
    if plan.modules and strategy in ("ulysses", "usp"):  # (a model without attention, such as Mamba, has no heads)
        heads, kv_heads = _head_counts(inner, plan.patcher, plan.tp_ranks)
        try:
            if strategy == "ulysses":
                check_heads(heads, kv_heads, mesh.cp_size)
            u = check_ulysses_size(settings.ulysses_size, mesh.cp_size, heads, kv_heads) if strategy == "usp" else None
        except ValueError as e:
            if plan.tp_ranks is None:
                raise
            raise ValueError(f"{e} (the head counts of one tensor-parallel rank: the model's over "
                             f"tp={len(plan.tp_ranks)})") from None
    if u is not None:
        return build_usp_groups(mesh.cp_groups, u, settings.timeout)
    if settings.ulysses_size is not None and strategy != "usp":
        raise ValueError(f"ulysses_size={settings.ulysses_size!r} applies to strategy='usp' only "
                         f"(strategy={strategy!r})")
    return mesh.cp_group
