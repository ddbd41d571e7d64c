"""Sequence mixers other than attention that a record makes exact (Patcher.mixers): hfcp binds the record's forward
to each such module while patched.

Attention calls get their step from the mask argument (step_token.py), so a layer recomputed by gradient
checkpointing after a later forward still sees its own step. A mixer gets no such argument and reads the step of
the latest forward (state.step). transformers checkpoints a layer's forward inside its module hooks, so a recompute
cannot be told apart from the inside; instead a forward pre-hook on each decoder layer that holds a mixer refuses a
forward while the graph of a forward with another step is still alive under gradient checkpointing (its mixers would
be recomputed with this step's layout), as the vision hooks do.
"""
from __future__ import annotations

import hashlib
import inspect
import types
import weakref

import torch

from .introspect import decoder_layers


class LayerSteps:
    """A forward pre-hook on each decoder layer holding a mixer, and the step mixers read."""

    def __init__(self, state):
        self.state = state
        self._last: dict[int, tuple] = {}  # id(layer) -> (weakref to its previous input, that forward's step)

    def __call__(self, layer, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or not torch.is_grad_enabled():
            return
        previous = self._last.get(id(layer))
        alive = previous[0]() if previous is not None else None
        if (alive is not None and alive.requires_grad and previous[1] is not self.state.step
                and getattr(layer, "gradient_checkpointing", False)):
            raise ValueError(
                f"hfcp: a forward while the graph of the previous one is still alive under gradient checkpointing: "
                f"its {type(layer).__name__} mixers would be recomputed in backward with this forward's layout. Run "
                "backward (or drop the previous outputs) before the next forward, or disable gradient checkpointing")
        self._last[id(layer)] = (weakref.ref(x), self.state.step)

    def current(self):
        """The step a mixer's call belongs to: the latest forward's (the pre-hook refused any other case)."""
        step = self.state.step
        if step is None:
            raise RuntimeError("hfcp: a sequence mixer ran outside a forward of the patched model: call the patched "
                               "model, not its layers")
        return step


def local_key_valid(step):
    """(B, local_len) bool: which of this rank's tokens are not padding (hfcp's end padding included), or None.

    A recurrent layer's padding mask from transformers is cut to the local length, which under CP is another
    rank's columns; the step knows this rank's."""
    if step.key_valid is None:
        return None
    return step.key_valid.index_select(1, step.local_index.to(step.key_valid.device))


def source_fingerprint(function) -> str:
    """The first 16 hex digits of the sha256 of `function`'s source (decorators unwrapped); "" without source."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return ""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def check_source(module, fingerprints: dict, version: str) -> None:
    """Raises ValueError unless each method of `module`'s class named in `fingerprints` ("Class.method" ->
    source_fingerprint) has the source a record verified with transformers `version`: a record that runs a family's
    own code on views of its modules (or reproduces it) refuses code it has not seen."""
    cls = type(module).__name__
    mine = {key: want for key, want in fingerprints.items() if key.partition(".")[0] == cls}
    if not mine:
        raise ValueError(f"hfcp: no verified source for {cls}: this transformers version is not supported")
    for key, want in mine.items():
        if source_fingerprint(getattr(type(module), key.partition(".")[2], None)) != want:
            raise ValueError(f"hfcp: {key} is not the code hfcp verified (transformers {version}): this transformers "
                             "version (or a subclass) is not supported")


def check_step_tokens(module, hidden_states, step, what: str) -> None:
    """Raises unless `hidden_states` is this rank's shard of a step with one document per row.

    Raises:
        RuntimeError: a layer called outside the patched model (another length than the step's).
        ValueError: packed rows: transformers' torch paths of these layers cross document boundaries (they drop
            seq_idx / cu_seqlens) while its attention does not, so hfcp refuses them rather than pick one.
    """
    if hidden_states.shape[1] != step.layout.local_len:
        raise RuntimeError(f"hfcp: {type(module).__name__} got {hidden_states.shape[1]} tokens for a step of "
                           f"{step.layout.local_len} per rank (call the patched model, not its layers)")
    if step.doc_ids is not None:
        raise ValueError(f"hfcp: packed rows (position_ids restarting inside a row) in {type(module).__name__}: "
                         f"transformers' {what} crosses document boundaries while its attention does not, so hfcp "
                         "refuses them; pass one document per row (padding is exact)")


def bind(state, owner, patcher) -> list:
    """Bind each record mixer's forward to its modules in `owner` (checked first: nothing is changed if one raises).
    Returns what unbind() undoes.

    Raises:
        ValueError: a mixer module that already has a forward of its own (another library's hook), or what the
            record's make_forward refuses for a module.
    """
    if not patcher.mixers:
        return []
    cfg = owner.config.get_text_config()
    layers = decoder_layers(owner, cfg.num_hidden_layers) or []
    steps = LayerSteps(state)
    plan = []
    for name, make_forward in patcher.mixers:
        for m in owner.modules():
            if type(m).__name__ != name:
                continue
            if "forward" in m.__dict__:
                raise ValueError(f"hfcp: {name} already has a forward of its own (a hook of another library): hfcp "
                                 "cannot replace it with its context-parallel one")
            layer = next((lay for lay in layers if any(c is m for c in lay.modules())), None)
            if layer is None:
                raise ValueError(f"hfcp: found no decoder layer holding the {name} module")
            plan.append((m, layer, make_forward(state, m, steps.current)))
    handles, hooked = [], set()
    for _, layer, _ in plan:
        if id(layer) not in hooked:
            hooked.add(id(layer))
            handles.append(layer.register_forward_pre_hook(steps, with_kwargs=True))
    for m, _, forward in plan:
        m.forward = types.MethodType(forward, m)
    return [m for m, _, _ in plan] + handles


def unbind(restores: list) -> None:
    for r in restores:
        if isinstance(r, torch.nn.Module):
            del r.forward  # back to the class's forward
        else:
            r.remove()
