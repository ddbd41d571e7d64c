"""tiled_mlp's norms: a decoder layer's norm output is never kept for backward where a linear layer or the tiled MLP
reads it; the norm is recomputed from its input, which the layer keeps anyway.

Without this, each decoder layer keeps about seven hidden-size tensors per token for backward (Llama, LoRA, MLP
tiled): its input, the input norm's output (read by the q/k/v projections), q, k and v, attention's output, the
residual after attention, and the MLP norm's output (read by the tiled MLP). Two of them are norm outputs, which a
recompute of the norm gives back from the norm's input (one hidden-size row per token, cheap against a projection).

How, with no per-family code: each norm of a decoder layer (a child whose class name holds "Norm") notes the
(input, output) of its last training call; a linear layer of the layer's mixer (q_proj, ...) or its tiled MLP called
with exactly that output tensor, unchanged since (the same version counters), computes consumer(norm(input))
instead, through tiled_call: the MLP over tiles (the norm in each tile, so the norm must compute each token alone: a
probe, as for the MLP), a linear layer as one tile (its backward replays its forward: no per-token property is
needed). Nobody then saves the norm's output, and it is freed when the layer's code lets it go. A consumer called
with anything else (a view, another tensor) runs as before.
"""
from __future__ import annotations

import contextvars
import functools
import weakref

import torch
from torch import nn

from ..compiler import compiling
from .tiled_mlp import PROBE_SPLIT, RANDOM_OPS, compare_tiled, forward_body, probe_input, tiled_call

_REPLAYING = contextvars.ContextVar("hfcp_norm_replaying", default=False)  # (a consumer's own call of the norm)


def norms_of(layer: nn.Module) -> list[nn.Module]:
    """The decoder layer's norms: children whose class name holds "Norm", with no children of their own."""
    return [c for c in layer.children() if "Norm" in type(c).__name__ and not any(True for _ in c.children())]


def linears_of(layer: nn.Module, skip: list[nn.Module]) -> list[nn.Module]:
    """The linear layers (PEFT-wrapped or not) that are children of the layer's children, but those in `skip`
    (the MLPs, tiled on their own): q_proj, k_proj, v_proj, o_proj and the like."""
    out = []
    for child in layer.children():
        if any(child is s for s in skip):
            continue
        out += [g for g in child.children() if isinstance(getattr(g, "base_layer", g), nn.Linear)]
    return out


def check_norm(norm: nn.Module, width: int) -> str | None:
    """Why `norm` may not compute each token alone, or None when it does: no random numbers in its forward, and
    the output of PROBE_TOKENS tokens whole against two uneven parts (eval mode; skipped where its weights are not
    materialised here)."""
    body = forward_body(norm)
    if body is None:
        return "its forward's source cannot be read"
    random = RANDOM_OPS.search(body)
    if random:
        return f"its forward uses {random.group(0)!r}"
    weights = list(norm.parameters())
    if any(p.is_meta or p.numel() == 0 or hasattr(p, "to_local") for p in weights):
        return None
    like = weights[0] if weights else torch.empty(0)
    x = probe_input(width, like)[None]
    training = norm.training
    norm.eval()
    try:
        with torch.no_grad():
            whole = norm(x)
            parts = torch.cat([norm(part) for part in x.split(PROBE_SPLIT, dim=1)], dim=1)
    except Exception as e:  # noqa: BLE001 - a norm of another form: not folded
        return f"its probe raised {type(e).__name__}: {e}"
    finally:
        norm.train(training)
    return compare_tiled(whole, parts, "its output for some tokens changes with the others")


def _tapped(norm: nn.Module, forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        if _REPLAYING.get():
            return out
        x = args[0] if len(args) == 1 and not kwargs else None
        keep = isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and norm.training and \
            torch.is_grad_enabled() and not compiling()
        norm.__dict__["_hfcp_tap"] = (weakref.ref(x), x._version, weakref.ref(out), out._version) if keep else None
        return out
    return run


def source(norms: list[nn.Module], args: tuple, kwargs: dict):
    """(norm, its input) where `args` is exactly one of `norms`' last outputs, unchanged since; else None."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        return None
    y = args[0]
    for norm in norms:
        tap = norm.__dict__.get("_hfcp_tap")
        if tap is None:
            continue
        x_ref, x_version, y_ref, y_version = tap
        x = x_ref()
        if y_ref() is y and y._version == y_version and x is not None and x._version == x_version:
            return norm, x
    return None


def through(norm: nn.Module, forward):
    """forward(norm(x)), the norm called as a module (its hooks run: ZeRO-3 gathers its weights) without noting."""

    def run(x, *rest):
        token = _REPLAYING.set(True)
        try:
            y = norm(x)
        finally:
            _REPLAYING.reset(token)
        return forward(y, *rest)

    run.__qualname__ = f"{type(norm).__name__} then {getattr(forward, '__qualname__', 'its consumer')}"
    return run


def trainable(*modules: nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _folding(norms: list[nn.Module]):
    """A tiled MLP's hfcp_norm: (norm then the MLP, the norm's input, their trainable weights) where the MLP's
    argument is one of `norms`' outputs, else None."""

    def fold(module: nn.Module, forward, args: tuple):
        found = source(norms, args, {})
        if found is None:
            return None
        norm, x = found
        return through(norm, forward), x, trainable(module, norm)
    return fold


def _recomputed(linear: nn.Module, forward, norms: list[nn.Module], tile: int):
    """The linear layer's forward in training: given a norm's output, linear(norm(input)) by tiled_call; given
    anything else, a PEFT-wrapped linear (o_proj with LoRA: its adapter's output, scaled, and their sum are each a
    whole hidden-size tensor) by tiled_call too. In tiles of `tile` tokens where they draw no random numbers, else
    in one (LoRA's dropout: the masks the untiled layer draws); the norm, the adapter and their backward then
    exist for a tile at a time. Not where ZeRO-3 or FSDP2 gather the adapter's weights on its own sub-layers (a
    gather per tile)."""
    adapter = hasattr(linear, "base_layer")

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not (linear.training and torch.is_grad_enabled()) or compiling():
            return forward(*args, **kwargs)
        found = source(norms, args, kwargs)
        if found is not None:
            norm, x = found
            call, params = through(norm, forward), trainable(linear, norm)
        elif adapter and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and \
                args[0].dim() >= 2 and not _gathered_per_layer(linear):
            call, x, params = forward, args[0], trainable(linear)
        else:
            return forward(*args, **kwargs)
        whole = max(x.shape[-2], 1)
        return tiled_call(call, (whole, min(tile, whole)), 1, x, *params)
    return run


def _gathered_per_layer(module: nn.Module) -> bool:
    """Whether ZeRO-3 (ds_id) or FSDP2 (a DTensor) holds some of the module's weights partitioned here."""
    return any(hasattr(p, "ds_id") or hasattr(p, "to_local") for p in module.parameters())


def recompute_norms(layers: list[nn.Module], mlps: list[nn.Module], width: int, tile: int):
    """Tap each decoder layer's norms that compute each token alone, recompute them in the linear layers of the
    layer's mixers and in its tiled MLPs (those of `mlps`, whose forward tiled_forward bound); tile: tiled_mlp's
    tokens a tile. Returns the undo."""
    verdicts, bound = {}, []  # (module, the forward its __dict__ held before: an accelerate hook's, or None)
    for layer in layers:
        norms = []
        for norm in norms_of(layer):
            name = type(norm).__name__
            if name not in verdicts:
                weight = getattr(norm, "weight", None)
                verdicts[name] = check_norm(norm, weight.shape[0] if isinstance(weight, torch.Tensor) and
                                            weight.dim() == 1 and weight.numel() else width)
            if verdicts[name] is None:
                norms.append(norm)
        if not norms:
            continue
        own = [m for m in mlps if any(m is c for c in layer.modules())]
        for module, wrap in [(n, _tapped) for n in norms] + [(m, _recomputed) for m in linears_of(layer, own)]:
            bound.append((module, module.__dict__.get("forward")))
            module.forward = wrap(module, module.forward, norms, tile) if wrap is _recomputed else \
                wrap(module, module.forward)
        for mlp in own:
            if hasattr(mlp.forward, "hfcp_norm"):
                mlp.forward.hfcp_norm = _folding(norms)

    def undo():
        for module, before in reversed(bound):
            module.__dict__.pop("_hfcp_tap", None)
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before
        for mlp in mlps:
            if hasattr(mlp.__dict__.get("forward"), "hfcp_norm"):
                mlp.forward.hfcp_norm = None
    return undo
