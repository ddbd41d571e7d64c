"""The function hfcp registers in transformers' AttentionInterface (key "hfcp"), and its mask builder."""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import STRATEGIES, MaskSpec
from ..compiler import eager
from ..layout.masks import attention_chunk  # noqa: F401 - (hfcp.attention.interface.attention_chunk, as before)
from .decode import DecodeStep, decode_attention
from .kernels import autocast_off, autocast_on
from .outer_mask import OuterMask, hfcp_mask, layer_mask

KEY = "hfcp"


@eager  # (a compiled layer breaks its graph here: the strategies communicate and read the step's layout)
def hfcp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   sliding_window=None, is_causal=None, softcap=None, **kwargs):
    """transformers attention function: q (B, H, L/cp, D), k/v (B, Hkv, L/cp, D) -> ((B, L/cp, H, D), None)."""
    state = getattr(module, "_hfcp_state", None)
    step = getattr(attention_mask, "hfcp_step", None)  # the step this call belongs to (see step_token.py)
    carried = getattr(getattr(state, "layer_steps", None), "carried", None)
    if step is None and carried is not None:  # a reentrant recompute detaches a mask passed positionally (Zamba's):
        step = carried  # the step its checkpoint function carried (hfcp/mixers/binding.py)
    if state is not None and step is None and state.patcher.embeddings_classes:
        check_token_model_mask(module, attention_mask)
        step = state.step  # token models: no mask argument; their step depends on the token count only
    if state is None or step is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation='hfcp' but was not called through a model "
            "patched by hfcp.patch (or outside its forward): call the patched top-level model, whose hook "
            "shards the inputs (a submodule such as model.model called directly would see the whole sequence)"
        )
    state.fwd.attention_calls.add(id(module))
    sink = take_sink(module, kwargs, query.shape[1])
    if isinstance(step, DecodeStep):  # an outer model may pass its logits_to_keep down (LLaVA-OneVision): a decode
        kwargs.pop("logits_to_keep", None)  # step's outputs are whole on every rank, and its head keeps them itself
    refuse_unimplemented(module, kwargs)
    if dropout:
        raise ValueError(f"attention dropout={dropout} cannot be made exact under CP; set config.attention_dropout=0")
    if isinstance(step, DecodeStep):
        return decode_call(module, query, key, value, step, state, scaling, sliding_window, is_causal, softcap, sink)
    local = step.layout.local_len
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{type(module).__name__} attends {query.shape[2]} queries to {key.shape[2]} keys: hfcp's context-parallel "
            "attention computes attention over the model's own tokens, one key per query outside generation's cache; "
            "keys a model adds, drops or compresses itself cannot be split exactly over the ranks, so this model is "
            "not supported by hfcp (see the support matrix, docs/reference/support-matrix.md)")
    if query.shape[2] != local or key.shape[2] != local:
        raise ValueError(
            f"hfcp attention got {query.shape[2]} queries / {key.shape[2]} keys but the step layout holds "
            f"{local} local tokens; was a KV cache or a custom mask used (call hfcp.unpatch(model) for that), or "
            "is a checkpointed layer recomputed after a forward of another sequence length (run backward first)?"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    chunk = attention_chunk(module)
    causal, sliding_window, blocks = layer_mask(module, step.outer_masks, causal, sliding_window, chunk)
    if not causal and sliding_window:  # transformers has two conventions (|q - k| < W in Gemma 3, <= W in
        raise ValueError(  # create_bidirectional_sliding_window_mask); hfcp's window is one-sided (q - k < W)
            f"{type(module).__name__} attends bidirectionally with a sliding window of {sliding_window} (for example "
            "config.use_bidirectional_attention=True); hfcp implements sliding windows for causal attention only, so "
            "this is refused")
    spec = MaskSpec(bool(causal), sliding_window, float(softcap) if softcap else None, chunk,
                    blocks if step.blocks is not None else None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value = same_dtype(query, key, value, type(module).__name__)
    query, key, value, v_dim = same_head_dim(query, key, value)
    with autocast_off(query.device.type):  # the strategies choose their own precisions
        out = STRATEGIES[state.strategy](query, key, value, step, spec, scale, state.attention_group, sink)
    window = state.fwd.cache.kept_window(getattr(module, "layer_idx", None), sliding_window) \
        if state.fwd.cache is not None else None
    if window and not blocks_or_chunks(spec):  # a prompt's prefill
        state.fwd.cache.keep_window(getattr(module, "layer_idx", None), window)
    return out[..., :v_dim].transpose(1, 2).contiguous(), None


def blocks_or_chunks(spec: MaskSpec) -> bool:
    return spec.blocks is not None or spec.chunk is not None


def decode_call(module, query, key, value, step: DecodeStep, state, scaling, sliding_window, is_causal, softcap,
                sink):
    """A decode step's attention over the KV cache spread over the CP group: ((B, n, H, D), None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    chunk = attention_chunk(module)
    if not causal and query.shape[2] > 1:  # (one new token attends to every cached key and itself either way)
        raise ValueError(f"{type(module).__name__} attends bidirectionally: a decode step of {query.shape[2]} new "
                         "tokens would let the earlier of them see the later ones, which hfcp's decode attention does "
                         "not implement; decode one token per step (generate() does), or call hfcp.unpatch(model)")
    if chunk or not step.cache.plain_masks:
        raise ValueError(f"{type(module).__name__}: hfcp's generation implements causal attention with sliding "
                         "windows, softcap and sinks; this layer's mask (attention chunks or a mask built outside the "
                         "model) is not supported in decode steps yet")
    cache, layer = step.cache, getattr(module, "layer_idx", None)
    if layer not in cache.columns or key.shape[2] != len(cache.columns[layer]):
        raise RuntimeError(f"hfcp: {type(module).__name__} (layer_idx={layer!r}) got {key.shape[2]} keys that are not "
                           "the ones hfcp's cache holds for its layer (a layer that shares another's cache?)")
    spec = MaskSpec(True, sliding_window, float(softcap) if softcap else None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value = same_dtype(query, key, value, type(module).__name__)
    with autocast_off(query.device.type):
        out = decode_attention(query, key, value, step.columns, cache.columns[layer].to(key.device),
                               cache.valid[layer].to(key.device), spec, scale, state.mesh.cp_group, sink)
    window = cache.kept_window(layer, sliding_window)
    if window:
        cache.keep_window(layer, window)
    return out.transpose(1, 2).contiguous(), None


def check_token_model_mask(module, mask) -> None:
    """Token (vision) models attend over every token: a mask other than the plain bidirectional one is refused."""
    if mask is None or (isinstance(mask, OuterMask) and mask.form == "bidirectional" and mask.padding is None):
        return
    shown = (mask.why or f"a {mask.form} mask") if isinstance(mask, OuterMask) else type(mask).__name__
    raise ValueError(f"{type(module).__name__} got an attention mask ({shown}); hfcp runs vision models with full "
                     "bidirectional attention over every token and cannot apply it, so it is refused")


def take_sink(module, kwargs: dict, num_heads: int):
    """Pops an attention-sink logit per head (`s_aux`, `sinks`: a (num_heads,) tensor) from kwargs; None if absent."""
    sinks = [(n, kwargs.pop(n)) for n in ("s_aux", "sinks") if kwargs.get(n) is not None]
    if not sinks:
        return None
    (name, sink), *more = sinks
    if more or not isinstance(sink, torch.Tensor) or tuple(sink.shape) != (num_heads,):
        shown = tuple(sink.shape) if isinstance(sink, torch.Tensor) else repr(sink)
        raise ValueError(f"{type(module).__name__} passes {name} of shape {shown}; hfcp implements one sink logit per "
                         f"query head, shape ({num_heads},), so this model is not supported")
    return sink


def same_head_dim(query, key, value):
    """MLA families (DeepSeek-V2/V3, MiniCPM3, ...) have a value head dim other than the query/key one, which the
    fused kernels refuse. Zero padding is exact: zero columns of q and k add nothing to q.k (the scale was taken
    before), zero columns of v give output columns that are cut off again. Returns (q, k, v, value head dim)."""
    dq, dv = query.shape[-1], value.shape[-1]
    if dq == dv:
        return query, key, value, dv
    if dv < dq:
        return query, key, torch.nn.functional.pad(value, (0, dq - dv)), dv
    pad = (0, dv - dq)
    return torch.nn.functional.pad(query, pad), torch.nn.functional.pad(key, pad), value, dv


# Keyword arguments that carry nothing hfcp's attention needs: positions (the step holds the global ones), the
# cache flag (the step says whether this is a decode step), the loss's token count and the flags that record outputs
# (router logits, hidden states: families pass them down to every layer). Any other one is implemented or refused.
IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "num_items_in_batch",
                            "output_router_logits", "output_hidden_states"})
NEUTRAL_VALUES = {"logits_to_keep": 0}  # keep all logits: some outer models pass it down through **kwargs
CALL_OPTIONS = {  # options of the model's call that reach attention: refused by name (the model is supported)
    "output_attentions": "hfcp's attention never forms the (query x key) attention weights, so it has none to "
                         "return; call the model without output_attentions (hfcp.unpatch(model) to inspect them)",
}


def refuse_unimplemented(module, kwargs: dict) -> None:
    """Raises ValueError for an attention argument that would change the result and that hfcp does not implement
    (position biases, sparse-attention indices, ...): dropping it would be silently wrong. A
    None or False value changes nothing and passes. Every rank raises alike, at its first attention call."""
    for name, value in kwargs.items():
        if name in IGNORED_KWARGS or value is None or value is False:
            continue
        if name in NEUTRAL_VALUES and type(value) is int and value == NEUTRAL_VALUES[name]:
            continue
        if name in CALL_OPTIONS:
            raise ValueError(f"{name}={value!r} on a hfcp-patched model: {CALL_OPTIONS[name]}")
        shown = f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(
            f"{type(module).__name__} passes {name}={shown} to its attention function, which hfcp's context-parallel "
            f"attention does not implement: the result would be wrong, so this model is not supported by hfcp "
            "(see hfcp's docs: reference/support-matrix.md)"
        )


def same_dtype(query, key, value, name: str):
    """q, k, v in one dtype, as SDPA sees them: under autocast all in the autocast dtype (after RoPE q/k are
    often fp32 while v is bf16); otherwise they must already agree (SDPA refuses a mix too)."""
    device = query.device.type
    if autocast_on(device):
        dtype = torch.get_autocast_dtype(device)
        return tuple(t.to(dtype) for t in (query, key, value))
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"{name}: query, key and value have dtypes {query.dtype}, {key.dtype}, {value.dtype}; "
                         "attention needs one dtype (cast the model with model.to(dtype), or train under autocast)")
    return query, key, value


def register_with_transformers() -> None:
    """Idempotent; adds hfcp's own key and never touches built-in keys such as "sdpa"."""
    AttentionInterface.register(KEY, hfcp_attention)
    AttentionMaskInterface.register(KEY, hfcp_mask)
