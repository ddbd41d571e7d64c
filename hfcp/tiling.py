"""hfcp.patch(tiled_mlp=...): each decoder layer's MLP computed over tiles of the sequence in training forwards, each
tile checkpointed (recomputed in backward, one tile at a time), so the MLP's intermediates (tokens x intermediate
size x a few tensors, the largest activations of a layer at long lengths) exist for one tile, never for the whole
local sequence.

Exact because the MLP computes each token alone: the same arithmetic on each token, in tiles or whole. hfcp tiles
only MLPs it can show are so (`check_per_token`): a module whose children are linear layers (PEFT-wrapped or not)
and activations, whose forward reads no other dimension than the features, and whose output for some tokens does
not change with the others (a small probe). Anything else is refused by name.
"""
from __future__ import annotations

import ast
import functools
import re
import textwrap

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .families.introspect import decoder_layers, forward_source
from .families.registry import UnsupportedModelError

MLP_NAMES = ("mlp", "feed_forward", "ffn")  # a decoder layer's per-token block, by the names transformers uses
_SEQUENCE_OPS = re.compile(r"dim\s*=\s*(0|1|-2)|\.(sum|mean|cumsum|cumprod|roll|topk|sort|softmax|max|min)\(|conv|"
                           r"router|expert|gather|scatter|index|shape|size\(|view\(|reshape|transpose|permute|cat\(")


def check_tiled_mlp(value) -> None:
    """tiled_mlp: False (off), True (tiles of hidden_size tokens) or a positive number of tokens per tile."""
    if isinstance(value, bool) or (isinstance(value, int) and value > 0):
        return
    raise ValueError(f"tiled_mlp={value!r}: pass False, True (tiles of hidden_size tokens) or a positive int (tokens "
                     "per tile)")


def tile_tokens(value, config) -> int | None:
    """Tokens per tile for tiled_mlp=value (None: off). True: the hidden size, so a tile's intermediates are about
    one MLP weight's size (DeepSpeed ALST's choice)."""
    if value is False:
        return None
    return config.get_text_config().hidden_size if value is True else int(value)


def mlps_to_tile(model) -> list[nn.Module]:
    """Each decoder layer's MLP, checked per-token. Raises UnsupportedModelError naming what cannot be tiled."""
    config = model.config.get_text_config()
    layers = decoder_layers(model, config.num_hidden_layers)
    if not layers:
        raise UnsupportedModelError(f"tiled_mlp: hfcp found no list of {config.num_hidden_layers} decoder layers in "
                                    f"{type(model).__name__}")
    out, seen = [], {}
    for i, layer in enumerate(layers):
        mlp = next((getattr(layer, n) for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
        if mlp is None:
            raise UnsupportedModelError(f"tiled_mlp: decoder layer {i} ({type(layer).__name__}) has no MLP named one of "
                                        f"{list(MLP_NAMES)}; pass tiled_mlp=False")
        name = type(mlp).__name__
        if name not in seen:
            seen[name] = check_per_token(mlp)
        if seen[name]:
            raise UnsupportedModelError(f"tiled_mlp: decoder layer {i}'s {name} is not a block hfcp can show computes "
                                        f"each token alone ({seen[name]}); tiling it would not be exact, so it is "
                                        "refused: pass tiled_mlp=False")
        out.append(mlp)
    return out


def check_per_token(mlp: nn.Module) -> str | None:
    """Why `mlp` may not compute each token alone, or None when it does (see the module docstring)."""
    for child in mlp.children():
        base = getattr(child, "base_layer", child)  # (PEFT's LoRA layers wrap the linear)
        if not isinstance(base, nn.Linear) and not _activation(child):
            return f"its child {type(child).__name__} is neither a linear layer nor an activation"
    body = _forward_body(mlp)
    if body is None:
        return "its forward's source cannot be read"
    op = _SEQUENCE_OPS.search(body)
    if op:
        return f"its forward uses {op.group(0)!r}"
    return _probe(mlp)


def _forward_body(module: nn.Module) -> str | None:
    """The statements of the module's forward, without its signature and docstring."""
    source = forward_source(module)
    try:
        func = ast.parse(textwrap.dedent(source)).body[0] if source else None
    except SyntaxError:
        return None
    if not isinstance(func, ast.FunctionDef):
        return None
    body = func.body[1:] if func.body and isinstance(func.body[0], ast.Expr) and \
        isinstance(getattr(func.body[0], "value", None), ast.Constant) else func.body
    return "\n".join(ast.unparse(node) for node in body)


def _activation(module: nn.Module) -> bool:
    return not any(True for _ in module.parameters()) and not any(True for _ in module.children()) and (
        type(module).__module__.startswith(("torch.nn.modules.activation", "transformers.activations")))


def _probe(mlp: nn.Module) -> str | None:
    """The output of 4 tokens, whole and in two halves (skipped where the weights are not materialised here: meta,
    sharded by FSDP2 or partitioned by ZeRO-3; the other checks stand)."""
    weights = list(mlp.parameters())
    if not weights or any(p.is_meta or p.numel() == 0 or hasattr(p, "to_local") for p in weights):
        return None
    first = next(c for c in mlp.modules() if isinstance(c, nn.Linear))
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 4, first.in_features, generator=g).to(weights[0].device, weights[0].dtype)
    training = mlp.training
    mlp.eval()  # (no dropout: the same arithmetic in each call)
    try:
        with torch.no_grad():
            whole = mlp(x)
            halves = torch.cat([mlp(x[:, :2]), mlp(x[:, 2:])], dim=1)
    finally:
        mlp.train(training)
    if not isinstance(whole, torch.Tensor) or whole.shape != halves.shape:
        return "its output is not one tensor per token"
    scale = float(whole.abs().max()) or 1.0
    tol = 1e-4 if whole.dtype == torch.float32 else 2e-2
    if float((whole - halves).abs().max()) > tol * scale:
        return "its output for two tokens changes with the other two"
    return None


def tiled_forward(module: nn.Module, forward, tile: int):
    """`forward` (the module's forward of one hidden-states tensor) run over tiles of `tile` tokens (dim -2), each
    checkpointed, in training forwards longer than one tile; whole otherwise."""

    @functools.wraps(forward)
    def run(hidden_states, *args, **kwargs):
        n = hidden_states.shape[-2] if hidden_states.dim() >= 2 else 0
        if args or kwargs or n <= tile or not torch.is_grad_enabled() or not module.training:
            return forward(hidden_states, *args, **kwargs)
        if any(hasattr(p, "ds_id") or hasattr(p, "to_local") for p in module.parameters()):
            raise ValueError(f"tiled_mlp: {type(module).__name__}'s weights are sharded per module here (DeepSpeed "
                             "ZeRO-3, or FSDP2 on the MLP's own layers): each tile would gather them again, a "
                             "collective whose count differs between ranks of other lengths; shard whole decoder "
                             "layers (fully_shard(layer)), or pass tiled_mlp=False")
        tiles = [checkpoint(forward, part, use_reentrant=False) for part in hidden_states.split(tile, dim=-2)]
        return torch.cat(tiles, dim=-2)

    run.hfcp_tile = tile
    return run


def tile_mlps(mlps: list[nn.Module], tile: int):
    """Bind the tiled forward on each MLP; returns the undo."""
    for mlp in mlps:
        mlp.forward = tiled_forward(mlp, mlp.forward, tile)

    def undo():
        for mlp in mlps:
            if "forward" in mlp.__dict__:
                del mlp.forward
    return undo
