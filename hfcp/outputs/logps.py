"""Per-sequence log-probabilities of given target tokens (what DPO, KTO, GRPO read) without whole logits.

`sequence_logps` runs a causal LM to its last hidden states (head_input.py), then takes log p(target) chunk by chunk
through the head (target_logps.py). Under CP the hidden states and targets are this rank's tokens; each row's sum is
all-reduced over the CP group.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..distributed.input_checks import check_same_batch
from ..distributed.collectives import all_reduce_sum
from ..state import cp_state, find_pretrained
from .head_input import last_hidden_states, output_head, shifted_targets
from ..loss.linear_ce import IGNORE_INDEX
from ..loss.target_logps import target_logps, with_temperature

# model keywords sequence_logps sets itself or that would make the model compute (or keep) logits
_OWN_KEYWORDS = ("labels", "shift_labels", "logits_to_keep", "num_items_in_batch", "hfcp_loss_chunk",
                 "hfcp_token_stats")


@dataclass
class SequenceLogps:
    """What `sequence_logps` returns.

    sums: (B,) fp32, each row's sum of log p(target) over its counted targets; the same on every rank of a CP group,
        differentiable.
    counts: (B,) int64, each row's number of counted targets; the same on every rank.
    token_logps: (B, L_local) fp32, this rank's tokens: position i holds log p(labels[:, i + 1]) given the tokens up
        to i, 0 where that target is not counted. `hfcp.gather_sequence(token_logps, model)` gives (B, L).
    token_mask: (B, L_local) bool, the positions whose target is counted (in the same layout).
    output: the model's output, without logits (its other fields: an MoE model's aux_loss, say).
    """

    sums: torch.Tensor
    counts: torch.Tensor
    token_logps: torch.Tensor
    token_mask: torch.Tensor
    output: object = None

    @property
    def means(self) -> torch.Tensor:
        """(B,) sums / counts (0 for a row without a counted target)."""
        return self.sums / self.counts.clamp_min(1).to(self.sums)


def _check_wrappers(model) -> None:
    """DDP looking for unused parameters marks the output head unused when the forward returns (hfcp runs the head
    after it), then fails in backward when the head's gradient arrives; refused before it starts."""
    m = model
    for _ in range(8):
        if isinstance(m, torch.nn.parallel.DistributedDataParallel) and m.find_unused_parameters:
            raise ValueError("hfcp.sequence_logps runs the output head after the model's forward, which "
                             "DistributedDataParallel(find_unused_parameters=True) takes for unused (its backward then "
                             "fails); wrap the model with find_unused_parameters=False (with a Trainer: "
                             "ddp_find_unused_parameters=False)")
        m = getattr(m, "module", None)
        if not isinstance(m, torch.nn.Module):
            return


def _check_options(temperature, chunk, model_kwargs: dict) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be a positive number")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive number of tokens")
    given = [k for k in _OWN_KEYWORDS if k in model_kwargs]
    if given:
        raise ValueError(f"hfcp.sequence_logps got {given}: pass the targets as labels= (and mask=); it computes no "
                         "loss and no logits")


def _tokens_and_labels(input_ids, labels, model_kwargs: dict):
    """(input_ids or inputs_embeds, labels: input_ids when not given)."""
    x = input_ids if input_ids is not None else model_kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError("hfcp.sequence_logps needs input_ids or inputs_embeds")
    if labels is None:
        if input_ids is None:
            raise ValueError("hfcp.sequence_logps needs labels= when the model gets inputs_embeds")
        labels = input_ids
    return x, labels


def sequence_logps(model, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                   temperature: float = 1.0, chunk: int = 1024, **model_kwargs) -> SequenceLogps:
    """Each row's sum and count of log p(target token) of a causal LM, computed chunk by chunk from its last hidden
    states: (tokens x vocab) logits never exist beyond `chunk` tokens, in forward or backward.

    Works on a patched model (each rank computes its tokens' terms; the sums are all-reduced over the CP group) and
    on an unpatched one (the single-device values), PEFT-wrapped or not, with gradient checkpointing.

    Args:
        model: a transformers causal LM (optionally PEFT / DDP-wrapped), patched or not.
        input_ids: (B, L), the full sequence (the same on every rank of a CP group), as for the model's forward.
        labels: (B, L) target tokens, shifted as the LM loss shifts them: token i is scored on labels[:, i + 1];
            -100 is not a target. Default: input_ids.
        attention_mask: (B, L) as for the model; a padding token (0) is never a target.
        mask: optional (B, L) bool or 0/1, aligned with labels: which targets count (a completion mask).
        temperature: the logits (after the model's own scale / softcap) are divided by it before the log-softmax.
        chunk: tokens per chunk through the output head.
        **model_kwargs: the model's other inputs (position_ids for packed rows, inputs_embeds, ...).

    Returns:
        SequenceLogps: sums (B,) and counts (B,), whole and identical on every rank; the gradient of any function
        of the sums, averaged over the CP group as DDP does, is the single-device one. token_logps / token_mask:
        this rank's tokens (hfcp.gather_sequence gives the whole sequence).

    Raises:
        ValueError, on every rank before any collective: not a causal LM, a vision-language model, an output head
            hfcp cannot read (an unrecognised logit transform, a tensor-parallel head), DDP with
            find_unused_parameters=True, labels / logits_to_keep /
            hfcp_loss_chunk among model_kwargs, a bad temperature or chunk; after the same-batch check: no input_ids
            nor inputs_embeds, inputs_embeds without labels, labels or mask of the wrong shape, a label outside the
            vocabulary, a mask with values other than 0 / 1, ranks of a CP group with different labels or mask.
    """
    inner = find_pretrained(model)
    state = cp_state(inner)
    head, transform = output_head(inner, state)
    _check_wrappers(model)
    _check_options(temperature, chunk, model_kwargs)
    if state is not None and state.check_inputs:  # the model's hook checks its inputs' values; these, what it cannot
        seen = {"logps labels": labels, "logps mask": mask, "logps inputs": (input_ids is None, sorted(model_kwargs))}
        check_same_batch(seen, state.mesh.cp_group, tuple(seen))
    targets = shifted_targets(inner, *_tokens_and_labels(input_ids, labels, model_kwargs), mask, attention_mask)
    kwargs = {**model_kwargs, "input_ids": input_ids, "attention_mask": attention_mask}
    if "use_cache" in inspect.signature(type(inner).forward).parameters:
        kwargs.setdefault("use_cache", False)
    hidden, output = last_hidden_states(model, head, {k: v for k, v in kwargs.items() if v is not None})
    local = targets if state is None else state.step.local(targets, fill=IGNORE_INDEX)  # (B, L_local)
    B, n = local.shape
    if tuple(hidden.shape[:2]) != (B, n):
        raise RuntimeError(f"{type(inner).__name__} passed hidden states of shape {tuple(hidden.shape)} to its output "
                           f"head; hfcp.sequence_logps expected ({B}, {n}, hidden)")
    local = local.to(hidden.device)
    token = target_logps(hidden.reshape(B * n, -1), local.reshape(-1), head, chunk,
                         with_temperature(transform, float(temperature))).view(B, n)
    sums = token.sum(1)  # (B,)
    if state is not None:
        sums = all_reduce_sum(sums, state.mesh.cp_group)
        token.hfcp_step = state.step  # hfcp.gather_sequence refuses it after the next forward
    counts = (targets != IGNORE_INDEX).sum(1).to(hidden.device)
    return SequenceLogps(sums, counts, token, local != IGNORE_INDEX, output)
