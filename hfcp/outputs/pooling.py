"""Sequence-level outputs of a patched model: a vector pooled over the whole sequence (an embedder's mean or last
token, a sequence classifier's score at its last non-pad token), computed where its tokens live and summed over the
CP group by an autograd-aware all-reduce, so that every rank holds it whole and identical.

Gradients follow hfcp's convention (docs/concepts/exactness.md): every rank computes the same objective from the
pooled vector, the all-reduce's backward sums the ranks' gradients, and the mean of a parameter's gradient over the
CP group is the single-device gradient.
"""
from __future__ import annotations

import torch

from ..distributed.collectives import all_reduce_sum, pick_global_rows
from ..state import cp_state

POOLINGS = ("mean", "last")


def pool_sequence(hidden_states: torch.Tensor, model, attention_mask: torch.Tensor | None = None,
                  how: str = "mean") -> torch.Tensor:
    """The (B, H) vector pooled over each row's whole sequence, from a patched model's local last hidden states,
    whole and identical on every rank of the CP group and differentiable. On an unpatched model (one process) the
    same pooling of the whole `hidden_states`: a script pools the same way with and without CP.

    Only valid tokens count (attention_mask 1); the padding hfcp adds to make the length divide never does.

    Args:
        hidden_states: (B, L/cp, H) a sequence output of the model's latest forward (its last_hidden_state), or
            (B, L, H) on an unpatched model.
        model: the model (PEFT / DDP wrappers are looked through).
        attention_mask: (B, L) the whole batch's mask (1: a valid token), the one the forward was given; None:
            every token of the sequence is valid.
        how: "mean": the mean over the valid tokens (a row without any gives zeros); "last": the rightmost valid
            token (the last token for left padding, the last before the padding for right padding).
    Returns:
        (B, H) in hidden_states' dtype (the mean is summed in fp32).
    Raises:
        ValueError: an unknown `how`, a mask of another shape, or hidden states that are not the latest forward's
            sequence output.
    """
    if how not in POOLINGS:
        raise ValueError(f"how={how!r} is not one of {POOLINGS}")
    state = cp_state(model)
    if state is None or state.step is None or not _is_local(hidden_states, state):
        if state is not None and getattr(hidden_states, "hfcp_step", None) is not None:
            raise ValueError("pool_sequence got an output of an earlier forward; the layout is per step, so pool each "
                             "output before the next forward of the model")
        return _pool_whole(hidden_states, attention_mask, how)
    step = state.step
    B, seq_len = hidden_states.shape[0], step.layout.seq_len
    valid = _valid_tokens(attention_mask, B, seq_len, hidden_states.device)  # (B, L) bool, whole sequence
    if how == "last":
        return pick_global_rows(hidden_states, _rightmost(valid), step, state.mesh.cp_group)
    local = step.local(valid, fill=False).to(hidden_states.device)  # (B, L/cp): padding of hfcp's is False
    total = (hidden_states.float() * local[..., None]).sum(1)  # (B, H) this rank's tokens
    count = valid.sum(1, keepdim=True).clamp_min(1).to(total)
    return (all_reduce_sum(total, state.mesh.cp_group) / count).to(hidden_states.dtype)


def _is_local(hidden_states: torch.Tensor, state) -> bool:
    """Whether `hidden_states` is a local sequence of the latest forward: stamped with its step, or (without the
    stamp: a tensor derived from one) of the local length where the whole length differs."""
    stamp = getattr(hidden_states, "hfcp_step", None)
    if stamp is not None:
        return stamp is state.step
    layout = state.step.layout
    if hidden_states.dim() != 3:
        raise ValueError(f"pool_sequence needs (batch, seq, hidden) states, got shape {tuple(hidden_states.shape)}")
    if hidden_states.shape[1] == layout.local_len != layout.seq_len:
        return True
    if hidden_states.shape[1] == layout.seq_len:
        return False  # whole states (gathered, or an unpatched forward's)
    raise ValueError(f"pool_sequence got {hidden_states.shape[1]} tokens; the model's latest forward holds "
                     f"{layout.local_len} per rank of {layout.seq_len}")


def _valid_tokens(attention_mask, batch: int, seq_len: int, device) -> torch.Tensor:
    """(B, L) bool over the whole sequence: the given mask, else all True."""
    if attention_mask is None:
        return torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) not in ((batch, seq_len), (1, seq_len)):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; pool_sequence needs the whole "
                         f"batch's ({batch}, {seq_len}) mask")
    return attention_mask.to(device=device, dtype=torch.bool).expand(batch, -1)


def _rightmost(valid: torch.Tensor) -> torch.Tensor:
    """(B, L) bool -> (B,) long index of each row's last True (0 for a row without any)."""
    positions = torch.arange(valid.shape[1], device=valid.device)
    return (positions * valid).argmax(-1)


def _pool_whole(hidden_states: torch.Tensor, attention_mask, how: str) -> torch.Tensor:
    """The same pooling of whole (B, L, H) states (an unpatched model, one process)."""
    B, L = hidden_states.shape[:2]
    valid = (torch.ones(B, L, dtype=torch.bool, device=hidden_states.device) if attention_mask is None
             else attention_mask.to(device=hidden_states.device, dtype=torch.bool).expand(B, -1))
    if how == "last":
        return hidden_states[torch.arange(B, device=hidden_states.device), _rightmost(valid)]
    total = (hidden_states.float() * valid[..., None]).sum(1)
    return (total / valid.sum(1, keepdim=True).clamp_min(1).to(total)).to(hidden_states.dtype)
