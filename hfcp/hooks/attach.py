"""What hfcp.patch attaches to a model, one function per model kind; each change pushes its undo on the state.

- `attach_attention`: every kind: the record's other mixers bound, hfcp's attention function set, modules marked.
- `attach_causal_lm`: the sequence hook (shard, loss; a sequence classifier's pooled score), generate(), the router
  aux loss, dynamic RoPE.
- `attach_vlm`: the loss at the outer model, the sharding at its language model's input, the vision tower split.
- `attach_vision`: a token model (ViT, video): the patch embeddings sharded, the head's input gathered.
"""
from __future__ import annotations

import functools

from accelerate.hooks import ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module

from ..attention.interface import KEY
from ..families.resolve import Plan
from . import rope, vit, vlm
from .causal_lm import LossHook, ShardSequenceHook
from .heads import SequenceClassificationHook
from ..families.heads import classification_head_name
from .synced_batch_norm import bind_batch_norms, unbind_batch_norms
from .tower_split import TowerSplitHook
from ..families.towers import split_mode, syncs_batch_norm
from .vlm import LanguageModelHook
from ..inference import generate
from .router import RouterStatsHook
from ..mixers import bind, unbind
from ..state import CPState


def attach_attention(state: CPState, inner, plan: Plan) -> None:
    """The record's other mixers bound (first: they may refuse), hfcp's attention function set on the owner."""
    restores = bind(state, plan.owner, plan.patcher)
    state.undo.append(functools.partial(unbind, restores))
    plan.owner.set_attn_implementation(KEY)
    state.undo.append(functools.partial(plan.owner.set_attn_implementation, state.original_attn))
    marked = [inner, *plan.modules]
    for m in marked:
        m._hfcp_state = state
    state.undo.append(functools.partial(_unmark, marked))


def attach_causal_lm(state: CPState, inner, plan: Plan) -> None:
    if state.head == "sequence_classification":
        add_hook(state, inner, SequenceClassificationHook(state, classification_head_name(inner, state.head)))
    else:
        add_hook(state, inner, ShardSequenceHook(state))
    if state.head == "causal_lm" and hasattr(inner, "generate"):
        _wrap_generate(state, inner)
    if state.router_aux is not None and not isinstance(state.router_aux, str):
        add_hook(state, inner.base_model, RouterStatsHook(state))
    _attach_rope(state, plan.owner)


def attach_vlm(state: CPState, inner, plan: Plan) -> None:
    add_hook(state, inner, LossHook(state))  # the loss at the outer model
    add_hook(state, plan.owner, LanguageModelHook(state))  # the sharding at its language model's input
    state.undo.append(vlm.clear_layout_after(inner, state))
    if hasattr(inner, "generate"):
        _wrap_generate(state, inner)
    if state.router_aux is not None and not isinstance(state.router_aux, str):  # the router logits of the merged
        add_hook(state, inner.base_model, RouterStatsHook(state))  # sequence's tokens, as the outer model reads them
    for path in (plan.patcher.vision_tower, plan.patcher.audio_tower):  # each rank encodes its share of the
        if path:  # images, frames or clips
            tower = inner.get_submodule(path)
            hook = TowerSplitHook(state, split_mode(getattr(tower, "config", None)) or "items")
            add_hook(state, tower, hook)
            if syncs_batch_norm(getattr(tower, "config", None)):  # its statistics over the group's clips
                norms = bind_batch_norms(tower, hook.share_valid, state.mesh.cp_group)
                state.undo.append(functools.partial(unbind_batch_norms, norms))
    _attach_rope(state, plan.owner)  # the language model's rotary modules (the vision tower is not sharded)


def attach_vision(state: CPState, inner, plan: Plan) -> None:
    for module, hook in vit.attach(inner, state, plan.embeddings):
        state.undo.append(functools.partial(remove_hook, module, hook))


ATTACH = {"lm": attach_causal_lm, "vlm": attach_vlm, "vision": attach_vision}


def add_hook(state: CPState, module, hook: ModelHook) -> None:
    """`hook` appended to the module's accelerate hooks (others kept); its removal pushed on the undo stack."""
    add_hook_to_module(module, hook, append=True)
    state.undo.append(functools.partial(remove_hook, module, hook))


def remove_hook(module, ours: ModelHook) -> None:
    """Remove `ours` from module, keeping any other accelerate hook chained with it."""
    if hasattr(ours, "restore_pending_head"):  # a chunked forward that raised may have left the head swapped
        ours.restore_pending_head()
    hook = getattr(module, "_hf_hook", None)
    others = [h for h in hook.hooks if h is not ours] if isinstance(hook, SequentialHook) else []
    remove_hook_from_module(module)
    if "forward" in module.__dict__ and not others:
        del module.forward  # back to the class's forward
    for h in others:
        add_hook_to_module(module, h, append=True)


def _wrap_generate(state: CPState, inner) -> None:
    generate.wrap_generate(inner, state.mesh.cp_group)
    state.undo.append(functools.partial(generate.unwrap_generate, inner))


def _attach_rope(state: CPState, owner) -> None:
    restores = rope.attach(rope.dynamic_rope_modules(owner), state)
    state.undo.append(functools.partial(rope.detach, restores))


def _unmark(modules: list) -> None:
    for m in modules:
        del m._hfcp_state
