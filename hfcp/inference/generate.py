"""Generation on a patched causal LM or vision-language model (docs/how-to/generation.md): which forwards are a
prompt's prefill or a decode step, and their inputs. The cache and its decode attention: hfcp/inference/kv_cache.py,
hfcp/attention/decode.py.

A forward with a cache (transformers' `generate()` passes an empty DynamicCache first, then the cache the model
returned) or `use_cache=True` runs with a ShardedKVCache: the first forward is the prompt's prefill, sharded over
the CP group like a training forward (a VLM's merged sequence at its language model's input); each later one a
decode step, whose few new tokens every rank runs alike.
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from ..distributed.input_checks import check_same_batch
from ..families.introspect import forward_parameters
from .kv_cache import ShardedKVCache

CACHE_NAMES = ("cache", "past_key_values")  # transformers 5 renamed past_key_values to cache (both accepted)


def generation_cache(state, module, kw: dict, shards: bool) -> ShardedKVCache | None:
    """The ShardedKVCache of this forward (put in kw under the model's name for it), or None for a forward without a
    cache. Raises ValueError, on every rank alike and before any collective, for a cache hfcp cannot spread."""
    names = [n for n in CACHE_NAMES if kw.get(n) is not None]
    given = kw.get(names[0]) if names else None
    if given is None and not kw.get("use_cache"):
        return None
    if state.head != "causal_lm":
        raise ValueError(f"a KV cache (use_cache=True, a cache, generate()) on a patched {type(module).__name__}: hfcp "
                         "generates with causal LMs and vision-language models only; call hfcp.unpatch(model)")
    if state.patcher.language_model and kw.get("token_type_ids") is not None:
        raise ValueError(f"generate() with token_type_ids on a patched {type(module).__name__}: its image or prefix "
                         "blocks attend bidirectionally through a mask the model builds over the cache, which hfcp's "
                         "cache does not build; call hfcp.unpatch(model) to generate")
    if state.patcher.mixers:
        raise ValueError(f"a KV cache (use_cache=True, a cache, generate()) on a patched {type(module).__name__}: its "
                         "recurrent layers do not carry their states into decode steps under hfcp yet; call "
                         "hfcp.unpatch(model) to generate")
    if kw.get("labels") is not None:
        raise ValueError("a KV cache with labels: a training or evaluation forward runs without a cache "
                         "(use_cache=False)")
    if isinstance(given, ShardedKVCache):
        return given
    if given is not None and not (type(given) is DynamicCache and given.get_seq_length() == 0
                                  and not getattr(given, "offloading", False)):
        raise ValueError(f"a {type(given).__name__} holding {given.get_seq_length()} tokens on a patched model: hfcp "
                         "generates with its own cache spread over the CP group "
                         "(hfcp.inference.kv_cache.ShardedKVCache), which it makes from the prompt; pass no cache, or "
                         "an empty DynamicCache (not static, offloaded or quantized)")
    parameters = forward_parameters(module)
    if "logits_to_keep" not in parameters and not kw.get(LAST_LOGITS):  # (a forward with a cache, not generate()'s)
        raise ValueError(f"hfcp: {type(module).__name__}.forward takes no logits_to_keep, so a forward with a cache "
                         "would return each rank's shard of the prompt's logits, not the last position's; call "
                         "generate(), whose forwards hfcp limits to the last position, or hfcp.unpatch(model)")
    name = next((n for n in CACHE_NAMES if n in parameters), CACHE_NAMES[0])
    for n in names:
        kw.pop(n)
    cache = ShardedKVCache(state.mesh.cp_rank, state.mesh.cp_size, cache_windows(given, module))
    kw[name] = cache
    return cache


# the keyword generate() adds to the forwards of a model whose forward takes no logits_to_keep: the prompt's prefill
# returns the logits of the global last position only (what generate() reads), the same on every rank
LAST_LOGITS = "hfcp_last_logits"


def _marking_forwards(model):
    """model.prepare_inputs_for_generation with LAST_LOGITS added to every forward's inputs, for one generate()."""
    prepare = model.prepare_inputs_for_generation

    def marked(*args, **kwargs):
        return {**prepare(*args, **kwargs), LAST_LOGITS: True}
    return marked


def cache_windows(given, module) -> dict[int, int]:
    """{layer: window} of the layers whose keys transformers' cache keeps a window of (DynamicSlidingWindowLayer):
    read from the cache generate() passes, else from the one the model builds from its config for use_cache=True."""
    template = given
    if template is None:
        try:
            template = DynamicCache(config=module.config.get_text_config(decoder=True))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"use_cache=True on a patched {type(module).__name__}: hfcp reads which layers' keys the "
                             "cache keeps a window of from the DynamicCache transformers builds from its config, which "
                             f"failed ({type(e).__name__}: {e}); pass cache=DynamicCache() or use generate()") from e
    return {i: int(layer.sliding_window) for i, layer in enumerate(template.layers)
            if isinstance(layer, DynamicSlidingWindowLayer)}


def prepare_decode(state, module, kw: dict, cache: ShardedKVCache, step_token) -> None:
    """kw of a decode step: its new tokens stay whole (every rank runs them), the mask becomes the decode step's token.

    Raises ValueError when the ranks decode different tokens (sampling without a seed shared over the CP group) or
    the mask does not cover the cached and new columns."""
    ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
    x = ids if ids is not None else embeds
    if x is None or x.dim() < 2:
        raise ValueError("a decode step needs input_ids (batch, new tokens) or inputs_embeds")
    if state.check_inputs:
        check_same_batch(kw, state.mesh.cp_group, names=("input_ids", "inputs_embeds", "attention_mask",
                                                         "position_ids"))
    batch, new = x.shape[:2]
    mask = kw.get("attention_mask")
    if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or mask.shape[1] != cache.seen + new):
        raise ValueError(f"a decode step's attention_mask has shape {tuple(mask.shape)}; hfcp needs (batch, "
                         f"{cache.seen + new}): the cached and the new columns")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError(f"a decode step's attention_mask of type {type(mask).__name__}: hfcp needs a (batch, columns) "
                         "padding mask")
    valid = (mask[:, -new:].to(torch.bool) if mask is not None
             else torch.ones(batch, new, dtype=torch.bool, device=x.device))
    step = cache.begin_decode(valid)
    kw["attention_mask"] = step_token(step, x.device)
    parameters = forward_parameters(module)
    if "use_cache" in parameters:
        kw["use_cache"] = True
    if "output_router_logits" in parameters:  # the router aux loss is a training term: not in decode steps
        kw["output_router_logits"] = False


def return_cache(output, cache: ShardedKVCache):
    """The output of a forward that ran with hfcp's cache, returning it where the model returned none: BERT-family
    models used as causal LMs without config.is_decoder fill the cache they are given but return None, and
    transformers' generate() then passes its own cache on, which the model keeps filling, so each step attends over
    every earlier token's cached keys. hfcp's cache is spread over the ranks: returned, generate() passes it on and
    the later steps are decode steps over it, as there (a tuple output is left as it is)."""
    if isinstance(output, tuple):
        return output
    name = next((n for n in CACHE_NAMES if n in output or hasattr(output, n)), None)
    if name is not None and output.get(name) is None:
        output[name] = cache
    return output


class TokensAgree:
    """A stopping criterion generate() calls after every chosen token, on every rank: one all-gather over the CP group
    of the new tokens, refused on every rank alike when they differ (sampling without one seed on every rank, a
    kernel that is not deterministic). With the same tokens and the same logits on every rank, the ranks stop at the
    same step (eos, lengths, stop strings), so none is left waiting in the next step's collectives. It never stops
    generation itself."""

    def __init__(self, group):
        self.group = group

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        from ..distributed.collectives import all_gather_no_grad

        last = input_ids[:, -1:].to(torch.int64)
        every = all_gather_no_grad(last[None], self.group, 0)  # (cp, B, 1)
        if not bool((every == every[0]).all()):
            raise ValueError("hfcp: the ranks of a CP group chose different tokens in generate(): sample with one "
                             "seed on every rank (torch.manual_seed(...) before generate) and deterministic kernels")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def wrap_generate(model, group):
    """model.generate while patched (an instance attribute; `unwrap_generate` removes it): with TokensAgree among
    its stopping criteria, and max_time refused (each rank's clock would stop it at another step)."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    original = model.generate

    def generate(*args, **kwargs):
        config = kwargs.get("generation_config") or model.generation_config
        if kwargs.get("max_time") is not None or getattr(config, "max_time", None) is not None:
            raise ValueError("hfcp: generate(max_time=...) would stop each rank of a CP group by its own clock, at "
                             "different steps; pass max_new_tokens instead")
        for name in ("output_hidden_states", "output_attentions"):
            if kwargs.get(name) or (kwargs.get(name) is None and getattr(config, name, False)):
                raise ValueError(f"hfcp: generate({name}=True) on a patched model: each rank holds its shard of the "
                                 f"prompt, so what generate() would return is a rank's shard; leave {name} off (a "
                                 "forward returns hidden states local, for hfcp.gather_sequence)")
        criteria = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []) + [TokensAgree(group)])
        if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
            return original(*args, stopping_criteria=criteria, **kwargs)
        own = model.__dict__.get("prepare_inputs_for_generation")  # (PEFT sets one during its generate())
        model.prepare_inputs_for_generation = _marking_forwards(model)  # (for this call: undone after it)
        try:
            return original(*args, stopping_criteria=criteria, **kwargs)
        finally:
            if own is None:
                del model.prepare_inputs_for_generation
            else:
                model.prepare_inputs_for_generation = own

    generate.__wrapped__ = original
    model.generate = generate


def unwrap_generate(model) -> None:
    if "generate" in model.__dict__:
        del model.generate
