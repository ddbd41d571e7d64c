"""Model-level equivalence, run on every rank of a DistPool: patched vs unpatched tiny seeded models."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers

import hfcp

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}


def tiny_model(family: str, base: bool = False, seed: int = 0, **overrides):
    cfg_name, cls_name, extra = CONFIGS[family]
    kwargs = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    cfg = getattr(transformers, cfg_name)(**{**kwargs, **extra, **overrides})
    torch.manual_seed(seed)
    cls = getattr(transformers, cls_name.replace("ForCausalLM", "Model") if base else cls_name)
    return cls(cfg).float()


def make_batch(case: dict):
    g = torch.Generator().manual_seed(case.get("seed", 1))
    B, L = case["B"], case["L"]
    ids = torch.randint(0, 64, (B, L), generator=g)
    batch = {"input_ids": ids}
    labels = ids.clone()
    labels[:, : L // 5] = -100  # some ignored targets
    if case.get("packed"):
        rows = []
        for _ in range(B):
            pos = []
            while len(pos) < L:
                pos += list(range(int(torch.randint(2, max(3, L // 2), (1,), generator=g))))
            rows.append(pos[:L])
        batch["position_ids"] = torch.tensor(rows)
    if case.get("padded"):
        mask = torch.ones(B, L, dtype=torch.long)
        mask[0, L - L // 3 :] = 0
        labels[mask == 0] = -100
        batch["attention_mask"] = mask
    if case.get("labels", True):
        batch["labels"] = labels
    return batch


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _build(case):
    model = tiny_model(case["family"], base=case.get("base", False), **case.get("config", {}))
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(case.get("train", True))
    return model


def run_case(case: dict):
    cp = case["cp"]
    batch = make_batch(case)
    ref_model = _build(case)
    # use_cache=False: transformers detects packed documents only without a cache, as in training
    ref_out = ref_model(**batch, use_cache=False)
    weights = torch.randn(ref_out[0].shape, generator=torch.Generator().manual_seed(7))
    ref_loss = ref_out.loss if "labels" in batch else (ref_out[0].float() * weights).sum()
    ref_loss.backward()
    ref_grads = _grads(ref_model)

    model = _build(case)
    hfcp.patch(model, cp_size=cp, strategy=case["strategy"])
    out = model(**batch)
    seq = out.logits if hasattr(out, "logits") else out.last_hidden_state
    full = hfcp.gather_sequence(seq, model)
    if "labels" in batch:
        loss = out.loss
    else:
        loss = (full.float() * weights).sum()
    loss.backward()
    group = hfcp.cp_state(model).mesh.cp_group
    errs = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)), "loss_value": float(loss)}
    valid = batch["attention_mask"].bool()[..., None] if "attention_mask" in batch else torch.ones_like(full[..., :1], dtype=torch.bool)
    ref_seq = ref_out.logits if hasattr(ref_out, "logits") else ref_out.last_hidden_state
    errs["seq"] = _rel(full.detach() * valid, ref_seq.detach() * valid)
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
    worst = 0.0
    for name, g in grads.items():
        dist.all_reduce(g, group=group)
        worst = max(worst, _rel(g / cp, ref_grads[name]))
    errs["grad"] = worst
    errs["n_grads"] = len(grads)
    hfcp.unpatch(model)
    return errs
