"""Chunked loss: same loss and gradients as the logits path, and no (tokens x vocab) logits beyond a chunk."""
from __future__ import annotations

import torch
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


def auto_default(case: dict):
    """hfcp.patch's default loss_chunk="auto": chunked (no logits) in training forwards, logits otherwise;
    the same loss either way."""
    batch = make_batch(case)
    model = _build(case)
    hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"])
    train = model(**batch)
    with torch.no_grad():
        no_grad = model(**batch)
    model.eval()
    evaluated = model(**batch)
    hfcp.unpatch(model)
    ref = _build(case)
    hfcp.patch(ref, cp_size=case["cp"], strategy=case["strategy"], loss_chunk=None)
    ref_loss = ref(**batch).loss
    hfcp.unpatch(ref)
    return {
        "train_logits_none": train.logits is None,
        "no_grad_logits": tuple(no_grad.logits.shape),
        "eval_logits": tuple(evaluated.logits.shape),
        "loss": max(float((x.loss - ref_loss).abs() / ref_loss.abs()) for x in (train, no_grad, evaluated)),
    }
