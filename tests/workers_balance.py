"""Balanced layouts on a DistPool: what hfcp.balance_report reads from a patched model."""
from __future__ import annotations

import torch

import hfcp
from workers_model import tiny_model


def report_of_patched(strategy: str, balance: str = "auto") -> tuple[dict, dict]:
    """(report of the patched model, report of the same model unpatched with cp_size = the world)."""
    model = tiny_model("mistral")
    pos = torch.cat([torch.arange(n) for n in (40, 6, 9, 17)])[None]
    ids = torch.randint(0, 64, pos.shape, generator=torch.Generator().manual_seed(0))
    before = hfcp.balance_report(model, cp_size=torch.distributed.get_world_size(), input_ids=ids, position_ids=pos)
    hfcp.patch(model, strategy=strategy, balance=balance)
    try:
        return hfcp.balance_report(model, input_ids=ids, position_ids=pos), before
    finally:
        hfcp.unpatch(model)


def family_exact(model_type: str, strategy: str, documents: list[list[int]], balance: str = "auto") -> dict:
    """Patched (balance="auto") vs unpatched on packed rows of these documents, for a family of hfcp's tiny models
    (Gemma 2: softcaps and sliding windows): loss, gathered logits, every
    gradient (averaged over the group), and whether the balanced layout ran."""
    import torch.distributed as dist

    from hfcp.commands.verify import grad_error
    from hfcp.testing.tiny import tiny_model as hfcp_tiny

    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    ids = torch.randint(3, 96, pos.shape, generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :2] = -100
    data = {"input_ids": ids, "labels": labels, "position_ids": pos}
    ref, model = hfcp_tiny(model_type), hfcp_tiny(model_type)
    want = ref(**data, use_cache=False)
    want.loss.backward()
    hfcp.patch(model, strategy=strategy, loss_chunk=None, balance=balance)
    try:
        got = model(**data)
        got.loss.backward()
        logits = hfcp.gather_sequence(got.logits, model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
            g /= dist.get_world_size()
        return {"loss": abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()),
                "logits": float((logits - want.logits).detach().abs().max() / want.logits.detach().abs().max()),
                "grad": grad_error(grads, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}),
                "balanced": hfcp.cp_state(model).step.layout.balanced}
    finally:
        hfcp.unpatch(model)
