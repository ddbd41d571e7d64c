"""RoPE whose frequencies depend on the largest position seen (transformers' `dynamic_rope_update`: the "dynamic"
NTK types and "longrope").

Such a rotary module picks its frequencies from torch.max(position_ids) + 1 of the call: longrope switches from
its short to its long factors beyond `original_max_position_embeddings`, dynamic NTK rescales its base for the
length (and keeps the longest length it has seen). Under CP each rank passes only its shard's positions, so ranks
could pick other frequencies than one device over the whole sequence. hfcp wraps each such module for the time it
is patched: every call first updates the module's frequencies with the whole sequence's largest position (one
position, the result discarded), exactly as the single-device call would, then computes the local cos / sin with
the update switched off, so the local maximum never decides.
"""
from __future__ import annotations

import functools

import torch

from ..compiler import eager

_DYNAMIC = ("dynamic", "longrope")


def _is_dynamic(rope_type) -> bool:
    types = rope_type.values() if isinstance(rope_type, dict) else (rope_type,)
    return any(isinstance(t, str) and any(d in t for d in _DYNAMIC) for t in types)


def dynamic_rope_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The rotary modules of `model` whose frequencies depend on the largest position of each call."""
    return [m for m in model.modules() if _is_dynamic(getattr(m, "rope_type", None))
            and hasattr(type(m).forward, "__wrapped__")]  # decorated by transformers' dynamic_rope_update


def _neutral(rope_type):
    return {k: "default" for k in rope_type} if isinstance(rope_type, dict) else "default"


def attach(modules: list[torch.nn.Module], state) -> list:
    """Wrap each module's forward (instance attribute) so that the whole sequence's largest position
    (state.step.max_position) decides its frequencies. Returns [(module, its own instance forward or None)] for
    `detach`."""
    restores = []
    for module in modules:
        original = module.forward  # the bound, decorated forward (or a hook's instance forward)
        own = module.__dict__.get("forward")

        @eager  # (a compiled model breaks its graph here: the step's largest position decides)
        @functools.wraps(original)
        def forward(x, position_ids, *args, _original=original, _module=module, **kwargs):
            if state.fwd.decoding:  # a decode step's positions are whole on every rank: the module's own update
                return _original(x, position_ids, *args, **kwargs)
            step = state.step
            if step is None or step.max_position is None:
                raise RuntimeError(f"{type(_module).__name__} (rope_type={_module.rope_type!r}) ran outside a forward "
                                   "of the patched model; its frequencies depend on the whole sequence")
            with torch.no_grad():  # the update only: one position, its cos / sin discarded
                largest = step.max_position.to(position_ids.device).reshape((1,) * position_ids.dim())
                _original(x, largest, *args, **kwargs)  # (1, 1), or (1, 1, 1) for mRoPE's (3, B, L) positions
            saved = _module.rope_type
            _module.rope_type = _neutral(saved)  # the decorator skips its update for a non-dynamic type
            try:
                return _original(x, position_ids, *args, **kwargs)
            finally:
                _module.rope_type = saved

        module.forward = forward
        restores.append((module, own))
    return restores


def detach(restores: list) -> None:
    """Undo `attach`: each module's forward as it was."""
    for module, own in restores:
        if own is not None:
            module.forward = own
        elif "forward" in module.__dict__:
            del module.forward
