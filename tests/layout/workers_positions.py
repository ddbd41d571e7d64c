"""Workers for per-token inputs the family reads (issue 22, item 3): positions from the attention mask (OPT), RoPE
whose frequencies follow the largest position (longrope, dynamic NTK), token_type_ids. Patched (cp 2) against the
unpatched model on the same batch: loss and every gradient."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.tiny import tiny_model
from hfcp.testing.compare import grad_error


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model_type: str, batch: dict, strategy: str = "ring", config: dict | None = None, steps: int = 1) -> dict:
    """Loss and worst gradient error of each of `steps` forwards (the batch's length grows by 8 per step when
    steps > 1: dynamic RoPE keeps state between calls)."""
    ref, model = tiny_model(model_type), tiny_model(model_type)
    for m in (ref, model):
        for k, v in (config or {}).items():
            setattr(m.config, k, v)
            setattr(m.config.get_text_config(), k, v)
        for mod in m.modules():  # rotary modules read rope_parameters at init: rebuild them from the new config
            if hasattr(mod, "rope_type") and hasattr(mod, "inv_freq") and config:
                mod.__init__(m.config)
    hfcp.patch(model, strategy=strategy, timeout=20)
    out = []
    try:
        for step in range(steps):
            L = batch["input_ids"].shape[1] - 8 * (steps - 1 - step)
            b = {k: v[:, :L] for k, v in batch.items()}
            ref.zero_grad(), model.zero_grad()
            want = ref(**b, use_cache=False).loss
            want.backward()
            got = model(**b).loss
            got.backward()
            grads = _grads(model)
            for g in grads.values():
                dist.all_reduce(g)
                g /= dist.get_world_size()
            out.append({"loss_err": abs(got.item() - want.item()) / want.item(),
                        "grad_err": grad_error(grads, _grads(ref))})
    finally:
        hfcp.unpatch(model)
    return {"steps": out, "loss": want.item()}


def batch(kind: str, L: int = 40, vocab: int = 96) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (2, L), generator=g)
    labels = ids.clone()
    b = {"input_ids": ids, "labels": labels}
    if kind in ("left_padding", "holes"):
        mask = torch.ones_like(ids)
        # left padding of row 0; its first valid token is no target (docs/reference/limitations.md: padding query rows)
        mask[0, :7] = 0
        labels[0, :8] = -100
        if kind == "holes":
            mask[1, 10:13] = 0
            labels[1, 10:14] = -100
        b["attention_mask"] = mask
    if kind == "token_types":
        b["token_type_ids"] = (torch.arange(L) >= L // 3).long()[None].expand(2, -1).clone()
    return b


def run(model_type: str, kind: str, strategy: str = "ring", config: dict | None = None, steps: int = 1, L: int = 40):
    return compare(model_type, batch(kind, L), strategy, config, steps)
