"""Workers for vision-language models patched at their language model (`hfcp.patch(model.model.language_model)`),
called through the outer model, whose vision tower then runs whole on every rank: exact (logits gathered with
hfcp.gather_sequence, the loss from them, every gradient, the vision tower's included), or refused by name on every
rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.compare import grad_error
from workers_vlm import tiny_vlm, vlm_batch


def _loss(logits, labels):
    """transformers' causal-LM loss: labels shifted over the whole sequence, a mean over the valid targets."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def _grads(model, world: int = 1) -> dict:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if world > 1:  # the mean over the CP group is the single-device gradient
        for g in grads.values():
            dist.all_reduce(g)
            g /= world
    return grads


def language_model(model):
    """The module a user patches alone: the one whose config is the text config (model.model.language_model,
    model.model.text_model)."""
    from hfcp.families.introspect import module_with_config

    return model.get_submodule(module_with_config(model, model.config.get_text_config()))


def compare(kind: str, case: str, strategy: str = "ring") -> dict:
    """The outer model with only its language model patched against the unpatched model: loss and logits errors
    (relative), every gradient's and the vision tower's worst relative error."""
    ref, model = tiny_vlm(kind), tiny_vlm(kind)
    batch = vlm_batch(kind, case)
    labels = batch.pop("labels")
    want_logits = ref(**batch, use_cache=False).logits
    want = _loss(want_logits, labels)
    want.backward()
    lm = language_model(model)
    hfcp.patch(lm, strategy=strategy, timeout=30)
    try:
        out = model(**batch, use_cache=False)
        local_len = out.logits.shape[1]
        logits = hfcp.gather_sequence(out.logits, lm)
        got = _loss(logits, labels)
        got.backward()
    finally:
        hfcp.unpatch(lm)
    grads, ref_grads = _grads(model, dist.get_world_size()), _grads(ref)
    vision = {n: g for n, g in grads.items() if "visual" in n or "vision" in n}
    return {"loss_err": abs(got.item() - want.item()) / want.item(), "same_keys": grads.keys() == ref_grads.keys(),
            "logits_err": ((logits - want_logits).abs().max() / want_logits.abs().max()).item(),
            "grad_err": grad_error(grads, ref_grads), "local_len": local_len, "seq_len": labels.shape[1],
            "vision_grad_err": grad_error(vision, {n: ref_grads[n] for n in vision}) if vision else None}


def refused(kind: str, what: str) -> str:
    """The error every rank raises (no hang) for: "labels" passed to the outer model; "unknown_side_input", the
    language model's record made to know no side inputs, so that Qwen3-VL's visual_pos_masks reach it unsplit;
    "direct_extra_tensor", a (batch, seq, hidden) tensor keyword passed to the patched language model itself;
    "router_logits", a MoE VLM whose config asks for router logits (its outer model's aux loss)."""
    from hfcp.families.registry import REGISTRY, Patcher

    model = tiny_vlm(kind)
    batch = vlm_batch(kind, "two_images")
    labels = batch.pop("labels")
    lm = language_model(model)
    record = REGISTRY.get(lm.config.model_type)
    if what == "router_logits":
        model.config.text_config.output_router_logits = True
    if what == "unknown_side_input":
        REGISTRY.register(Patcher(model_type=record.model_type, attention_classes=(), read_from_model=True),
                          replace=True)
    try:
        hfcp.patch(lm, timeout=30)
        if what == "direct_extra_tensor":
            embeds = torch.randn(2, 40, lm.config.hidden_size)
            lm(inputs_embeds=embeds, extra_states=torch.zeros_like(embeds), use_cache=False)
        else:
            model(**batch, labels=labels if what == "labels" else None, use_cache=False)
        return "not refused"
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        hfcp.unpatch(lm)
        REGISTRY.register(record, replace=True)
