"""Vision / video equivalence, run on every rank of a DistPool: patched vs unpatched tiny seeded models."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.tiny_vision import pixel_values, tiny_vision

def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run_case(case: dict):
    family, head, cp = case["family"], case["head"], case["cp"]
    px = pixel_values(family, case.get("B", 2), case.get("size"), case.get("frames"))
    kwargs = {"interpolate_pos_encoding": True} if case.get("interpolate") else {}
    labels = torch.tensor([0, 2, 1][: px.shape[0]])
    weights = None

    def loss_of(out):
        nonlocal weights
        if head == "cls":
            return out.loss
        if weights is None:
            weights = torch.randn(out.last_hidden_state.shape, generator=torch.Generator().manual_seed(9))
        full = hfcp.gather_sequence(out.last_hidden_state, model) if hfcp.cp_state(model) else out.last_hidden_state
        extra = out.pooler_output.sum() if getattr(out, "pooler_output", None) is not None else 0
        return (full * weights).sum() + extra, full

    ref = tiny_vision(family, head, **case.get("config", {}))
    model = ref
    ref_out = ref(px, labels=labels, **kwargs) if head == "cls" else ref(px, **kwargs)
    ref_loss = loss_of(ref_out)
    ref_seq = None
    if head != "cls":
        ref_loss, ref_seq = ref_loss
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    model = tiny_vision(family, head, **case.get("config", {}))
    hfcp.patch(model, cp_size=cp, strategy=case["strategy"])
    out = model(px, labels=labels, **kwargs) if head == "cls" else model(px, **kwargs)
    errs = {}
    if head == "cls":
        loss = out.loss
        errs["logits"] = _rel(out.logits.detach(), ref_out.logits.detach())
        errs["logits_value"] = out.logits.detach().sum().item()
    else:
        loss, full = loss_of(out)
        errs["seq"] = _rel(full.detach(), ref_seq.detach())
        errs["local_len"] = out.last_hidden_state.shape[1]
        if getattr(ref_out, "pooler_output", None) is not None:
            errs["pooler"] = _rel(out.pooler_output.detach(), ref_out.pooler_output.detach())
    loss.backward()
    errs["loss"] = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    errs["loss_value"] = float(loss)
    group = hfcp.cp_state(model).mesh.cp_group
    # k_proj.bias has an exactly-zero true gradient (softmax ignores a shift shared by all keys): compare
    # every gradient relative to max(its own size, 1e-4 of the largest gradient) so float noise is not "error"
    floor = 1e-4 * max(float(g.abs().max()) for g in ref_grads.values())
    worst = 0.0
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        e = float((g / cp - ref_grads[n]).abs().max()) / max(float(ref_grads[n].abs().max()), floor)
        if e > 1e-5:
            errs.setdefault("bad", []).append((n, e))
        worst = max(worst, e)
    errs["grad"] = worst
    errs["n_grads"] = sum(p.grad is not None for p in model.parameters())
    errs["n_ref_grads"] = len(ref_grads)
    hfcp.unpatch(model)
    return errs


def checkpoint_recompute_after_later_forward(cp: int):
    """Gradient-checkpointed ViT: forward A (2 images), forward B (3 images), then backward A only. The layers
    of A are recomputed after B's forward; A's gradients must still be exact."""
    px_a, px_b = pixel_values("vit", 2, None, None), pixel_values("vit", 3, None, None) * 0.5
    labels_a, labels_b = torch.tensor([0, 2]), torch.tensor([1, 0, 2])
    ref = tiny_vision("vit", "cls")
    ref.gradient_checkpointing_enable()
    ref(px_a, labels=labels_a).loss.backward()
    model = tiny_vision("vit", "cls")
    model.gradient_checkpointing_enable()
    hfcp.patch(model, cp_size=cp, strategy="ring")
    loss_a = model(px_a, labels=labels_a).loss
    model(px_b, labels=labels_b)  # a later forward, never backpropagated
    loss_a.backward()
    group = hfcp.cp_state(model).mesh.cp_group
    worst = 0.0
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        floor = 1e-4 * max(float(q.grad.abs().max()) for q in ref.parameters())
        worst = max(worst, float((g / cp - rp.grad).abs().max()) / max(float(rp.grad.abs().max()), floor))
    hfcp.unpatch(model)
    return worst


def checkpoint_with_other_token_counts(cp: int):
    """Gradient checkpointing, two image sizes whose token counts pad to the same local length (17 and 18 tokens
    at cp=2 both give 9 per rank): a forward of the other size while the first graph is alive is refused; with
    backward in between, both are exact."""
    model = tiny_vision("vit", "cls")
    model.gradient_checkpointing_enable()
    hfcp.patch(model, cp_size=cp, strategy="ring")
    px_a = pixel_values("vit", 2, 32, None)  # 16 patches + CLS = 17 tokens
    px_b = pixel_values("vit", 2, 40, None)[..., :40, :32]  # 5 x 4 = 20 patches + CLS = 21 tokens
    labels = torch.tensor([0, 2])
    loss_a = model(px_a, labels=labels, interpolate_pos_encoding=True).loss
    try:
        model(px_b, labels=labels, interpolate_pos_encoding=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    loss_a.backward()
    del loss_a
    model(px_b, labels=labels, interpolate_pos_encoding=True).loss.backward()  # after backward: allowed
    hfcp.unpatch(model)
    return refused
