"""Chunked loss: same loss and gradients as the logits path, and no (tokens x vocab) logits beyond a chunk."""
from __future__ import annotations

import torch.distributed as dist

import hfcp
from hfcp.patch import find_pretrained
from workers_model import _build, _grads, _rel, make_batch


def chunked_vs_logits(case: dict, chunk: int):
    batch = make_batch(case)
    results = {}
    for name, loss_chunk in (("logits", None), ("chunked", chunk)):
        model = _build(case)
        hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"], loss_chunk=loss_chunk)
        head = find_pretrained(model).get_output_embeddings()
        rows = []
        # rows of real logits each call of the head produced (the replaced call returns a (B, L, 0) stand-in)
        spy = head.register_forward_hook(lambda m, args, out: rows.append(out.numel() // max(out.shape[-1], 1)
                                                                          if out.shape[-1] else 0))
        out = model(**batch)
        out.loss.backward()
        spy.remove()
        grads = _grads(model)
        for g in grads.values():
            dist.all_reduce(g)
        results[name] = (out.loss.detach(), grads, out.logits is None, max(rows) if rows else 0)
        hfcp.unpatch(model)
    (l0, g0, none0, _), (l1, g1, none1, rows1) = results["logits"], results["chunked"]
    return {
        "loss": float((l1 - l0).abs() / l0.abs()),
        "grad": max(_rel(g1[n], g0[n]) for n in g0),
        "same_keys": g0.keys() == g1.keys(),
        "logits_none": none1 and not none0,
        "max_rows_per_head_call": rows1,
    }
