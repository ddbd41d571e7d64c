"""Chunked loss: same loss and gradients as the logits path, and no (tokens x vocab) logits beyond a chunk."""
from __future__ import annotations

import torch
import torch.distributed as dist

from torch.utils._python_dispatch import TorchDispatchMode

import hfcp
from workers_model import _build, _grads, _rel, make_batch

VOCAB = 97


class LargestLogits(TorchDispatchMode):
    """Records the most rows of any new tensor (not a view, such as the head's weight.t()) an op produces whose
    last dim is the vocabulary size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def chunked_vs_logits(case: dict, chunk: int):
    """vocab 97 (no other dim of the tiny model has that size), so every (rows x vocab) tensor is a logits one."""
    case = {**case, "config": {**case.get("config", {}), "vocab_size": VOCAB}}
    batch = make_batch(case)
    results = {}
    for name, loss_chunk in (("logits", None), ("chunked", chunk)):
        model = _build(case)
        hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"], loss_chunk=loss_chunk)
        with LargestLogits(VOCAB) as spy:  # forward and backward: no logits larger than a chunk in either
            out = model(**batch)
            out.loss.backward()
        grads = _grads(model)
        for g in grads.values():
            dist.all_reduce(g)
        results[name] = (out.loss.detach(), grads, out.logits is None, spy.rows)
        hfcp.unpatch(model)
    (l0, g0, none0, rows0), (l1, g1, none1, rows1) = results["logits"], results["chunked"]
    return {
        "loss": float((l1 - l0).abs() / l0.abs()),
        "grad": max(_rel(g1[n], g0[n]) for n in g0),
        "same_keys": g0.keys() == g1.keys(),
        "logits_none": none1 and not none0,
        "max_logit_rows": rows1,
        "max_logit_rows_unchunked": rows0,
    }


def auto_default(case: dict):
    """hfcp.patch's default loss_chunk="auto": chunked (no logits) in training forwards, logits otherwise;
    the same loss either way; hfcp_loss_chunk= sets one forward's chunk and is checked."""
    batch = make_batch(case)
    model = _build(case)
    hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"])
    train = model(**batch)
    with torch.no_grad():
        no_grad = model(**batch)
    model.eval()
    evaluated = model(**batch)
    chunked_once = model(**batch, hfcp_loss_chunk=8)  # a per-call setting (what HfcpTrainer's evaluation passes)
    after = model(**batch)  # the next forward: the patch's setting again
    try:
        model(**batch, hfcp_loss_chunk=0)
        refused = ""
    except ValueError as e:
        refused = str(e)
    hfcp.unpatch(model)
    ref = _build(case)
    hfcp.patch(ref, cp_size=case["cp"], strategy=case["strategy"], loss_chunk=None)
    ref_loss = ref(**batch).loss
    hfcp.unpatch(ref)
    return {
        "train_logits_none": train.logits is None,
        "no_grad_logits": tuple(no_grad.logits.shape),
        "eval_logits": tuple(evaluated.logits.shape),
        "per_call_logits_none": chunked_once.logits is None, "after_logits": tuple(after.logits.shape),
        "per_call_refused": refused,
        "loss": max(float((x.loss - ref_loss).abs() / ref_loss.abs())
                    for x in (train, no_grad, evaluated, chunked_once)),
    }
