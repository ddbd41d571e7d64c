"""Workers for the adversarial-probe regressions (issue 13): each returns what every rank saw."""
from __future__ import annotations

import datetime
import math
import random

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.compare import grad_error
from workers_model import make_batch, tiny_model

BOUND_S = 20  # every patched model here bounds its collectives: a regression shows as CollectiveError, not a hang


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _avg(grads):
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def compare(batch: dict, strategy="ring", loss_chunk="auto", dtype=None, autocast=None, family="llama", **extra):
    """Unpatched vs patched (train mode) on the same batch and loss keywords: losses (NaN-aware) and grads."""
    ctx = ((lambda: torch.autocast("cpu", dtype=autocast)) if autocast
           else (lambda: torch.autocast("cpu", enabled=False)))
    ref = tiny_model(family)
    model = tiny_model(family)
    if dtype is not None:
        ref, model = ref.to(dtype), model.to(dtype)
    with ctx():
        ref_loss = ref(**batch, **extra, use_cache=False).loss
    ref_loss.backward()
    hfcp.patch(model, strategy=strategy, loss_chunk=loss_chunk, timeout=BOUND_S)
    with ctx():
        loss = model(**batch, **extra).loss
    loss.backward()
    got, want = _avg(_grads(model)), _grads(ref)
    nan = math.isnan(loss.item()), math.isnan(ref_loss.item())
    finite = all(bool(torch.isfinite(g).all()) for g in got.values())
    worst = grad_error(got, want)  # with a floor: q/k gradients are float noise when every query sees one key
    loss_err = 0.0 if all(nan) else abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
    hfcp.unpatch(model)
    return {"nan": nan, "loss_err": loss_err, "grad_err": worst, "finite": finite,
            "same_keys": got.keys() == want.keys(), "loss_dtype": str(loss.dtype)}


def no_target(kind: str, loss_chunk):
    case = dict(B=2, L=1 if kind == "L1" else 12)
    batch = make_batch(case)
    batch["labels"][:] = -100
    return compare(batch, loss_chunk=loss_chunk)


def loss_keywords(kind: str, loss_chunk, strategy="ring"):
    batch = make_batch(dict(B=2, L=19))
    extra = {}
    if kind == "ignore_index":
        batch["labels"][batch["labels"] == -100] = 7  # token 7 is ignored as well as the original -100 spans
        batch["labels"][:, :4] = -1
        extra["ignore_index"] = -1
        batch["labels"][batch["labels"] == 7] = -1
    elif kind == "shift_labels":  # targets of the caller's own choosing (not labels shifted by one)
        g = torch.Generator().manual_seed(5)
        extra["shift_labels"] = torch.randint(0, 64, (2, 19), generator=g)
        extra["shift_labels"][0, 10:] = -100
    elif kind == "num_items":
        extra["num_items_in_batch"] = torch.tensor(50)
    return compare(batch, strategy=strategy, loss_chunk=loss_chunk, **extra)


def _raises(fn, *errors):
    try:
        fn()
    except errors as e:
        return f"{type(e).__name__}: {e}"
    return None


def bad_values_in_one_shard(kind: str, loss_chunk):
    """The bad element lies in rank 1's shard only; every rank must raise the same clear error, no hang."""
    model = hfcp.patch(tiny_model("llama"), loss_chunk=loss_chunk, timeout=BOUND_S)
    batch = make_batch(dict(B=2, L=16))
    where = (1, 5)  # zigzag cp=2 over 16 tokens: rank 1 holds 4..11
    if kind == "label_too_big":
        batch["labels"][where] = 64
    elif kind == "label_negative":
        batch["labels"][where] = -5
    elif kind == "token_too_big":
        batch["input_ids"][where] = 1000
    elif kind == "label_minus_100_with_other_ignore_index":
        batch["labels"][where] = -100
        batch["labels"][batch["labels"] == -100] = -100
        return _raises(lambda: model(**batch, ignore_index=-1).loss.backward(), ValueError)
    return _raises(lambda: model(**batch).loss.backward(), ValueError)


def batch_differs(kind: str):
    """Differences the old sum-and-two-samples fingerprint missed; rank 1 gets the edited batch."""
    model = hfcp.patch(tiny_model("llama"), timeout=BOUND_S)
    batch = make_batch(dict(B=2, L=30))
    batch["attention_mask"] = torch.ones(2, 30, dtype=torch.long)
    if dist.get_rank() == 1:
        if kind == "swap_tokens":
            ids = batch["input_ids"]
            a, b = 1, 2  # outside the old strided samples [::7] and [5::13]
            ids[0, a], ids[0, b] = int(ids[0, b]), int(ids[0, a])
            assert not torch.equal(ids, make_batch(dict(B=2, L=30))["input_ids"]), "the swap must change the batch"
        elif kind == "compensating_mask":
            batch["attention_mask"][0, 3] = 0
            batch["attention_mask"][0, 4] = 2
        elif kind == "dtype":
            batch["attention_mask"] = batch["attention_mask"].float()
    return _raises(lambda: model(**batch), ValueError)


def misuse(kind: str):
    model = hfcp.patch(tiny_model("llama"), loss_chunk=None, timeout=BOUND_S)
    batch = make_batch(dict(B=2, L=16))
    if kind == "set_attn_implementation":
        model.set_attn_implementation("sdpa")
        return _raises(lambda: model(**batch), RuntimeError)
    if kind == "inner_model":
        return _raises(lambda: model.model(input_ids=batch["input_ids"]), RuntimeError)
    if kind == "gather_stale":
        old = model(**batch).logits
        model(**make_batch(dict(B=2, L=15)))  # pads to 16: the same local length, another layout
        return _raises(lambda: hfcp.gather_sequence(old, model), ValueError)
    if kind == "gather_dim0":
        logits = model(**make_batch(dict(B=8, L=16))).logits  # batch 8 == local length 8
        return _raises(lambda: hfcp.gather_sequence(logits, model, dim=0), ValueError)
    if kind == "gather_ok":
        out = model(**batch)
        return tuple(hfcp.gather_sequence(out.logits, model).shape)
    if kind == "gather_outputs_before_forward":  # an output from before patching: nothing to gather it with
        return _raises(lambda: hfcp.gather_outputs((torch.zeros(2, 8, 64),), model), RuntimeError)
    if kind == "gather_sequence_before_forward":
        return _raises(lambda: hfcp.gather_sequence(torch.zeros(2, 8, 64), model), RuntimeError)
    calls = {
        "logits_to_keep_tensor": lambda: model(**batch, logits_to_keep=torch.arange(16)),
        "input_ids_1d": lambda: model(input_ids=batch["input_ids"][0], labels=batch["labels"][0]),
        "float_labels": lambda: model(input_ids=batch["input_ids"], labels=batch["labels"].float()),
        "fused_lm_head": lambda: model(**batch, fused_lm_head=True),
        "cu_seq_lens_mismatch": lambda: model(input_ids=batch["input_ids"][:1], position_ids=torch.arange(16)[None],
                                              cu_seq_lens_q=torch.tensor([0, 5, 16]), labels=batch["labels"][:1]),
    }
    return _raises(calls[kind], ValueError)


def patch_misuse(kind: str):
    if kind == "repatch_timeout":
        model = hfcp.patch(tiny_model("llama"), timeout=30)
        same = hfcp.patch(model, timeout=30.0) is model  # the same settings: a no-op
        return same, _raises(lambda: hfcp.patch(model, timeout=60), ValueError)
    if kind == "check_inputs_str":
        return _raises(lambda: hfcp.patch(tiny_model("llama"), check_inputs="no"), ValueError)
    if kind == "group_without_me":
        group = dist.new_group([0])  # every rank creates it; rank 1 is not a member
        return _raises(lambda: hfcp.patch(tiny_model("llama"), process_group=group), ValueError)
    if kind.startswith("timeout_"):
        value = {"timeout_inf": math.inf, "timeout_zero": datetime.timedelta(0), "timeout_negative": -3,
                 "timeout_nan": math.nan}[kind]
        return _raises(lambda: hfcp.patch(tiny_model("llama"), timeout=value), ValueError)
    raise KeyError(kind)


def precision(kind: str, strategy: str):
    batch = make_batch(dict(B=2, L=21, packed=True))
    if kind == "float64":
        return compare(batch, strategy=strategy, dtype=torch.float64)
    return compare(batch, strategy=strategy, autocast={"bf16": torch.bfloat16, "fp16": torch.float16}[kind])


def odd_batches(n: int, seed: int):
    """A seeded sweep over label / mask / position oddities (default chunked loss, train mode)."""
    rng = random.Random(seed)
    results = []
    for _ in range(n):
        B, L = rng.randint(1, 3), rng.choice([1, 2, 3, rng.randint(4, 40)])
        batch = make_batch(dict(B=B, L=L, seed=rng.randint(0, 10**6)))
        labels, extra, notes = batch["labels"], {}, []
        draw = rng.random()
        if draw < 0.2:
            labels[rng.randrange(B)] = -100  # a row without targets
            notes.append("row without targets")
        elif draw < 0.3:
            labels[:] = -100
            notes.append("no targets")
        elif draw < 0.45:
            labels[:, rng.randrange(L):] = -100
            notes.append("truncated completion")
        if rng.random() < 0.3:  # padding, with its labels ignored
            mask = torch.ones(B, L, dtype=torch.long)
            cut = rng.randint(0, max(L - 1, 0))
            mask[0, (L - cut):] = 0 if rng.random() < 0.5 else mask[0, (L - cut):]
            if rng.random() < 0.5:
                mask[0, :cut] = 0
            mask[:, 0 if rng.random() < 0.5 else L - 1] = 1  # never a row without any valid key
            labels[mask == 0] = -100
            batch["attention_mask"] = mask
            notes.append("padding")
        elif rng.random() < 0.5:  # packed or odd position ids
            pos = torch.arange(L)[None].repeat(B, 1)
            for b in range(B):
                for cut in sorted(rng.sample(range(L), k=min(L, rng.randint(0, 3)))):
                    pos[b, cut:] -= pos[b, cut] - rng.choice([0, 0, 3])  # resets, or a jump to 3
            batch["position_ids"] = pos + rng.choice([0, 0, 5])
            notes.append("positions")
        if rng.random() < 0.25:
            extra["num_items_in_batch"] = torch.tensor(rng.randint(1, 60))
            notes.append("num_items")
        strategy = rng.choice(["ring", "allgather"] + (["ulysses"] if dist.get_world_size() == 2 else []))
        r = compare(batch, strategy=strategy, family=rng.choice(["llama", "mistral"]), **extra)
        results.append(({"B": B, "L": L, "strategy": strategy, "notes": notes}, r))
    return results
