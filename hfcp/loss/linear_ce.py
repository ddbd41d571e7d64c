"""Cross-entropy of a linear head, chunk by chunk, with its gradients computed in the forward pass.

The loss is the last op before backward and is linear in its upstream gradient (a scalar), so the gradients
of each chunk's (tokens x vocab) logits can be taken while the chunk is in memory and kept only as the much
smaller dL/dhidden (tokens x hidden) and, when the head trains, dL/dweight. Backward then only scales them:
no logits are recomputed, and none outlive their chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
STATS_ROWS = 1024  # rows of logits per step of add_token_stats


@dataclass(frozen=True)
class LogitTransform:
    """What a causal LM does to its head's output before the loss: logits = out_scale * tanh(scale * z) with
    `tanh`, else scale * z (Cohere's logit_scale, Granite's 1 / logits_scaling, Gemma's final_logit_softcapping
    as scale 1/c, tanh, out_scale c). Read from the model's forward (families.forward_reading.logit_transform)."""

    scale: float = 1.0
    tanh: bool = False
    out_scale: float = 1.0

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        z = z * self.scale if self.scale != 1.0 else z
        if self.tanh:
            z = torch.tanh(z)
        return z * self.out_scale if self.out_scale != 1.0 else z

    def grad_(self, dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """dL/dz from dL/dy and y = self(z), in place in dy."""
        if self.tanh:  # d/dz out_scale * tanh(scale z) = scale * out_scale * (1 - tanh^2)
            dy.mul_(1 - (y / self.out_scale).square_())
        factor = self.scale * (self.out_scale if self.tanh else 1.0)
        return dy.mul_(factor) if factor != 1.0 else dy


IDENTITY = LogitTransform()


def chunk_starts(targets: torch.Tensor, chunk: int) -> list[int]:
    """Starts of the chunks holding at least one valid target; [0] when none does (the one zero chunk keeps
    every rank's graph the same, so collectives and DDP hooks fire everywhere)."""
    starts = [s for s in range(0, targets.numel(), chunk) if bool((targets[s : s + chunk] != IGNORE_INDEX).any())]
    return starts or [0]


def check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Raises ValueError for a target outside [0, vocab) that is not IGNORE_INDEX (F.cross_entropy raises too)."""
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        raise ValueError(f"label {int(targets[bad][0])} is outside the vocabulary [0, {vocab}) and is not "
                         f"{IGNORE_INDEX} (ignored); fix the labels")


@torch.no_grad()
def add_token_stats(logits: torch.Tensor, targets: torch.Tensor, stats: torch.Tensor | None) -> None:
    """stats (3,) float64 += [valid targets, top-1 hits, sum of the entropy of softmax(logits)] over the valid rows
    of logits (n, V) with targets (n,): what token-accuracy and entropy metrics need, without keeping logits."""
    if stats is None:
        return
    for start in range(0, logits.shape[0], STATS_ROWS):  # bounded temporaries for a whole local sequence too
        part, t = logits[start : start + STATS_ROWS].float(), targets[start : start + STATS_ROWS]
        valid = t != IGNORE_INDEX
        probs = torch.softmax(part, dim=-1)
        entropy = torch.logsumexp(part, dim=-1) - torch.linalg.vecdot(probs, part)  # (n,)
        hits = (part.argmax(-1) == t) & valid
        stats += torch.stack([valid.sum(), hits.sum(), (entropy * valid).sum()]).to(stats)


class LinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of CE(hidden @ weight.T + bias, targets); hidden (N, H), targets (N,) -> fp32 scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, grad_enabled, stats=None, transform=IDENTITY):
        grad = grad_enabled  # the caller's grad mode (off inside forward): under no_grad, skip the gradients
        need_h, need_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        need_b = grad and bias is not None and ctx.needs_input_grad[2]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in chunk_starts(targets, chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            logits = transform(F.linear(h, weight, bias).float())  # (n, V), as the model computes them
            add_token_stats(logits, t, stats)
            valid = t != IGNORE_INDEX
            index = t.clamp_min(0)[:, None]
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            total += ((lse - logits.gather(1, index)[:, 0]) * valid).sum()
            if not (need_h or need_w or need_b):
                continue
            if transform.tanh:  # softmax; its derivative needs the capped logits: keep them
                dlogits = (logits - lse[:, None]).exp_()
            else:  # softmax, in place: (n, V)
                dlogits = logits.sub_(lse[:, None]).exp_()
            dlogits.scatter_add_(1, index, -valid[:, None].float())  # minus the one-hot target
            dlogits.mul_(valid[:, None])  # ignored tokens get no gradient
            dlogits = transform.grad_(dlogits, logits)  # through the model's scale / softcap to the head's output
            g = dlogits.to(hidden.dtype)
            if need_h:
                grad_h[start : start + chunk] = g @ weight  # (n, H)
            if need_w:
                grad_w += (g.t() @ h).float()  # (V, H)
            if need_b:
                grad_b += dlogits.sum(0)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.any_valid = bool((targets != IGNORE_INDEX).any())
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("the chunked loss's gradients were already used: backward through it only once")
        ctx.grads = None
        if not ctx.any_valid:  # no target here: zero gradients, as F.cross_entropy gives, even when the
            grad_total = torch.zeros_like(grad_total)  # upstream is inf/NaN (a batch without targets: 0 / 0)
        scaled = [None if g is None else (g * grad_total).to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        return (*scaled, None, None, None, None, None)


def linear_cross_entropy_sum(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Linear, chunk: int,
                             stats: torch.Tensor | None = None, transform: LogitTransform = IDENTITY) -> torch.Tensor:
    """sum of CE(transform(head(hidden)), targets) over valid tokens, `chunk` tokens at a time, gradients taken in
    forward.

    hidden (B, L, H), targets (B, L) with IGNORE_INDEX for no target -> fp32 scalar (0 when none is valid).
    stats: None, or a (3,) float64 tensor that add_token_stats accumulates into.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(hidden.device)
    check_targets(t, head.weight.shape[0])
    return LinearCrossEntropy.apply(h, head.weight, head.bias, t, chunk, torch.is_grad_enabled(), stats, transform)
