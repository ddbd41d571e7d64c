"""Classification heads over a causal LM's sequence whose pooling and loss hfcp reproduces under CP: transformers'
generic heads, and sequence classifiers with a forward of their own registered by patches/ (model knowledge). Their
hook is hfcp/hooks/heads.py."""
from __future__ import annotations

import torch
from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification

from .registry import UnsupportedModelError
from .source_guard import check_source

# the classes' forwards whose pooling and loss hfcp reproduces -> the module name of their head
SEQUENCE_FORWARDS = {GenericForSequenceClassification.forward: "score"}
TOKEN_FORWARDS = {GenericForTokenClassification.forward: "score"}
_REPRODUCED = {"sequence_classification": (SEQUENCE_FORWARDS, GenericForSequenceClassification,
                                           "score at the last non-pad token"),
               "token_classification": (TOKEN_FORWARDS, GenericForTokenClassification,
                                        "token-mean cross-entropy of its per-token scores")}
# sequence classifiers with a forward of their own that pools as the generic one (GPT-2's), registered by patches/:
# class name -> (head module name, {"Class.forward": source fingerprint}, the transformers version they were read in)
SEQUENCE_HEADS: dict[str, tuple[str, dict, str]] = {}


def register_sequence_head(class_name: str, head: str, fingerprints: dict, verified_with: str) -> None:
    """Accept the sequence classifier `class_name`, whose forward (its source fingerprinted in `fingerprints`, see
    hfcp.families.source_guard) computes `head`'s scores over the sequence and picks them at the last non-pad token
    exactly as transformers' GenericForSequenceClassification does. Raises ValueError for a class registered twice."""
    if class_name in SEQUENCE_HEADS:
        raise ValueError(f"a sequence head is already registered for {class_name}; register each class once")
    SEQUENCE_HEADS[class_name] = (head, dict(fingerprints), verified_with)


def classification_head_name(model, head: str) -> str | None:
    """The module name of `model`'s classification head whose output hfcp pools or takes the loss of (None for the
    other heads).

    Raises:
        UnsupportedModelError: its forward is not one whose pooling and loss hfcp reproduces under CP (transformers'
            GenericForSequenceClassification / GenericForTokenClassification forward, or a registered one whose
            source is the one fingerprinted), or it has no such head module.
    """
    if head not in _REPRODUCED:
        return None
    forwards, generic, what = _REPRODUCED[head]
    name = type(model).__name__
    head_name = forwards.get(getattr(type(model), "forward", None))
    registered = SEQUENCE_HEADS.get(name) if head == "sequence_classification" else None
    if head_name is None and registered is not None:
        head_name, fingerprints, version = registered
        try:
            check_source(model, fingerprints, version)
        except ValueError as e:
            raise UnsupportedModelError(f"{name}: {e}") from None
    if head_name is None:
        raise UnsupportedModelError(
            f"{name}.forward is not transformers' {generic.__name__}.forward, whose {what} hfcp reproduces under CP: "
            f"its own forward may pool or compute its loss otherwise (first token, mean, a custom loss), which "
            "would run on a rank's shard of the sequence. Patch its base model and pool with hfcp.pool_sequence, or "
            "use a model class built on transformers' generic head")
    if not isinstance(getattr(model, head_name, None), torch.nn.Module):
        raise UnsupportedModelError(f"{name} has no {head_name!r} module, the head its forward calls")
    return head_name
