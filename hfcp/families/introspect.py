"""What hfcp reads from a model instead of retyping it per family (docs/reference/family-records.md).

- which modules compute attention through transformers' AttentionInterface (their forward looks the function
  up in ALL_ATTENTION_FUNCTIONS, so setting the model's attn_implementation to hfcp's key reroutes them);
- whether every decoder layer mixes tokens through such an attention module and nothing else (an SSM,
  convolution or recurrent mixer would run on a rank's shard alone), and whether any convolution over tokens sits
  outside the mixers a record makes exact (even inside an attention module);
- (what a causal LM's forward does to its logits and router loss: forward_reading.py).

Source inspection decides only what is safe: anything it cannot read is treated as unsupported or
post-processed, and the runtime checks (every patched module must call hfcp's attention each step; attention
arguments hfcp does not implement are refused) catch what it misses.
"""
from __future__ import annotations

import functools
import inspect
import re

import torch


# class-name fragments of sequence mixers other than attention (state-space, convolution, recurrence, linear attention)
_OTHER_MIXERS = re.compile(r"Mamba|SSM|Mixer|ShortConv|DeltaNet|LinearAttention|Recurrent|RGLRU|"
                           r"Retention|Rwkv|TimeMix|Hyena|Lightning")
_PER_TOKEN = re.compile(r"Norm$")  # such names of those families are per-token norms (Mamba2RMSNorm)


@functools.lru_cache(maxsize=None)
def _source(cls) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def forward_source(module: torch.nn.Module) -> str | None:
    """The source of the module's class forward, or None where it cannot be read."""
    return _source(type(module))


def audio_config(config):
    """The config of a model's audio encoder (audio_config, or encoder_config beside a text_config), or None."""
    audio = getattr(config, "audio_config", None)
    if audio is None and getattr(config, "text_config", None) is not None:
        audio = getattr(config, "encoder_config", None)
    return audio


def uses_attention_interface(module: torch.nn.Module) -> bool:
    """Whether the module's forward gets its attention function from transformers' AttentionInterface."""
    src = _source(type(module))
    return src is not None and "ALL_ATTENTION_FUNCTIONS" in src


def interface_attention_classes(model: torch.nn.Module) -> tuple[str, ...]:
    """Class names of the modules of `model` that compute attention through the AttentionInterface."""
    return tuple(sorted({type(m).__name__ for m in model.modules() if uses_attention_interface(m)}))


def not_through_interface(model, attention_classes: tuple[str, ...]) -> str | None:
    """Why the modules of `attention_classes` cannot be rerouted to hfcp's attention, or None: each named class must
    exist in the model and compute attention through transformers' AttentionInterface (a module that computes
    attention itself would attend within its rank's shard only)."""
    found = {type(m).__name__: m for m in model.modules() if type(m).__name__ in attention_classes}
    missing = [c for c in attention_classes if c not in found]
    if missing:
        return f"its record names attention classes {missing} that {type(model).__name__} does not have"
    own = [c for c, m in found.items() if not uses_attention_interface(m)]
    if not own:
        return None
    inside = sorted({type(c).__name__ for c in found[own[0]].modules() if uses_attention_interface(c)})
    hint = f" ({', '.join(inside)}, inside it, does: name that class)" if inside else ""
    return (f"{', '.join(own)} does not compute attention through transformers' AttentionInterface{hint}, so hfcp "
            "cannot reroute it")


def decoder_layers(model, num_layers: int) -> list[torch.nn.Module] | None:
    """The first ModuleList of `num_layers` modules (the decoder layers), or None."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    return list(lists[0]) if lists else None


def other_mixers(model, attention_classes: tuple[str, ...], handled: tuple[str, ...] = (),
                 token_wise: tuple[str, ...] = ()) -> str | None:
    """Why `model` cannot be made exact by rerouting attention alone, or None.

    Every decoder layer must hold an attention module of `attention_classes` or a mixer of `handled` (classes its
    record makes exact), or have only children of `token_wise` classes (its record knows they compute each token
    alone) and norms; no module outside them may be a sequence mixer of another kind.
    """
    cfg = model.config.get_text_config()
    n = getattr(cfg, "num_hidden_layers", None)
    layers = decoder_layers(model, n) if isinstance(n, int) and n > 0 else None
    if layers is None:
        return f"hfcp found no list of {n} decoder layers in {type(model).__name__}"
    for i, layer in enumerate(layers):
        children = [type(c).__name__ for c in layer.children()]
        if any(c in token_wise for c in children) and all(c in token_wise or _PER_TOKEN.search(c) for c in children):
            continue  # Nemotron-H's MLP and MoE layers
        if not any(type(m).__name__ in attention_classes + handled for m in layer.modules()):
            kinds = sorted({type(c).__name__ for c in layer.children()})
            return (f"decoder layer {i} ({type(layer).__name__}: {', '.join(kinds)}) mixes tokens without attention "
                    "through transformers' AttentionInterface, so under CP it would see only its rank's shard")
    ids = {id(layer) for layer in layers}
    known = attention_classes + handled
    # the layers and the modules above them, and the modules above a known mixer (Zamba's mamba_decoder, a decoder
    # layer of its own inside the hybrid layer): their token mixing is that of the modules checked here
    holders = {name[:i] for name, m in model.named_modules() if id(m) in ids or type(m).__name__ in known
               for i in [0, len(name)] + [j for j, c in enumerate(name) if c == "."]}
    for name, m in model.named_modules():
        if "position_ids_from_input_ids" in (_source(type(m)) or ""):
            return (f"{name or 'the model'} ({type(m).__name__}) computes position ids from input_ids (RoBERTa-style, "
                    "offset by the padding index), which hfcp does not reproduce")
        if type(m).__name__ in known + token_wise or name in holders:
            continue  # the layers are checked above, whatever their names or their models' say (Mamba2ForCausalLM)
        if (_OTHER_MIXERS.search(type(m).__name__) and not _PER_TOKEN.search(type(m).__name__)
                and not _inside_attention(model, name, known)):
            return (f"{name} ({type(m).__name__}) is a sequence mixer other than attention; under CP it would see "
                    "only its rank's shard")
    return None


def token_convolution(model, exempt: tuple[str, ...] = ()) -> str | None:
    """Why `model` mixes tokens through a convolution that would see only its rank's shard, or None.

    A convolution whose kernel spans more than one position (nn.Conv1d/2d/3d, kernel_size > 1 along any axis) mixes
    neighbouring tokens wherever it sits, even inside an attention module (a convolution over the projected queries
    and keys), and no attention function sees it. Refused unless it lies inside a module of `exempt`: a mixer its
    record makes exact (Mamba's causal convolution with its halo) or the embeddings of a token model, which run on the
    whole input before hfcp shards their output (a vision patch embedding).
    """
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.modules.conv._ConvNd) or all(k == 1 for k in m.kernel_size):
            continue
        # the classes of the modules that hold it, outermost first (the model itself first)
        owners = [type(model.get_submodule(".".join(name.split(".")[:k]))).__name__ for k in range(name.count(".") + 1)]
        if any(o in exempt for o in owners + [type(m).__name__]):
            continue
        inside = f" inside {owners[-1]}" if len(owners) > 1 else ""
        return (f"{name} ({type(m).__name__}, kernel_size={tuple(m.kernel_size)}){inside} convolves over neighbouring "
                "tokens outside transformers' AttentionInterface, so under CP it would see only its rank's shard (and "
                "miss the tokens before it on the previous rank)")
    return None


def _inside_attention(model, name: str, attention_classes) -> bool:
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if type(model.get_submodule(".".join(parts[:k]))).__name__ in attention_classes:
            return True
    return False


def find_language_model(model, path: str) -> torch.nn.Module | None:
    """The language model a VLM feeds with the merged sequence: the module at `path` (its record's
    Patcher.language_model), if it is there and its config is the VLM's text config; else None."""
    try:
        lm = model.get_submodule(path)
    except AttributeError:
        return None
    return lm if getattr(lm, "config", None) is model.config.get_text_config() else None


def module_with_config(model, config) -> str | None:
    """The path of the outermost submodule whose `.config` is `config` (the language model of a VLM for its text
    config, the vision tower for its vision config), or None when there is none or two at the same depth."""
    if config is None:
        return None
    found = [name for name, m in model.named_modules() if name and getattr(m, "config", None) is config]
    depth = min((n.count(".") for n in found), default=None)
    outer = [n for n in found if n.count(".") == depth]
    return outer[0] if len(outer) == 1 else None


@functools.lru_cache(maxsize=256)
def _parameters(function, bound: bool) -> dict:
    items = list(inspect.signature(function).parameters.items())
    return dict(items[1:] if bound else items)  # a bound method's function: without its self


def forward_parameters(module) -> dict:
    """{name: inspect.Parameter} of the module's own forward (the one accelerate's hook wraps), read once per
    function."""
    forward = module._old_forward
    function = getattr(forward, "__func__", None)
    return _parameters(forward, False) if function is None else _parameters(function, True)
