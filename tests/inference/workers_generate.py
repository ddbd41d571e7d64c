"""generate() on patched models whose cache transformers handles in its own way, against the unpatched model:
BERT-family decoders (bidirectional with is_decoder=False; they fill the cache they are given but return none), a
sliding-window cache its mask does not apply (Moshi), an outer model that passes logits_to_keep down to attention
(LLaVA-OneVision). Every model is built from its config as transformers builds it, weights perturbed so that tokens
differ when a step is computed otherwise."""
from __future__ import annotations

import copy

import torch

import hfcp
from workers_inference import _prompts, _relative  # two prompts (row 0 left-padded), relative error

_BERT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=128)


def _perturbed(model, scale: float = 0.2):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def causal_lm(kind: str, is_decoder: bool = False, window: int = 7):
    """A tiny causal LM of `kind` built from its config: bert (BertLMHeadModel), electra (ElectraForCausalLM),
    bert_generation (BertGenerationDecoder), moshi (MoshiForCausalLM, config.sliding_window=`window`)."""
    import transformers as T

    torch.manual_seed(0)
    if kind == "bert":
        model = T.BertLMHeadModel(T.BertConfig(**_BERT, is_decoder=is_decoder))
    elif kind == "electra":
        model = T.ElectraForCausalLM(T.ElectraConfig(**_BERT, embedding_size=32, is_decoder=is_decoder))
    elif kind == "bert_generation":
        model = T.BertGenerationDecoder(T.BertGenerationConfig(**_BERT, is_decoder=is_decoder))
    elif kind == "moshi":
        model = T.MoshiForCausalLM(T.MoshiConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16, ffn_dim=64,
                                                 max_position_embeddings=256, sliding_window=window))
    else:
        raise ValueError(kind)
    return _perturbed(model.float())


def generated(kind: str, length: int = 17, new: int = 6, pad: int = 0, is_decoder: bool = False,
              use_cache: bool = True, window: int = 7) -> dict:
    """Greedy generate() of the patched model (cp = world) against the unpatched model's: the tokens, the worst
    score error over the steps, the cache generate() returned and its columns."""
    ref = causal_lm(kind, is_decoder, window)
    model = copy.deepcopy(ref)
    prompts = _prompts(ref.config.vocab_size, length, pad)
    settings = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_scores=True,
                    pad_token_id=0, use_cache=use_cache)
    with torch.no_grad():
        want = ref.generate(**prompts, **settings)
        hfcp.patch(model, timeout=60)
        try:
            got = model.generate(**prompts, **settings)
        finally:
            hfcp.unpatch(model)
    cache = got.past_key_values
    return {"same_tokens": torch.equal(got.sequences, want.sequences), "tokens": got.sequences[:, length:].tolist(),
            "want": want.sequences[:, length:].tolist(),
            "score_err": max(_relative(g, w) for g, w in zip(got.scores, want.scores)),
            "cache": type(cache).__name__, "columns": cache.get_seq_length() if cache is not None else None}


def vlm_generated(kind: str, new: int = 6) -> dict:
    """Greedy generate() of a patched VLM (tests/hooks/workers_vlm.py's, two rows with one image each, as
    hfcp.testing.tiny_vlm.image_batch places them) against the unpatched model's."""
    import workers_vlm as V
    from hfcp.testing.tiny_vlm import image_batch

    model = V.tiny_vlm(kind).eval()
    model.config.get_text_config().use_cache = model.generation_config.use_cache = True
    batch = {k: v for k, v in image_batch(model, 96).items() if k != "labels"}
    settings = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                    output_scores=True)
    with torch.no_grad():
        want = copy.deepcopy(model).generate(**batch, **settings)
        hfcp.patch(model, timeout=60)
        try:
            got = model.generate(**batch, **settings)
        finally:
            hfcp.unpatch(model)
    return {"same_tokens": torch.equal(got.sequences, want.sequences),
            "score_err": max(_relative(g, w) for g, w in zip(got.scores, want.scores)),
            "new": got.sequences.shape[1] - batch["input_ids"].shape[1], "cache": type(got.past_key_values).__name__}


def steps_by_hand(kind: str, news=(3, 1), length: int = 17) -> dict:
    """A prompt forward with use_cache=True, then decode forwards of `news` tokens each with the cache it returned,
    against the unpatched model doing the same with the cache generate() would pass it (which BERT-family models
    fill but do not return): the logit errors, or hfcp's message for a call it refuses."""
    from transformers.cache_utils import DynamicCache

    ref = causal_lm(kind)
    model = copy.deepcopy(ref)
    prompts = _prompts(ref.config.vocab_size, length, 3)
    steps, mask = [], prompts["attention_mask"]
    for i, n in enumerate(news):
        mask = torch.cat([mask, torch.ones(2, n, dtype=mask.dtype)], 1)
        steps.append({"input_ids": torch.arange(n).repeat(2, 1) + 5 + 7 * i, "attention_mask": mask})
    with torch.no_grad():
        hfcp.patch(model, timeout=60)
        try:
            out = model(**prompts, use_cache=True)
            got = [hfcp.gather_sequence(out.logits, model)] + [model(**s, cache=out.cache).logits for s in steps]
        except ValueError as e:
            return {"refused": str(e)}
        finally:
            hfcp.unpatch(model)
        cache = DynamicCache(config=ref.config)
        want = [ref(**prompts, cache=cache).logits] + [ref(**s, cache=cache).logits for s in steps]
    return {"errs": [_relative(g, w) for g, w in zip(got, want)], "columns": out.cache.get_seq_length()}
