"""The MoE router load-balancing loss (Switch Transformer) from whole-sequence statistics.

transformers computes it inside the causal LM's forward, from the router logits of every MoE layer:

    aux = E * sum_e (T_e / N) * (P_e / N)

T_e: top-k assignments to expert e, P_e: the softmax probabilities of expert e, both summed over the valid
tokens of every layer; N: valid tokens times layers. It is a product of two means over all tokens, so under CP
each rank sums T, P and N over its own tokens and the sums are all-reduced over the CP group (never local aux
losses averaged). Gradients flow through P only (T counts a top-k choice), via the all-reduce whose backward
keeps hfcp's convention (the mean over the group of a parameter's grad is the single-device grad).

hfcp reads the expert count, top-k and coefficient from the causal LM's forward (forward_reading.router_aux_loss)
and checks, when patching, that the family's own loss function computes this formula (check_form).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed.collectives import all_reduce_sum


@dataclass(frozen=True)
class RouterAux:
    """The aux loss as the family's forward calls it: loss += coef * fn(router_logits, num_experts, top_k, mask)."""

    num_experts: int
    top_k: int
    coef: float


def local_sums(router_logits, weights: torch.Tensor, num_experts: int, top_k: int):
    """(T (E,) fp32, P (E,) fp32 with grad, N scalar fp32) over this rank's tokens of every layer.

    router_logits: per MoE layer a (tokens, E) tensor, tokens in (batch, local sequence) order;
    weights: (tokens,) 1 for a valid token, 0 for padding.
    """
    device = router_logits[0].device
    w = weights.to(device=device, dtype=torch.float32)
    T = torch.zeros(num_experts, dtype=torch.float32, device=device)
    P = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for layer in router_logits:
        probs = torch.softmax(layer.reshape(-1, num_experts), dim=-1)  # in the router's dtype, as transformers
        if probs.shape[0] != w.shape[0]:
            raise ValueError(f"a router returned logits for {probs.shape[0]} tokens; this rank holds {w.shape[0]}")
        _, chosen = torch.topk(probs, top_k, dim=-1)
        T = T + torch.zeros_like(T).scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        P = P + (probs.float() * w[:, None]).sum(0)
    return T, P, w.sum() * len(router_logits)


def aux_from_sums(T: torch.Tensor, P: torch.Tensor, N: torch.Tensor, num_experts: int) -> torch.Tensor:
    return (T / N * (P / N)).sum() * num_experts


def global_aux(router_logits, weights, aux: RouterAux, group) -> torch.Tensor:
    """The aux loss of the whole sequence (same value on every rank of the CP group)."""
    E = aux.num_experts
    T, P, N = local_sums(router_logits, weights, E, aux.top_k)
    sums = all_reduce_sum(torch.cat([P, T, N[None]]), group)  # one collective; only P carries a gradient
    return aux_from_sums(sums[E : 2 * E], sums[:E], sums[-1], E)


def check_form(fn, aux: RouterAux) -> bool:
    """Whether the family's loss function `fn` computes the formula above (tried on random logits with a
    padding mask, in one process)."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, aux.num_experts, generator=g) * 2 for _ in range(2))
    mask = (torch.rand(2, 6, generator=g) > 0.3).long()
    mask[:, 0] = 1
    try:
        want = fn(logits, aux.num_experts, aux.top_k, mask)
    except Exception:  # noqa: BLE001 - another signature or form: not the one hfcp implements
        return False
    got = aux_from_sums(*local_sums(logits, mask.reshape(-1), aux.num_experts, aux.top_k), aux.num_experts)
    return isinstance(want, torch.Tensor) and want.numel() == 1 and torch.allclose(want.float(), got, rtol=1e-5)
