"""Vision-language models: the merged token sequence under CP (docs/how-to/vision-language.md).

The outer model (`...ForConditionalGeneration`) keeps its whole inputs: every rank encodes the images, merges their
features into `inputs_embeds` and computes the positions (mRoPE's rope index over the whole `input_ids` and grids)
exactly as one device does. Its hook (hooks.causal_lm.LossHook) checks the batch, shifts the
labels over the whole sequence and computes the loss. The language model's hook, `LanguageModelHook`, shards what
arrives there, the sequence whole and final: `inputs_embeds`, `position_ids` of any leading shape along their last
dim, and the mask (a mask the outer model built becomes hfcp's predicate or is refused, hfcp/attention/outer_mask.py).

Gradients: each rank back-propagates its slice of the merged sequence into the vision tower, so the mean over the
CP group of a vision parameter's gradient is the single-device one, as for every other parameter. Where the record
names the tower, its work is split over the group too (hfcp/hooks/tower_split.py).
"""
from __future__ import annotations

import functools
import types

from accelerate.hooks import ModelHook

from .batch import as_kwargs, shard_inputs
from ..families.introspect import forward_parameters
from ..compiler import eager
from ..attention.outer_mask import resolve_attention_mask
from .side_inputs import check_side_inputs, shard_side_inputs, side_input_names

# what the language model of a VLM may receive besides the merged sequence and its record's token_side_inputs; any
# other argument is a side input hfcp does not know how to split, and is refused
LANGUAGE_MODEL_INPUTS = frozenset({"input_ids", "inputs_embeds", "position_ids", "attention_mask", "use_cache",
                                   "cache", "past_key_values", "return_dict", "output_attentions",
                                   "output_hidden_states", "cache_position", "logits_to_keep",
                                   # (an MoE language model's: hfcp's aux loss, loss/router.py)
                                   "output_router_logits"})


class LanguageModelHook(ModelHook):
    """pre_forward of a VLM's language model: the merged (B, L, H) sequence -> this rank's slice."""

    def __init__(self, state):
        self.state = state

    @eager
    def pre_forward(self, module, *args, **kwargs):
        st = self.state
        if st.fwd.decoding:  # a decode step: its new tokens run whole on every rank (the outer hook prepared it)
            return args, kwargs
        layout, st.fwd.pending_layout = st.fwd.pending_layout, None
        if layout is None:
            raise RuntimeError(f"{type(module).__name__} is the language model of a hfcp-patched vision-language "
                               "model: call the patched outer model, whose hook checks the batch and computes the loss")
        kw = as_kwargs(module, args, kwargs)
        embeds = kw.get("inputs_embeds")
        if kw.get("input_ids") is not None or embeds is None or embeds.dim() != 3:
            raise ValueError(f"{type(module).__name__} got input_ids / no (batch, seq, hidden) inputs_embeds: hfcp "
                             "shards a vision-language model's merged sequence, "
                             "which its outer model passes as inputs_embeds")
        if embeds.shape[1] != layout.seq_len:
            raise ValueError(f"the merged sequence has {embeds.shape[1]} tokens but input_ids had {layout.seq_len}: "
                             "hfcp splits the sequence as input_ids give it (image tokens expanded by the processor)")
        pairs = st.patcher.token_side_inputs
        known = LANGUAGE_MODEL_INPUTS | side_input_names(pairs)
        side = sorted(k for k, v in kw.items() if k not in known and v is not None and v is not False)
        if side:
            raise ValueError(f"{type(module).__name__} got {side} beside the merged sequence: hfcp does not know how "
                             "to split these side inputs of this vision-language model (Patcher.token_side_inputs), "
                             "so it is refused")
        outer_masks = resolve_attention_mask(kw)
        check_side_inputs(module, kw, pairs, embeds.shape[:2])
        shard_inputs(st, kw, layout, outer_masks)
        shard_side_inputs(kw, pairs, st.step)
        if st.fwd.cache is not None:  # the prompt's prefill: each rank keeps its tokens' keys and values
            st.fwd.cache.begin_prefill(st.step)
        if "use_cache" in forward_parameters(module):
            kw["use_cache"] = st.fwd.cache is not None
        return (), kw


def clear_layout_after(outer, state):
    """Wrap the outer model's own forward (the one accelerate's hook calls) so that the layout its hook leaves for
    the language model is cleared when the forward ends, also when it raises before reaching the language model:
    a language model called alone afterwards is refused, never run on a stale layout. Returns the undo.

    The wrapper is a partial that names the model (and its forward as `__wrapped__`, which gives it the forward's
    signature), so that a shallow copy of the model such as accelerate's compile_regions makes rebinds it to the copy.
    """
    original = outer._old_forward
    if isinstance(original, types.MethodType) and original.__self__ is outer:
        forward = functools.partial(_forward_then_clear, state, original.__func__, outer)
    else:  # another library's wrapper: called as it is
        forward = functools.partial(_forward_then_clear, state, original, None)
    forward.__wrapped__ = original
    outer._old_forward = forward

    def restore():
        outer._old_forward = original
    return restore


def _forward_then_clear(state, forward, model, *args, **kwargs):
    try:
        return forward(*args, **kwargs) if model is None else forward(model, *args, **kwargs)
    finally:
        state.fwd.pending_layout = None
