"""log p(target) of each token through a causal LM's output head, chunk by chunk: no (tokens x vocab) logits
outlive their chunk, in forward or backward.

Backward recomputes each chunk's logits: the upstream gradient is one number per token (a DPO loss weighs each row,
GRPO each token), so the (tokens x vocab) gradient of the logits cannot be folded in forward as the LM loss does
(linear_ce.py: its upstream is one scalar). Recomputing costs one more head matmul per chunk in backward and keeps
nothing in forward beyond the hidden states autograd holds anyway; a forward without grad (a reference model's)
does no gradient work at all.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from .linear_ce import IDENTITY, IGNORE_INDEX, LogitTransform, chunk_starts


def _target_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (n, V) fp32, targets (n,) -> (n,) log_softmax(logits)[target], 0 where the target is IGNORE_INDEX."""
    valid = targets != IGNORE_INDEX
    picked = logits.gather(1, targets.clamp_min(0)[:, None])[:, 0]
    return torch.where(valid, picked - torch.logsumexp(logits, dim=-1), 0.0)


class LinearTargetLogps(torch.autograd.Function):
    """log p(target) through a linear head: hidden (N, H), targets (N,) -> (N,) fp32. No logits are saved: backward
    recomputes each chunk's, so no (tokens x vocab) tensor outlives its chunk in either pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, transform):
        out = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        for start in chunk_starts(targets, chunk):
            part = slice(start, start + chunk)
            out[part] = _target_logps(transform(F.linear(hidden[part], weight, bias).float()), targets[part])
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk, ctx.transform = chunk, transform
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        transform, chunk = ctx.transform, ctx.chunk
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        upstream = torch.where(targets != IGNORE_INDEX, grad.float(), 0.0)  # (N,): a constant 0 has no gradient
        for start in chunk_starts(targets, chunk):
            part = slice(start, start + chunk)
            h, t, g = hidden[part], targets[part], upstream[part, None]
            logits = transform(F.linear(h, weight, bias).float())  # (n, V), recomputed
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            # d logp / d logits = onehot(target) - softmax; the softcap's derivative needs the capped logits: keep them
            dlogits = (logits - lse).exp_() if transform.tanh else logits.sub_(lse).exp_()
            dlogits.mul_(-g).scatter_add_(1, t.clamp_min(0)[:, None], g)
            dlogits = transform.grad_(dlogits, logits)
            d = dlogits.to(hidden.dtype)
            if need_h:
                grad_h[part] = d @ weight  # (n, H)
            if need_w:
                grad_w += (d.t() @ h).float()  # (V, H)
            if need_b:
                grad_b += dlogits.sum(0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None


def _chunk_logps(hidden: torch.Tensor, targets: torch.Tensor, head, transform: LogitTransform) -> torch.Tensor:
    return _target_logps(transform(head(hidden).float()), targets)


def target_logps(hidden: torch.Tensor, targets: torch.Tensor, head, chunk: int,
                 transform: LogitTransform = IDENTITY) -> torch.Tensor:
    """log_softmax(transform(head(hidden)))[target] per token, `chunk` tokens at a time: hidden (N, H), targets (N,)
    with IGNORE_INDEX for none -> (N,) fp32, 0 where there is no target.

    A plain nn.Linear head takes LinearTargetLogps; any other (a PEFT-wrapped lm_head) runs per chunk under
    activation checkpointing (backward recomputes its logits through autograd).
    """
    if type(head) is torch.nn.Linear:
        return LinearTargetLogps.apply(hidden, head.weight, head.bias, targets, chunk, transform)
    counted = set(chunk_starts(targets, chunk))
    parts = []
    for start in range(0, targets.numel(), chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if start not in counted:
            parts.append(torch.zeros(t.shape, dtype=torch.float32, device=hidden.device))
        elif torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logps, h, t, head, transform, use_reentrant=False))
        else:
            parts.append(_chunk_logps(h, t, head, transform))
    return torch.cat(parts)


def with_temperature(transform: LogitTransform, temperature: float) -> LogitTransform:
    """transform(z) / temperature as one LogitTransform (the temperature divides its outer factor)."""
    if temperature == 1:
        return transform
    if transform.tanh:
        return dataclasses.replace(transform, out_scale=transform.out_scale / temperature)
    return dataclasses.replace(transform, scale=transform.scale / temperature)
