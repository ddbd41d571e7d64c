"""TRL's fused LM head (`model(..., labels=labels, fused_lm_head=True)`, trl.trainer.utils.add_fused_lm_head) on a
context-parallel model.

TRL's fused head calls the backbone itself and scores every token it is given, so under CP it would run around
hfcp's hook. `install_cp_fused_head` puts, on top of the model's forward, one that answers `fused_lm_head=True`
with hfcp's pieces instead: the hooked forward to the last hidden states (this rank's tokens), then per chunk of
tokens (hfcp.patch's `loss_chunk` when it is a number, else 1024) one pass through the head that gives log
p(label) (differentiable, as `hfcp.sequence_logps`) and, without gradient, the entropy, the mean logit, whether the
label is the top-1 token and log sum p^2. Each per-token field
is then gathered whole (batch x sequence numbers, never tokens x vocabulary), so the trainer's own code reads the
same `FusedCausalLMOutput` as in one process.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..outputs import gather_sequence
from ..distributed.input_checks import check_same_batch
from ..hooks.causal_lm import DEFAULT_LOSS_CHUNK
from ..loss.linear_ce import IGNORE_INDEX, chunk_starts
from ..outputs.head_input import last_hidden_states, output_head, shifted_targets
from ..loss.target_logps import LinearTargetLogps, with_temperature
from ..state import cp_state, find_pretrained

STATS = ("entropy", "mean_logits", "is_top1", "log_sum_sq_probs")


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """logits (n, V) fp32 after the transform, targets (n,) -> (log p(target), entropy, mean logit, top-1, log sum
    p^2), each (n,), 0 / False where the target is IGNORE_INDEX (as TRL's fused head leaves them). Consumes
    `logits` (overwritten); at most two (n, V) tensors live at a time."""
    valid = targets != IGNORE_INDEX
    top1 = logits.argmax(-1) == targets  # the first maximum, as TRL's kernel decides a tie
    mean = logits.mean(-1)
    logp = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))  # (n, V), in place
    picked = logp.gather(1, targets.clamp_min(0)[:, None])[:, 0]
    p = logp.exp()  # (n, V)
    entropy = -torch.bmm(p[:, None, :], logp[:, :, None]).view(-1)  # -sum p log p, without a third (n, V)
    lss = 2 * torch.log(torch.linalg.vector_norm(p, dim=-1))  # log sum p^2
    zero = logp.new_zeros(())
    picked, entropy, mean, lss = (torch.where(valid, v, zero) for v in (picked, entropy, mean, lss))
    return picked, entropy, mean, top1 & valid, lss


class LinearTargetLogpsWithStats(torch.autograd.Function):
    """LinearTargetLogps (one head matmul per chunk in forward, recomputed in backward) that also returns, without
    gradient, the statistics of each chunk's logits: (N,) log p, entropy, mean logit, top-1 (bool), log sum p^2."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, transform):
        n = targets.numel()
        out = [torch.zeros(n, dtype=torch.float32, device=hidden.device) for _ in range(5)]
        out[3] = out[3].bool()
        for start in chunk_starts(targets, chunk):
            part = slice(start, start + chunk)
            logits = transform(F.linear(hidden[part], weight, bias).float())
            for o, v in zip(out, _chunk_stats(logits, targets[part])):
                o[part] = v
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk, ctx.transform = chunk, transform
        ctx.mark_non_differentiable(*out[1:])
        return tuple(out)

    @staticmethod
    def backward(ctx, grad, *unused):  # the statistics have no gradient
        return LinearTargetLogps.backward(ctx, grad)


def _other_head_stats(hidden, targets, head, chunk, transform) -> tuple[torch.Tensor, ...]:
    """A head that is no nn.Linear: log p through hfcp's checkpointed chunks, the statistics in a pass without grad."""
    from ..loss.target_logps import target_logps

    logps = target_logps(hidden, targets, head, chunk, transform)
    stats = [torch.zeros(targets.numel(), dtype=torch.float32, device=hidden.device) for _ in range(4)]
    stats[2] = stats[2].bool()
    with torch.no_grad():
        for start in chunk_starts(targets, chunk):
            part = slice(start, start + chunk)
            for o, v in zip(stats, _chunk_stats(transform(head(hidden[part]).float()), targets[part])[1:]):
                o[part] = v
    return (logps, *stats)


def cp_fused_outputs(model, labels: torch.Tensor, temperature: float = 1.0, chunk: int = 1024,
                     num_items_in_batch=None, **kwargs):
    """What TRL's fused head returns (trl.trainer.utils.FusedCausalLMOutput), computed under CP: every per-token
    field (batch, seq - 1) whole and identical on every rank of the CP group, log_probs differentiable (the gradient
    follows hfcp's convention: averaged over the CP group it is the single-device one), the others without gradient.

    On an unpatched model the same computation runs on the whole sequence (the single-device values).

    Args:
        model: the causal LM, patched or not (its PreTrainedModel, whose forward is the hooked one when patched).
        labels: (B, L) targets as the model's loss takes them (shifted here over the whole sequence), -100: none.
        temperature: the logits (after the model's own transform) are divided by it.
        **kwargs: the model's inputs (input_ids, attention_mask, ...).
    """
    from trl.trainer.utils import FusedCausalLMOutput

    inner = find_pretrained(model)
    state = cp_state(inner)
    head, transform = output_head(inner, state)
    if state is not None and state.check_inputs:  # the hook checks the model's inputs; the labels are ours
        check_same_batch({"fused head labels": labels}, state.mesh.cp_group, ("fused head labels",))
    input_ids = kwargs.get("input_ids")
    x = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
    # counted as TRL counts them: labels != -100 (padding is -100 in every TRL collator)
    targets = shifted_targets(inner, x, labels, None, None)  # (B, L), shifted
    hidden, output = last_hidden_states(inner, head, {k: v for k, v in kwargs.items() if v is not None})
    local = (targets if state is None else state.step.local(targets, fill=IGNORE_INDEX)).to(hidden.device)  # (B, n)
    B, n = local.shape
    flat_h, flat_t = hidden.reshape(B * n, -1), local.reshape(-1)
    transform = with_temperature(transform, float(temperature))
    if type(head) is torch.nn.Linear:
        fields = LinearTargetLogpsWithStats.apply(flat_h, head.weight, head.bias, flat_t, chunk, transform)
    else:
        fields = _other_head_stats(flat_h, flat_t, head, chunk, transform)
    # whole (B, L), then position i scores token i + 1: TRL's (B, L - 1)
    log_probs, entropy, mean_logits, is_top1, lss = (gather_sequence(f.view(B, n), inner)[:, :-1] for f in fields)
    mask = labels[:, 1:].to(log_probs.device) != IGNORE_INDEX
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                               log_sum_sq_probs=lss, mean_logits=mean_logits, is_top1=is_top1, label_mask=mask,
                               aux_loss=getattr(output, "aux_loss", None))


def _chunk(model) -> int:
    """Tokens per chunk through the head: hfcp.patch's loss_chunk when it is a number, else hfcp's default."""
    state = cp_state(model)
    setting = state.settings.loss_chunk if state is not None else None
    return setting if isinstance(setting, int) and not isinstance(setting, bool) else DEFAULT_LOSS_CHUNK


def install_cp_fused_head(model, temperature: float = 1.0) -> None:
    """Make `model(..., labels=labels, fused_lm_head=True)` compute TRL's fused-head outputs under CP (see the module
    docstring); a call without `fused_lm_head` goes to the forward the model had (hfcp's hooked forward, or TRL's
    own fused forward around it, which then passes it through). Idempotent."""
    inner = find_pretrained(model)
    if getattr(inner.forward, "hfcp_fused_head", False):
        return
    previous = inner.forward

    def forward(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return previous(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        if args or shift_labels is not None or labels is None:
            raise ValueError("hfcp's fused LM head takes keyword inputs and labels= (not shift_labels=: hfcp shifts "
                             "the labels over the whole sequence itself)")
        return cp_fused_outputs(inner, labels, temperature, _chunk(inner), num_items_in_batch=num_items_in_batch,
                                **kwargs)

    forward = functools.wraps(previous)(forward)
    forward.hfcp_fused_head = True
    inner.forward = forward
