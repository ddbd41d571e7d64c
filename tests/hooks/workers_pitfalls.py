"""Workers for the regression tests of DESIGN.md "What goes wrong elsewhere"."""
from __future__ import annotations

import torch

import hfcp
from workers_model import make_batch, tiny_model


def patched_vs_variants(family: str, batch_case: dict, variants: dict, strategy="ring", cp=2, config=None):
    """Loss of the patched model and of the unpatched model on the batch and on each variant batch."""
    batch = make_batch(batch_case)
    model = tiny_model(family, **(config or {}))
    with torch.no_grad():
        ref = float(model(**batch, use_cache=False).loss)
        others = {name: float(model(**fn(dict(batch)), use_cache=False).loss) for name, fn in variants.items()}
        hfcp.patch(model, cp_size=cp, strategy=strategy)
        got = float(model(**batch).loss)
    hfcp.unpatch(model)
    return {"patched": got, "reference": ref, **others}


def _no_mask(b):
    b.pop("attention_mask")
    return b


def _mask_all_ones(b):  # transformers does not detect packing when a mask is given
    b["attention_mask"] = torch.ones_like(b["input_ids"])
    return b


def dropped_masks():
    return {
        "window": patched_vs_variants("mistral", dict(B=2, L=29), {"no_window": lambda b: b}, config={}),
        "window_ref_without": patched_vs_variants("mistral", dict(B=2, L=29), {}, config={"sliding_window": None}),
        "padding": patched_vs_variants("llama", dict(B=2, L=29, padded="left"), {"no_mask": _no_mask}),
        "packing": patched_vs_variants("llama", dict(B=2, L=29, packed=True), {"cross_docs": _mask_all_ones}),
    }


def uneven_valid_tokens(cp: int, strategy: str):
    """Rank 0 holds almost all valid targets: a per-rank mean of means would be wrong."""
    case = dict(B=2, L=32)
    batch = make_batch(case)
    batch["labels"][:, 3:-6] = -100
    model = tiny_model("llama")
    ref = model(**batch, use_cache=False).loss
    hfcp.patch(model, cp_size=cp, strategy=strategy)
    model.eval()
    with torch.no_grad():
        eval_loss = model(**batch).loss
    model.train()
    loss = model(**batch).loss
    hfcp.unpatch(model)
    return {"ref": float(ref), "train": float(loss), "eval": float(eval_loss)}


def all_padding_rank(cp: int, strategy: str, loss_chunk=None, ddp=False):
    """L=3 over cp=4 (zigzag, 8 slots): rank 3 holds only padding. Loss finite and exact; grads finite.
    With DDP, two steps: DDP fails on the second if a rank left a parameter out of the graph."""
    batch = make_batch(dict(B=1, L=3))
    model = tiny_model("llama")
    ref = float(model(**batch, use_cache=False).loss)
    hfcp.patch(model, cp_size=cp, strategy=strategy, loss_chunk=loss_chunk)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    for _ in range(2 if ddp else 1):
        out = model(**batch)
        out.loss.backward()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    hfcp.unpatch(model)
    return {"ref": ref, "loss": float(out.loss), "grads_finite": finite}


def ring_sends_kv_heads_only():
    """Record the head dimension of every K/V block the ring exchanges."""
    from hfcp.distributed import collectives

    seen = []
    original = collectives.RingComm.exchange

    def spy(self, tensors):
        seen.extend(t.shape[1] for t in tensors)
        return original(self, tensors)

    collectives.RingComm.exchange = spy
    try:
        model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2, head_dim=4)
        hfcp.patch(model, cp_size=2, strategy="ring")
        model(**make_batch(dict(B=1, L=16))).loss.backward()
        hfcp.unpatch(model)
    finally:
        collectives.RingComm.exchange = original
    return sorted(set(seen))


def default_positions_are_global():
    """No position_ids given: RoPE must see global positions (the local slice's positions are not 0..L/cp)."""
    batch = make_batch(dict(B=2, L=20))
    model = tiny_model("llama")
    ref = model(**batch, use_cache=False).logits
    hfcp.patch(model, cp_size=2, loss_chunk=None)
    got = hfcp.gather_sequence(model(**batch).logits, model)
    hfcp.unpatch(model)
    return float((got - ref).abs().max())
