"""Sequence mixers other than attention that a record makes exact (Patcher.mixers): hfcp binds the record's forward
to each such module while patched.

Attention calls get their step from the mask argument (step_token.py). A mixer gets no such argument: it reads
the step of the call it belongs to from LayerSteps. A layer recomputed in backward by gradient checkpointing must see
the step of its own forward, not the latest one (an evaluation or reference forward under torch.no_grad() may have
run in between). transformers checkpoints a layer's `forward` inside its module hooks, so nothing outside the call
can tell a recompute from a forward; instead hfcp wraps the checkpoint function itself (transformers'
`_gradient_checkpointing_func`, torch's `checkpoint_wrapper`'s `checkpoint_fn`): the wrapper takes the step current
when the layer is called and installs it around each run of the layer, its forward and its recompute, reentrant or
not. A mixer recomputed in backward by any other checkpoint function cannot know its step and is refused.
"""
from __future__ import annotations

import types

import torch

from ..compiler import eager
from ..families.introspect import decoder_layers

_CHECKPOINT_FUNCTIONS = ("_gradient_checkpointing_func", "checkpoint_fn")  # transformers' layers, checkpoint_wrapper


class StepCarrying:
    """A checkpoint function (`checkpoint(function, *args, **kwargs)`) whose checkpointed function runs with the step
    of the call that checkpointed it installed (LayerSteps.carried), in the forward and in the recompute."""

    def __init__(self, checkpoint, steps: "LayerSteps"):
        self.checkpoint = checkpoint
        self.steps = steps

    def __call__(self, function, *args, **kwargs):
        steps, step = self.steps, self.steps.current()

        def with_its_step(*a, **k):
            outer, steps.carried = steps.carried, step
            try:
                return function(*a, **k)
            finally:
                steps.carried = outer

        return self.checkpoint(with_its_step, *args, **kwargs)

    def __getattr__(self, name):  # the wrapped function's attributes (a partial's keywords, say)
        if "checkpoint" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["checkpoint"], name)


class LayerSteps:
    """The step each mixer call belongs to, and the checkpoint functions of the owner's modules that carry it."""

    def __init__(self, state, owner):
        self.state = state
        self.owner = owner
        self.carried = None  # the step of the checkpointed call running now (its forward or its recompute), or None
        self.wrapped: list = []  # [(module, attribute, StepCarrying)]

    @eager
    def carry_through_checkpoints(self, owner, args, kwargs=None) -> None:
        """Forward pre-hook of the owner: wraps every checkpoint function set on its modules since the last forward
        (gradient checkpointing may be enabled, or checkpoint_wrapper applied, after hfcp.patch)."""
        wrappers, stale = {}, False
        for m in self.owner.modules():
            for name in _CHECKPOINT_FUNCTIONS:
                function = m.__dict__.get(name)
                if function is None or isinstance(function, StepCarrying) or not callable(function):
                    continue
                if name == "checkpoint_fn" and not hasattr(m, "_checkpoint_wrapped_module"):
                    continue  # (only torch's CheckpointWrapper calls its checkpoint_fn so)
                wrapper = wrappers.setdefault(id(function), StepCarrying(function, self))
                stale = stale or any(w[0] is m and w[1] == name for w in self.wrapped)
                setattr(m, name, wrapper)
                self.wrapped.append((m, name, wrapper))
        if stale:  # checkpointing enabled again: forget the wrappers it replaced
            self.wrapped = [w for w in self.wrapped if w[0].__dict__.get(w[1]) is w[2]]

    def unwrap(self) -> None:
        """Each checkpoint function hfcp wrapped back as it was (one set since, by the user, is kept)."""
        for m, name, wrapper in self.wrapped:
            if m.__dict__.get(name) is wrapper:
                setattr(m, name, wrapper.checkpoint)
        self.wrapped.clear()

    def current(self):
        """The step a mixer's call belongs to: the one its checkpoint function carried, else the latest forward's.

        Raises:
            ValueError: a recompute in backward that no checkpoint function of hfcp's carried a step into.
            RuntimeError: a mixer called outside a forward of the patched model.
        """
        if self.carried is not None:
            return self.carried
        if torch._C._current_autograd_node() is not None:
            raise ValueError("hfcp: a sequence mixer recomputed in backward by a checkpoint function hfcp does not "
                             "know: it cannot tell which forward's layout the recompute belongs to. Use transformers' "
                             "model.gradient_checkpointing_enable() "
                             "or torch's checkpoint_wrapper on the decoder layers")
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
    return step.local(step.key_valid)


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
    """Bind each record mixer's forward to its modules in `owner` (checked first: nothing is changed if one raises),
    and carry each forward's step through the checkpoint functions of `owner`'s modules (state.layer_steps).
    Returns what unbind() undoes.

    Raises:
        ValueError: a mixer module that already has a forward of its own (another library's hook), or what the
            record's make_forward refuses for a module.
    """
    if not patcher.mixers:
        return []
    cfg = owner.config.get_text_config()
    layers = decoder_layers(owner, cfg.num_hidden_layers) or []
    steps = LayerSteps(state, owner)
    plan = []
    for name, make_forward in patcher.mixers:
        for m in owner.modules():
            if type(m).__name__ != name:
                continue
            if "forward" in m.__dict__:
                raise ValueError(f"hfcp: {name} already has a forward of its own (a hook of another library): hfcp "
                                 "cannot replace it with its context-parallel one")
            if not any(c is m for lay in layers for c in lay.modules()):
                raise ValueError(f"hfcp: found no decoder layer holding the {name} module")
            plan.append((m, make_forward(state, m, steps.current)))
    for m, forward in plan:  # (eager: a compiled model breaks its graph at each mixer, which communicates)
        m.forward = types.MethodType(eager(forward), m)
    state.layer_steps = steps
    handle = owner.register_forward_pre_hook(steps.carry_through_checkpoints, with_kwargs=True)
    return [m for m, _ in plan] + [handle, steps]


def unbind(restores: list) -> None:
    for r in restores:
        if isinstance(r, torch.nn.Module):
            del r.forward  # back to the class's forward
        elif isinstance(r, LayerSteps):
            r.unwrap()
        else:
            r.remove()
