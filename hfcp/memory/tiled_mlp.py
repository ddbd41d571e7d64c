"""hfcp.patch(tiled_mlp=...): each decoder layer's MLP computed over tiles of the sequence in training forwards, each
tile recomputed in backward one at a time (tiled_call), so the MLP's intermediates (tokens x intermediate
size x a few tensors, the largest activations of a layer at long lengths) exist for one tile, never for the whole
local sequence.

Exact because the MLP computes each token alone: the same arithmetic on each token, in tiles or whole. hfcp tiles
only MLPs it can show are so (`check_per_token`): a module whose children are linear layers (PEFT-wrapped or not)
and activations, whose forward reads no other dimension than the features, and whose output for some tokens does
not change with the others (a small probe). Anything else is refused by name.

A mixture-of-experts block is not per-token as a whole (its router may add noise, and the router aux loss reads
every token's logits), but its experts are: transformers' experts modules take (hidden_states, top_k_index,
top_k_weights), one row per token, and compute each row from its own. hfcp tiles the experts' call (and a shared
expert that passes the MLP checks) and leaves the router whole, so the router logits, the aux loss and any noise
are the untiled model's. The experts are shown per-token by a probe: the block run on PROBE_TOKENS tokens, the
arguments its experts got, and the experts on those whole and in uneven parts, in eval and in training mode.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import textwrap

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..families.introspect import decoder_layers, forward_source
from ..families.registry import UnsupportedModelError

MLP_NAMES = ("mlp", "feed_forward", "ffn")  # a decoder layer's per-token block, by the names transformers uses
PROBE_TOKENS, PROBE_SPLIT = 64, [7, 57]  # the probes' tokens, and the uneven parts compared with them whole
# a mixture-of-experts block's experts, called with (hidden_states, top_k_index, top_k_weights)
EXPERTS_NAME = "experts"
_SEQUENCE_OPS = re.compile(r"dim\s*=\s*(0|1|-2)|\.(sum|mean|cumsum|cumprod|roll|topk|sort|softmax|max|min)\(|conv|"
                           r"router|expert|gather|scatter|index|shape|size\(|view\(|reshape|transpose|permute|cat\(")
RANDOM_OPS = re.compile(r"dropout|rand|bernoulli|multinomial|noise|jitter")  # tiles would draw other random numbers


def tile_tokens(value, config) -> int | None:
    """Tokens per tile for tiled_mlp=value (None: off). True: the hidden size, so a tile's intermediates are about
    one MLP weight's size (DeepSpeed ALST's choice)."""
    if value is False:
        return None
    return config.get_text_config().hidden_size if value is True else int(value)


def tile_layers(model) -> list[nn.Module]:
    """The model's decoder layers. Raises UnsupportedModelError where hfcp finds none."""
    config = model.config.get_text_config()
    layers = decoder_layers(model, config.num_hidden_layers)
    if not layers:
        raise UnsupportedModelError(f"tiled_mlp: hfcp found no list of {config.num_hidden_layers} decoder layers in "
                                    f"{type(model).__name__}")
    return layers


def mlps_to_tile(model) -> list[nn.Module]:
    """Each decoder layer's MLP, checked per-token. Raises UnsupportedModelError naming what cannot be tiled."""
    config = model.config.get_text_config()
    layers = tile_layers(model)
    out, seen = [], {}
    for i, layer in enumerate(layers):
        mlp = next((getattr(layer, n) for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
        if mlp is None:
            raise UnsupportedModelError(f"tiled_mlp: decoder layer {i} ({type(layer).__name__}) has no MLP named one "
                                        f"of {list(MLP_NAMES)}; pass tiled_mlp=False")
        name = type(mlp).__name__
        if name not in seen:
            seen[name] = _verdict(mlp, config.hidden_size)
        moe, why = seen[name]
        if why:
            raise UnsupportedModelError(f"tiled_mlp: decoder layer {i}'s {name} is not a block hfcp can show computes "
                                        f"each token alone ({why}); tiling it would not be exact, so it is "
                                        "refused: pass tiled_mlp=False")
        out += [getattr(mlp, EXPERTS_NAME), *_shared_mlps(mlp)] if moe else [mlp]
    return out


def _verdict(mlp: nn.Module, width: int) -> tuple[bool, str | None]:
    """(whether `mlp` is tiled as a mixture of experts, why it cannot be tiled or None); width: its input's."""
    why = check_per_token(mlp)
    if why is None or not isinstance(getattr(mlp, EXPERTS_NAME, None), nn.Module):
        return False, why
    return True, check_experts(mlp, width)


def _shared_mlps(block: nn.Module) -> list[nn.Module]:
    """A mixture-of-experts block's other children that are per-token MLPs (a shared expert), tiled beside the
    experts; the rest (the router, a shared expert's gate) run whole."""
    return [c for n, c in block.named_children() if n != EXPERTS_NAME and any(True for _ in c.children())
            and check_per_token(c) is None]


def check_experts(block: nn.Module, width: int) -> str | None:
    """Why the experts of the mixture-of-experts `block` may not compute each token (row) alone, or None when they
    do: the block run on PROBE_TOKENS tokens in eval mode, the arguments its experts were called with kept, and the
    experts' output on those whole against in two uneven parts (each part's rows with their own indices and
    weights), in eval and in training mode (a capacity that binds with more rows, or only in training, shows)."""
    experts = getattr(block, EXPERTS_NAME)
    random = RANDOM_OPS.search(forward_body(experts) or "")
    if random:
        return f"its {type(experts).__name__}'s forward uses {random.group(0)!r}: tiles would draw other random numbers"
    params = list(inspect.signature(experts.forward).parameters)
    if len(params) != 3:
        return f"its {type(experts).__name__} takes ({', '.join(params)}), not (hidden_states, top_k_index, " \
               "top_k_weights)"
    weights = list(block.parameters())
    if any(p.is_meta or p.numel() == 0 or hasattr(p, "to_local") for p in weights):
        return None  # (not materialised here: the signature check stands, as _probe)
    seen = []
    hook = experts.register_forward_pre_hook(lambda _, args: seen.append(args))
    x = probe_input(width, weights[0])[None]  # (width: the hidden size, the block's input)
    training = block.training
    try:
        with torch.no_grad(), forked_rng(weights[0].device):
            block.eval()
            block(x)
            hook.remove()
            if len(seen) != 1 or len(seen[0]) != 3 or not all(isinstance(a, torch.Tensor) and a.dim() == 2
                                                                and a.shape[0] == PROBE_TOKENS for a in seen[0]):
                return f"its {type(experts).__name__} was not called once with three (tokens, ...) tensors"
            for mode in (False, True):
                experts.train(mode)
                whole = experts(*seen[0])
                parts = torch.cat([experts(*part) for part in _tiles(seen[0], PROBE_SPLIT)])
                why = compare_tiled(whole, parts, f"its {type(experts).__name__}'s output for some tokens changes with "
                                             "the others" + (" in training" if mode else ""))
                if why:
                    return why
    except Exception as e:  # noqa: BLE001 - a block of another form: not one hfcp can show is per-token
        return f"its probe raised {type(e).__name__}: {e}"
    finally:
        hook.remove()
        block.train(training)
    return None


def check_per_token(mlp: nn.Module) -> str | None:
    """Why `mlp` may not compute each token alone, or None when it does (see the module docstring)."""
    for child in mlp.children():
        base = getattr(child, "base_layer", child)  # (PEFT's LoRA layers wrap the linear)
        if not isinstance(base, nn.Linear) and not _activation(child):
            return f"its child {type(child).__name__} is neither a linear layer nor an activation"
    body = forward_body(mlp)
    if body is None:
        return "its forward's source cannot be read"
    op = _SEQUENCE_OPS.search(body) or RANDOM_OPS.search(body)
    if op:
        return f"its forward uses {op.group(0)!r}"
    return _probe(mlp)


def forward_body(module: nn.Module) -> str | None:
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
    """The output of PROBE_TOKENS tokens, whole and in two uneven parts, in eval mode (skipped where the weights are
    not materialised here: meta, sharded by FSDP2 or partitioned by ZeRO-3; the other checks stand)."""
    weights = list(mlp.parameters())
    if not weights or any(p.is_meta or p.numel() == 0 or hasattr(p, "to_local") for p in weights):
        return None
    x = probe_input(next(c for c in mlp.modules() if isinstance(c, nn.Linear)).in_features, weights[0])[None]
    training = mlp.training
    mlp.eval()  # (its children are linear layers and activations: training differs only by LoRA's dropout)
    try:
        with torch.no_grad():
            whole = mlp(x)
            parts = torch.cat([mlp(part) for part in x.split(PROBE_SPLIT, dim=1)], dim=1)
    finally:
        mlp.train(training)
    return compare_tiled(whole, parts, "its output for some tokens changes with the others")


def probe_input(width: int, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(PROBE_TOKENS, width, generator=g).to(like.device, like.dtype)


def forked_rng(device: torch.device):
    """torch.random.fork_rng over the CPU's random state and `device`'s (an accelerator of any type)."""
    accelerator = device.type not in ("cpu", "meta")  # (meta: the dry run, no random state of its own)
    return torch.random.fork_rng(devices=[device] if accelerator else [],
                                 device_type=device.type if accelerator else "cuda")


def compare_tiled(whole, halves, differs: str) -> str | None:
    if not isinstance(whole, torch.Tensor) or whole.shape != halves.shape:
        return "its output is not one tensor per token"
    scale = float(whole.abs().max()) or 1.0
    tol = 1e-4 if whole.dtype == torch.float32 else 2e-2
    return differs if float((whole - halves).abs().max()) > tol * scale else None


def tiled_call(forward, tile, n_args: int, *inputs) -> torch.Tensor:
    """forward(*args) over tiles of `tile` tokens (dim -2 of every argument; inputs: the args, then the module's
    trainable parameters): in forward without autograd's record, in backward each tile recomputed and
    differentiated alone, so one tile's intermediates exist at a time. `tile` may be a pair (coarse, fine): the fine
    tiles where the first of them draws no random numbers, else the coarse ones, drawn from the same random state (a
    linear layer with LoRA's dropout, in one tile: the masks its untiled call would draw; a recompute must draw what
    its forward drew, so backward takes forward's tiles). Each tile's recompute runs under the forward's autocast
    and from the random state its forward started from (as torch's checkpoint does): a LoRA layer's dropout draws
    the same masks twice.

    The parameters' gradients, summed over the tiles, are returned as the call's, so each parameter's gradient
    arrives once per backward, as without tiles (DDP marks it ready once, DeepSpeed ZeRO-3 reduces it once, FSDP2
    reduce-scatters it once). ZeRO-3 gathers the weights once for the call and once for its backward, by its hooks
    on the tiled module (a ZeRO-3 leaf: tile_mlps). A tile whose graph reaches a trainable tensor that is not one of
    these (a parent's weight, a captured tensor) is refused in backward: its gradient would be lost.

    Two autograd nodes: _Keep saves the arguments (and runs the backward), then _Run computes the tiles and hands
    its output's gradient back to _Keep. So the arguments are saved before anything is computed: under
    non-reentrant checkpointing, whose recompute of a layer stops at the last tensor the layer saved (torch's early
    stop), a tiled MLP that ends its layer is not computed again there, where its output would be thrown away (each
    tile computed twice a step, in forward and in backward, not three times)."""
    call = _Call(forward, inputs[0].device)
    marker = _Keep.apply(call, n_args, *inputs)
    return _Run.apply(call, tile, marker, *inputs[:n_args])


class _Call:
    """One tiled call, shared by its two autograd nodes: the module's forward, the tiles taken, the random state
    each tile starts from, the forward's autocast, and the output's gradient on its way from _Run to _Keep."""

    def __init__(self, forward, device: torch.device):
        self.forward, self.name = forward, getattr(forward, "__qualname__", "the tiled module")
        self.autocast = (device.type, dict(enabled=torch.is_autocast_enabled(device.type),
                                           dtype=torch.get_autocast_dtype(device.type),
                                           cache_enabled=torch.is_autocast_cache_enabled())) \
            if torch.amp.is_autocast_available(device.type) else None  # (meta: the dry run)
        self.device = device if device.type not in ("cpu", "meta") else None  # (an accelerator: its random state too)
        self.tile, self.rng, self.grad = None, [], None


def _autocast(call: _Call):
    return torch.autocast(call.autocast[0], **call.autocast[1]) if call.autocast else contextlib.nullcontext()


class _Keep(torch.autograd.Function):
    """Saves a tiled call's arguments; its backward recomputes and differentiates each tile (see tiled_call). Its
    output is an empty marker, _Run's input: what orders _Run's backward before this one."""

    @staticmethod
    def forward(ctx, call: _Call, n_args: int, *inputs):
        ctx.call, ctx.params = call, inputs[n_args:]  # (the live parameters: what the recompute reads)
        ctx.save_for_backward(*inputs[:n_args])
        return inputs[0].new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _marker):
        call, args, params = ctx.call, ctx.saved_tensors, ctx.params
        grad, call.grad = call.grad, None
        needs = ctx.needs_input_grad[2 : 2 + len(args)]
        arg_grads = [torch.empty_like(a) if need else None for a, need in zip(args, needs)]  # (tiles written in)
        param_grads = [None] * len(params)
        start = 0
        for n, (part, g, state) in enumerate(zip(_tiles(args, call.tile), grad.split(call.tile, dim=-2), call.rng)):
            xs = [x.detach().requires_grad_(need) for x, need in zip(part, needs)]
            with forked_rng(call.device or torch.device("cpu")):
                _set_rng(state, call.device)
                with torch.enable_grad(), _autocast(call):
                    out = call.forward(*xs)
            wrt = [x for x, need in zip(xs, needs) if need] + list(params)
            if n == 0:
                _check_leaves(out, wrt, call.name)
            got = iter(torch.autograd.grad(out, wrt, g, allow_unused=True))
            rows = part[0].shape[-2]
            for into, need in zip(arg_grads, needs):
                if not need:
                    continue
                gx, rows_of_tile = next(got), into.narrow(-2, start, rows)
                if gx is None:
                    rows_of_tile.zero_()
                else:
                    rows_of_tile.copy_(gx)
            for i, pg in enumerate(got):
                if pg is not None:
                    param_grads[i] = pg if param_grads[i] is None else param_grads[i] + pg
            start += rows
        call.rng = None
        return (None, None, *arg_grads, *param_grads)


class _Run(torch.autograd.Function):
    """Computes a tiled call's tiles without autograd's record, noting the tiles and their random states on the
    call; its backward hands the output's gradient to _Keep through the call."""

    @staticmethod
    def forward(ctx, call: _Call, tile, _marker, *args):
        ctx.call = call
        tile, finer = tile if isinstance(tile, tuple) else (tile, tile)  # (see tiled_call's docstring)
        out, start, forward, device = None, 0, call.forward, call.device
        parts, call.tile = _tiles(args, finer), finer
        if finer < tile:  # the finer tiles where their first draws no random numbers, else the coarser
            _note_rng(call.rng, device)
            y = forward(*parts[0])
            if _same_rng(call.rng[0], device):
                out = _into(out, y, args, start)
                start, parts = y.shape[-2], parts[1:]
            else:  # (drawn again from the same state in the coarser tiles: as the untiled layer draws them)
                _set_rng(call.rng.pop(), device)
                parts, call.tile = _tiles(args, tile), tile
        for part in parts:
            _note_rng(call.rng, device)
            y = forward(*part)
            out = _into(out, y, args, start)
            start += y.shape[-2]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        ctx.call.grad = grad
        return (None, None, grad.new_empty(0), *[None] * (len(ctx.needs_input_grad) - 3))


def _rng(device) -> tuple:
    """The random state a tile starts from: the CPU's, and the accelerator's (None on CPU)."""
    return torch.get_rng_state(), _device_rng(device).get_rng_state(device) if device is not None else None


def _note_rng(states: list, device) -> None:
    """Append the random state the next tile starts from; the previous tile's own object where nothing was drawn
    since. (A state is 5 KB, and each call keeps its tiles' until its backward, which under checkpointing is every
    layer's call of the step: a list of copies was 0.7 hidden vectors per token at 32K tokens.)"""
    states.append(states[-1] if states and _same_rng(states[-1], device) else _rng(device))


def _set_rng(state: tuple, device) -> None:
    torch.set_rng_state(state[0])
    if device is not None:
        _device_rng(device).set_rng_state(state[1], device)


def _into(out, y: torch.Tensor, args, start: int) -> torch.Tensor:
    """Tile `y` written into the whole output at row `start` (allocated at the first tile: no list of tiles)."""
    if out is None:
        out = y.new_empty((*y.shape[:-2], args[0].shape[-2], y.shape[-1]))
    out.narrow(-2, start, y.shape[-2]).copy_(y)
    return out


def _same_rng(saved: tuple, device) -> bool:
    """Whether the random state (the CPU's, and the accelerator's) is still `saved`: nothing was drawn since."""
    cpu, accelerator = saved
    return torch.equal(cpu, torch.get_rng_state()) and (
        device is None or torch.equal(accelerator, _device_rng(device).get_rng_state(device)))


def _tiles(args, tile) -> list[tuple]:
    """The arguments' rows (dim -2) in tiles of `tile` (or of the sizes listed), one tuple of arguments a tile."""
    return list(zip(*(a.split(tile, dim=-2) for a in args)))


def _device_rng(device: torch.device):
    """The torch module holding `device`'s random state (torch.cuda, torch.xpu, ...)."""
    return torch.get_device_module(device.type)


def _check_leaves(out: torch.Tensor, wrt: list, name: str) -> None:
    """Raises RuntimeError when the graph of `out` reaches a tensor that takes a gradient and is not in `wrt`."""
    known, seen, stack = {id(t) for t in wrt}, set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # (an AccumulateGrad node: a leaf that takes a gradient)
        if var is not None and id(var) not in known:
            raise RuntimeError(f"tiled_mlp: {name} reads a tensor that takes a gradient but is not one of its "
                               f"parameters or arguments (shape {tuple(var.shape)}); its gradient would be lost "
                               "in tiles: pass tiled_mlp=False")
        stack.extend(f for f, _ in fn.next_functions)


def tiled_forward(module: nn.Module, forward, tile: int):
    """`forward` (the module's forward of tensors with one row per token: an MLP's hidden states, or the experts'
    hidden states, indices and weights) run over tiles of `tile` tokens (dim -2 of every argument) in training
    forwards (train mode) longer than one tile, by tiled_call where autograd records; whole otherwise."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        n = args[0].shape[-2] if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 else 0
        if kwargs or n <= tile or not module.training or \
                not all(isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-2] == n for a in args):
            return forward(*args, **kwargs)
        check_gathered_once(module)
        fold = run.hfcp_norm(module, forward, args) if run.hfcp_norm is not None and torch.is_grad_enabled() else None
        if fold is not None:  # (args: exactly a norm's output: the norm recomputed in each tile, see norm_recompute.py)
            call, x, params = fold
            return tiled_call(call, tile, 1, x, *params)
        if not torch.is_grad_enabled():  # (a training forward without autograd's record, such as reentrant
            # checkpointing's first pass: tile by tile all the same, so that LoRA's dropout draws the masks its
            # recompute under autograd, tiled, draws again)
            return torch.cat([forward(*part) for part in _tiles(args, tile)], dim=-2)
        params = [p for p in module.parameters() if p.requires_grad]
        return tiled_call(forward, tile, len(args), *args, *params)

    run.hfcp_tile, run.hfcp_norm = tile, None  # (hfcp_norm: set by norm_recompute.recompute_norms)
    return run


def check_gathered_once(module: nn.Module) -> None:
    """Raises ValueError where the tiled module's weights would be gathered per tile: weights that FSDP2 shards on
    the module's own sub-layers, or that DeepSpeed ZeRO-3 gathers per sub-layer (the module not a ZeRO-3 leaf, as
    when hfcp.patch ran after deepspeed.initialize). A gather per tile costs a collective each, and ranks holding
    other lengths would make other numbers of them: a hang."""
    own = {id(p) for p in module.parameters(recurse=False)}
    for name, p in module.named_parameters():
        if hasattr(p, "to_local"):
            raise ValueError(f"tiled_mlp: {type(module).__name__}'s weights are sharded by FSDP2 on its own layers "
                             f"({name}): each tile would gather them again; shard whole decoder layers "
                             "(fully_shard(layer)), or pass tiled_mlp=False")
        leaf = getattr(p, "ds_z3_leaf_module", None)
        if hasattr(p, "ds_id") and id(p) not in own and not (leaf is not None and
                                                               any(m is module for m in leaf.modules())):
            raise ValueError(f"tiled_mlp: {type(module).__name__}'s weights are gathered by DeepSpeed ZeRO-3 per "
                             f"sub-layer ({name}): each tile would gather them again. hfcp.patch marks the tiled "
                             "MLPs ZeRO-3 leaves (gathered once per call); call it before deepspeed.initialize (or "
                             "the trainer), or mark them yourself with deepspeed.utils.set_z3_leaf_modules, or pass "
                             "tiled_mlp=False")


def tile_mlps(mlps: list[nn.Module], tile: int):
    """Bind the tiled forward on each MLP, and mark each a DeepSpeed ZeRO-3 leaf (`_z3_leaf`, the attribute
    deepspeed.utils.set_z3_leaf_modules sets; read when ZeRO-3 registers its hooks): ZeRO-3 then gathers an MLP's
    weights once per call and once for its backward, not per sub-layer per tile. Returns the undo."""
    marked = [m for m in mlps if not getattr(m, "_z3_leaf", False)]
    for mlp in mlps:
        mlp.forward = tiled_forward(mlp, mlp.forward, tile)
    for mlp in marked:
        mlp._z3_leaf = True

    def undo():
        for mlp in mlps:
            if "forward" in mlp.__dict__:
                del mlp.forward
        for mlp in marked:
            mlp.__dict__.pop("_z3_leaf", None)
    return undo
