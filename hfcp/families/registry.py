"""Patcher records keyed by config.model_type, filled by `register_patcher(...)` calls at import time."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class UnsupportedModelError(ValueError):
    """The model (or this head of it) cannot be made context-parallel exactly; the message says why."""


@dataclass(frozen=True)
class Patcher:
    """What hfcp needs to know about one model family.

    Attributes:
        model_type: `config.model_type` this record handles.
        attention_classes: class names of the attention modules that call transformers' AttentionInterface.
        causal: whether attention is causal (chooses the zigzag layout).
        num_heads_attr / num_kv_heads_attr: config attributes with the head counts (ulysses checks them).
        embeddings_classes: token-sequence models (vision/video): the module whose output is the token
            sequence (patch/tubelet embedding + position + CLS); hfcp shards its output. Empty: shard input_ids.
        first_token_pooler: the base model's `pooler` reads token 0 (CLS), so hfcp feeds it the global one.
        pooler_output_is_first_token: the base model's `pooler_output` is token 0 of its last_hidden_state,
            taken in forward code (no pooler module); hfcp replaces it with the global token 0.
        unsupported_reason: set for a known model_type that cannot be made exact; lookups raise with it.
        read_from_model: the attention classes are read from the model at patch time (a family the family sweep
            showed exact; see patches/verified.py), and the model is checked for other sequence mixers.
        verified_with: the transformers version the family sweep showed this family exact with, if it did.
        max_seq_len: config -> the longest (padded) sequence hfcp runs exactly, or None (no limit): for a family
            whose code computes a per-position term from the index within the tokens a layer sees (a rank's shard
            under CP), exact only while that term is the same for every index; longer batches are refused.
        max_seq_len_reason: why, and what to do, for that error.
        skip_model_checks: skip the checks every record is held to at patch time (attention classes compute
            attention through transformers' AttentionInterface and are the only sequence mixers; positions are not
            computed from input_ids). For a record whose author has shown it exact otherwise: they take
            responsibility for what the checks would have refused.
        language_model: a vision-language model: the module path of its language model in the outer model
            ("model.language_model"), whose attention classes hfcp runs and whose input, the merged sequence, it
            shards; the outer model encodes images, merges them and computes positions whole on every rank
            (hfcp/hooks/vlm.py); "auto": the outermost module whose config is the text config. Empty: not a VLM.
        vision_tower: a VLM whose tower encodes each image on its own: its module path in the outer model
            ("model.vision_tower"); hfcp splits the images over the CP group (hfcp/hooks/tower_split.py). Empty: every
            rank encodes every image. "auto": the outermost module whose config is the vision config, split when
            its vision model_type is one registered as encoding each image alone (hfcp.hooks.tower_split
            .register_per_image_tower), else run whole on every rank.
        audio_tower: the same for an audio-language or omni model's audio encoder and its clips ("auto": the
            outermost module whose config is the audio config, split when its model_type is registered with
            hfcp.families.towers.register_per_clip_encoder).
        positions_from_mask: without position_ids the family derives them from the attention mask
            (cumsum(mask) * mask - 1, as OPT); hfcp computes them so over the whole mask before splitting.
        token_side_inputs: per-token side inputs of a VLM's language model, as (mask, rows) argument names: `mask`
            a (B, L) bool tensor over the merged sequence, `rows` a tensor, or a list of tensors, whose dim 0 holds
            one row per True entry of the mask in row-major order (Qwen3-VL: visual_pos_masks and
            deepstack_visual_embeds); hfcp gives each rank its tokens' part of both. Any other argument beside the
            merged sequence is refused.
        mixers: sequence mixers other than attention that the record makes exact, as (class name, make_forward):
            `make_forward(state, module, step_of)` checks the module (raising ValueError to refuse it, at patch time)
            and returns the forward hfcp binds to it while patched; `step_of()` gives the step of the current call,
            also when gradient checkpointing recomputes it (hfcp/mixers/binding.py). The model checks accept these
            classes beside the attention classes.
        token_wise_classes: class names of modules that the record knows compute each token alone (Nemotron-H's
            MLP and MoE blocks, RecurrentGemma's MLP): a decoder layer whose children are all of these or norms
            passes the model checks without a mixer (every other layer must hold an attention module or one of
            `mixers`), and the check of module names for other mixers passes them (RecurrentGemmaMlp).
    """

    model_type: str
    attention_classes: tuple[str, ...]
    causal: bool = True
    num_heads_attr: str = "num_attention_heads"
    num_kv_heads_attr: str = "num_key_value_heads"
    embeddings_classes: tuple[str, ...] = ()
    first_token_pooler: bool = False
    pooler_output_is_first_token: bool = False
    unsupported_reason: str | None = None
    read_from_model: bool = False
    verified_with: str | None = None
    max_seq_len: Callable | None = None
    max_seq_len_reason: str = ""
    positions_from_mask: bool = False
    skip_model_checks: bool = False
    language_model: str = ""
    vision_tower: str = ""
    audio_tower: str = ""
    token_side_inputs: tuple[tuple[str, str], ...] = ()
    mixers: tuple[tuple[str, Callable], ...] = ()
    token_wise_classes: tuple[str, ...] = ()


_HOW_TO_REGISTER = (
    "to add a family whose attention uses transformers' AttentionInterface, call "
    "hfcp.register_patcher(hfcp.Patcher(model_type=..., attention_classes=(...,)))"
)


class _Registry:
    def __init__(self):
        self._patchers: dict[str, Patcher] = {}

    def register(self, patcher: Patcher, *, replace: bool = False) -> None:
        if not isinstance(patcher, Patcher):
            raise TypeError(f"register_patcher expects a hfcp.Patcher, got {type(patcher).__name__}")
        if patcher.model_type in self._patchers and not replace:
            raise ValueError(
                f"a patcher for model_type={patcher.model_type!r} is already registered; "
                "pass replace=True to override it"
            )
        self._patchers[patcher.model_type] = patcher

    def get(self, model_type: str) -> Patcher | None:
        return self._patchers.get(model_type)

    def lookup(self, model_type: str) -> Patcher:
        patcher = self._patchers.get(model_type)
        if patcher is not None and patcher.unsupported_reason:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported by hfcp: {patcher.unsupported_reason}; "
                f"supported types: {self.model_types()}"
            )
        if patcher is None:
            raise UnsupportedModelError(
                f"hfcp has no patcher for model_type={model_type!r}; supported types: "
                f"{sorted(self._patchers)}; {_HOW_TO_REGISTER}"
            )
        return patcher

    def model_types(self) -> list[str]:
        return sorted(t for t, p in self._patchers.items() if not p.unsupported_reason)


REGISTRY = _Registry()


def register_patcher(patcher: Patcher, *, replace: bool = False) -> None:
    """Register `patcher` for its model_type.

    Raises:
        ValueError: a patcher for that model_type exists and replace is False.
    """
    REGISTRY.register(patcher, replace=replace)


def supported_model_types() -> list[str]:
    """The model_types with a registered patcher, sorted."""
    return REGISTRY.model_types()
