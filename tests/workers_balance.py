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
