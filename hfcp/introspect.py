"""What hfcp reads from a model instead of retyping it per family (DESIGN.md "Families").

- which modules compute attention through transformers' AttentionInterface (their forward looks the function
  up in ALL_ATTENTION_FUNCTIONS, so setting the model's attn_implementation to hfcp's key reroutes them);
- whether every decoder layer mixes tokens through such an attention module and nothing else (an SSM,
  convolution or recurrent mixer would run on a rank's shard alone);
- whether the causal LM post-processes its logits after the output head (scale, softcap): the chunked loss
  intercepts the head, so such a model computes its loss from the model's own logits instead.

Source inspection decides only what is safe: anything it cannot read is treated as unsupported or
post-processed, and the runtime checks (every patched module must call hfcp's attention each step; attention
arguments hfcp does not implement are refused) catch what it misses.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap

import torch

# class-name fragments of sequence mixers other than attention (state-space, convolution, recurrence, linear attention)
_OTHER_MIXERS = re.compile(r"Mamba|SSM|Mixer|ShortConv|DeltaNet|LinearAttention|Recurrent|RGLRU|"
                           r"Retention|Rwkv|TimeMix|Hyena|Lightning")


@functools.lru_cache(maxsize=None)
def _source(cls) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def uses_attention_interface(module: torch.nn.Module) -> bool:
    """Whether the module's forward gets its attention function from transformers' AttentionInterface."""
    src = _source(type(module))
    return src is not None and "ALL_ATTENTION_FUNCTIONS" in src


def interface_attention_classes(model: torch.nn.Module) -> tuple[str, ...]:
    """Class names of the modules of `model` that compute attention through the AttentionInterface."""
    return tuple(sorted({type(m).__name__ for m in model.modules() if uses_attention_interface(m)}))


def decoder_layers(model, num_layers: int) -> list[torch.nn.Module] | None:
    """The first ModuleList of `num_layers` modules (the decoder layers), or None."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    return list(lists[0]) if lists else None


def other_mixers(model, attention_classes: tuple[str, ...]) -> str | None:
    """Why `model` cannot be made exact by rerouting attention alone, or None.

    Every decoder layer must hold an attention module of `attention_classes`, and no module outside them may be
    a sequence mixer of another kind.
    """
    cfg = model.config.get_text_config()
    n = getattr(cfg, "num_hidden_layers", None)
    layers = decoder_layers(model, n) if isinstance(n, int) and n > 0 else None
    if layers is None:
        return f"hfcp found no list of {n} decoder layers in {type(model).__name__}"
    for i, layer in enumerate(layers):
        if not any(type(m).__name__ in attention_classes for m in layer.modules()):
            kinds = sorted({type(c).__name__ for c in layer.children()})
            return (f"decoder layer {i} ({type(layer).__name__}: {', '.join(kinds)}) mixes tokens without attention "
                    "through transformers' AttentionInterface, so under CP it would see only its rank's shard")
    for name, m in model.named_modules():
        if "position_ids_from_input_ids" in (_source(type(m)) or ""):
            return (f"{name or 'the model'} ({type(m).__name__}) computes position ids from input_ids (RoBERTa-style, "
                    "offset by the padding index), which hfcp does not reproduce")
        if type(m).__name__ in attention_classes:
            continue
        if _OTHER_MIXERS.search(type(m).__name__) and not _inside_attention(model, name, attention_classes):
            return (f"{name} ({type(m).__name__}) is a sequence mixer other than attention; under CP it would see "
                    "only its rank's shard")
    return None


def unsupported_config(cfg) -> str | None:
    """Config features hfcp does not implement yet (read from the config, whatever the family), or None."""
    if getattr(cfg, "attention_chunk_size", None):
        return (f"chunked attention (attention_chunk_size={cfg.attention_chunk_size}) lives only in the attention "
                "mask, which hfcp builds from global indices and does not implement yet")
    if getattr(cfg, "output_router_logits", False):
        return ("the MoE router auxiliary loss (output_router_logits=True) would be taken over a rank's tokens only; "
                "set config.output_router_logits=False (hfcp does not compute it from whole-sequence statistics yet)")
    return None


def _inside_attention(model, name: str, attention_classes) -> bool:
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if type(model.get_submodule(".".join(parts[:k]))).__name__ in attention_classes:
            return True
    return False


def logits_postprocessed(model) -> bool:
    """Whether the causal LM's forward changes its logits after the output head (or cannot be read): then the
    chunked loss, which replaces the head's output, would skip that change.

    Read from the forward's syntax tree: `logits` must be assigned exactly once, from a bare call of the head.
    """
    src = _source(type(model))
    head = model.get_output_embeddings()
    name = next((n for n, c in model.named_children() if c is head), None)
    if src is None or name is None:
        return True
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return True
    head_calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                  and n.func.attr == name and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    writes = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
              and any(isinstance(t, ast.Name) and t.id == "logits" for t in _targets(n))]
    return not (len(head_calls) == 1 and len(writes) == 1 and isinstance(writes[0], ast.Assign)
                and writes[0].value is head_calls[0])


def _targets(node) -> list:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for t in targets:
        out += list(t.elts) if isinstance(t, ast.Tuple) else [t]
    return out
