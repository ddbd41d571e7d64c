"""What a causal LM's output head reads and scores, for the losses that run the head themselves
(hfcp.sequence_logps, TRL's fused head under CP): the head and the forward's transform of its output, the shifted
targets, and the hidden states the forward passes to the head (the head's own call replaced by a stand-in that keeps
them and returns no logits).
"""
from __future__ import annotations

import torch
from transformers.models.auto import modeling_auto

from ..distributed.input_checks import check_shapes, check_token_range
from ..distributed.tensor_parallel import is_sharded
from ..families.forward_reading import logit_transform
from ..hooks.batch import check_input_dims, vocab_size
from ..hooks.output_stamps import swap_forward
from ..state import find_pretrained
from ..loss.cross_entropy import shift_labels
from ..loss.linear_ce import IGNORE_INDEX


def _is_causal_lm(model) -> bool:
    names = {c.__name__ for c in type(model).__mro__}  # (FSDP2's dynamic subclass keeps the class in its MRO)
    mapped = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return any(n in names for v in mapped for n in ((v,) if isinstance(v, str) else v))


def output_head(inner, state):
    """(the output head, what the forward does to its output), read from the model; raises on every rank alike
    (before any collective) for a model whose log-probabilities hfcp cannot compute from its hidden states."""
    name = f"{type(inner).__name__} (model_type={inner.config.model_type!r})"
    if inner.config.get_text_config() is not inner.config or (state is not None and state.patcher.language_model):
        raise ValueError(f"hfcp.sequence_logps does not support vision-language models yet; {name} is one. Compute "
                         "log-probabilities from its logits (hfcp.gather_sequence(out.logits, model))")
    if (state is not None and state.head != "causal_lm") or (state is None and not _is_causal_lm(inner)):
        raise ValueError(f"hfcp.sequence_logps needs a causal LM (a *ForCausalLM); {name} is not one")
    head = inner.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"{name} has no output head module (get_output_embeddings() is {head!r})")
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and is_sharded(weight):
        raise ValueError(f"the output head of {name} is sharded (tensor parallel), which hfcp.sequence_logps does not "
                         "split; compute log-probabilities from the model's gathered logits")
    transform = logit_transform(inner)
    if transform is None:
        raise ValueError(f"hfcp cannot read what the forward of {name} does to its logits after the output head "
                         "(a scale or softcap it does not recognise), so hfcp.sequence_logps would skip it; compute "
                         "log-probabilities from the model's logits")
    return head, transform


def shifted_targets(inner, x: torch.Tensor, labels, mask, attention_mask) -> torch.Tensor:
    """(B, L) the target of each token (labels shifted over the whole sequence), IGNORE_INDEX where none is counted:
    labels -100, mask false or the target a padding token (attention_mask 0). Raises alike on every rank."""
    if x.is_floating_point():
        check_input_dims(None, x)  # inputs_embeds
    else:
        check_input_dims(x, None)
    check_shapes({"labels": labels, "attention_mask": attention_mask}, *x.shape[:2])
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(labels.shape):
            raise ValueError(f"mask has shape {tuple(getattr(mask, 'shape', ()))}; pass a (batch, seq) = "
                             f"{tuple(labels.shape)} mask of the targets (1: counted, 0: not)")
        if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"mask has values other than 0 and 1 ({mask[(mask != 0) & (mask != 1)][0].item()!r}); "
                             "pass a bool or 0/1 mask (weights are not supported)")
    counted = labels != IGNORE_INDEX
    for m in (mask, attention_mask):
        if m is not None:
            counted = counted & (m.to(labels.device) != 0)
    labels = labels.masked_fill(~counted, IGNORE_INDEX)
    check_token_range("labels[:, 1:]", labels[:, 1:], vocab_size(inner, "output"), IGNORE_INDEX)
    return shift_labels(labels)


def last_hidden_states(model, head, kwargs: dict):
    """(the hidden states the model's forward passes to its output head, its output without logits): the head is
    replaced for this call by a stand-in that keeps them and returns (B, L, 0) logits."""
    kept = []

    def keep(hidden, *args, **kw):
        restore()
        kept.append(hidden)
        return hidden.new_zeros(*hidden.shape[:-1], 0)  # no logits

    restore = swap_forward(head, keep)
    try:
        output = model(**kwargs)
    finally:
        restore()
    if not kept:
        raise RuntimeError(f"{type(find_pretrained(model)).__name__} did not call its output head module, so "
                           "hfcp.sequence_logps found no hidden states; compute log-probabilities from its logits")
    if not isinstance(output, tuple) and "logits" in output:
        output = type(output)(**{k: v for k, v in output.items() if k != "logits"})
    return kept[0], output
