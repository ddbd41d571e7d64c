"""Workers for inference calls on a patched model (issue 20): the logits of the last positions only."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.verify import grad_error
from workers_model import averaged_grads, tiny_model


def _model(kind: str):
    if kind == "gemma2":  # logit softcapping after the head, sliding and full layers
        from hfcp.tiny import tiny_model as tiny_of_type

        return tiny_of_type("gemma2").float()
    return tiny_model(kind)


def last_logits(kind: str, keep: int, length: int = 37) -> dict:
    """logits_to_keep=keep on the patched model (cp = world, left padding in row 0) against the unpatched model's
    last `keep` logits: the values on this rank, and the gradients of their sum (averaged over the ranks)."""
    ref, model = _model(kind), _model(kind)
    model.load_state_dict(ref.state_dict())
    vocab = ref.config.vocab_size
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    want = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -keep:]
    want.sum().backward()
    hfcp.patch(model, process_group=dist.group.WORLD)
    try:
        out = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep)
        out.logits.sum().backward()
    finally:
        hfcp.unpatch(model)
    grads = averaged_grads(model)
    return {"shape": tuple(out.logits.shape), "want_shape": tuple(want.shape),
            "err": float((out.logits - want).abs().max() / want.abs().max()),
            "grad_err": grad_error(grads, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}),
            "stamped": getattr(out.logits, "hfcp_step", None) is not None}


def refusal(call: str) -> str:
    """hfcp's message for a logits_to_keep call it refuses."""
    model = hfcp.patch(tiny_model("llama"), process_group=dist.group.WORLD)
    ids = torch.randint(3, 60, (1, 16), generator=torch.Generator().manual_seed(0))
    calls = {"with_labels": lambda: model(input_ids=ids, labels=ids, logits_to_keep=1),
             "negative": lambda: model(input_ids=ids, logits_to_keep=-1)}
    try:
        calls[call]()
        return "ran"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
