"""Workers for masks built outside a patched model (issue 22, item 2): a vision-language model's language model
patched alone, with the outer model building its mask. Exact, or refused on every rank with the reason."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.compare import grad_error

L = 24
_VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, image_size=16, patch_size=4)
_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def tiny_vlm(kind: str):
    """A tiny random PaliGemma (prefix-LM, bidirectional Gemma), Gemma 3 (dict of full and sliding masks, image
    blocks from token_type_ids) or LLaVA-OneVision (Qwen2 builds its own mask) in train mode."""
    import transformers as T

    if kind == "paligemma":
        cfg = T.PaliGemmaConfig(vision_config=_VISION, text_config=dict(model_type="gemma", **_TEXT),
                                image_token_index=95, projection_dim=32)
        cls = T.PaliGemmaForConditionalGeneration
    elif kind == "gemma3":
        cfg = T.Gemma3Config(vision_config=_VISION,
                             text_config=dict(model_type="gemma3_text", sliding_window=7, **_TEXT),
                             image_token_index=95, mm_tokens_per_image=4, boi_token_index=93, eoi_token_index=94)
        cls = T.Gemma3ForConditionalGeneration
    else:
        cfg = T.LlavaOnevisionConfig(vision_config=_VISION, text_config=dict(model_type="qwen2", **_TEXT),
                                     image_token_index=95, video_token_index=94)
        cls = T.LlavaOnevisionForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(copy.deepcopy(cfg)).float().train()


def _batch(token_types: bool, padding: bool):
    ids = torch.randint(3, 90, (2, L), generator=torch.Generator().manual_seed(1))
    kw, labels = {"input_ids": ids}, ids.clone()
    if token_types:  # a prefix (0) and a suffix (1): PaliGemma's prefix-LM block, Gemma 3's image-block rule
        kw["token_type_ids"] = (torch.arange(L) >= 12).long()[None].expand(2, -1).clone()
    # left padding of row 0; its first valid token is never a target
    # (see docs/reference/limitations.md: padding query rows)
    if padding:
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        labels[0, :6] = -100
        kw["attention_mask"] = mask
    return kw, labels


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def patched_language_model(kind: str, token_types: bool, padding: bool) -> dict:
    """The outer model with only its language model patched; the loss from the gathered logits, against the
    unpatched model: {"error": message} when refused, else the loss and worst gradient errors."""
    ref, model = tiny_vlm(kind), tiny_vlm(kind)
    kw, labels = _batch(token_types, padding)
    want = _loss(ref(**kw, use_cache=False).logits, labels)
    want.backward()
    lm = model.model.language_model
    hfcp.patch(lm, timeout=20)
    try:
        out = model(**kw, use_cache=False)
        loss = _loss(hfcp.gather_sequence(out.logits, lm), labels)
        loss.backward()
    except ValueError as e:
        return {"error": str(e)}
    finally:
        hfcp.unpatch(lm)
    got = {n: p.grad / dist.get_world_size() for n, p in model.named_parameters() if p.grad is not None}
    for g in got.values():
        dist.all_reduce(g)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"error": None, "loss_err": abs(loss.item() - want.item()) / want.item(),
            "grad_err": grad_error(got, ref_grads), "same_keys": got.keys() == ref_grads.keys()}


def prepared_mask(kind: str) -> str:
    """A patched causal LM given a mask hfcp cannot split: the message every rank raises."""
    from workers_model import tiny_model

    from transformers import masking_utils as mu

    model = tiny_model("llama")
    hfcp.patch(model, timeout=20)
    ids = torch.randint(3, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    embeds = model.get_input_embeddings()(ids)
    built = {  # built by transformers outside the patched forward, for hfcp's mask builder
        "custom_overlay": lambda: mu.create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                                                        cache=None, or_mask_function=lambda b, h, q, k: k <= q + 1),
        "window_differs": lambda: mu.create_sliding_window_causal_mask(  # llama's layers have no window
            config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None),
    }
    model.config.sliding_window = 4
    masks = {k: v() for k, v in built.items() if k == kind}
    masks |= {
        "float_4d": torch.zeros(1, 1, 12, 12),
        "dict_padding_differs": {"full_attention": torch.ones(1, 12, dtype=torch.long),
                                 "sliding_attention": torch.cat([torch.zeros(1, 2), torch.ones(1, 10)], 1).long()},
    }
    try:
        model(input_ids=ids, attention_mask=masks[kind], labels=ids)
        return "not refused"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)


def chunked_layer_outer_mask() -> str:
    """A causal mask built outside a patched llama4_text (chunked attention on every layer): refused."""
    from transformers.masking_utils import create_causal_mask

    from hfcp.testing.tiny import tiny_model

    model = tiny_model("llama4_text")
    model.config.output_router_logits = False
    hfcp.patch(model, timeout=20)
    ids = torch.randint(3, 60, (1, 16), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(1, 16, dtype=torch.long)
    padding[0, :2] = 0
    mask = create_causal_mask(config=model.config, inputs_embeds=model.get_input_embeddings()(ids),
                              attention_mask=padding, cache=None)
    try:
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        return "not refused"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
