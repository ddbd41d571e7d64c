"""Chunked linear recurrences over the global sequence, computed on each rank's tokens
(docs/concepts/recurrent-state.md).

The recurrences here carry a matrix state S (B, H, dk, dv) whose dv columns evolve independently and linearly in
the state and the values, as the gated delta rule does (S_t = A_t S_{t-1} + k_t u_t^T, A_t = a_t (I - b_t k_t k_t^T)).
A run of consecutive tokens then maps its initial state to

    S_out = M @ S_in + S_loc        out_t = o_t + Q_t @ S_in

with M (dk, dk) the run's transition, S_loc and o its final state and outputs from a zero state, and Q_t (dk,) the
response of output t to the initial state. One call of the family's own kernel gives all four: the values get dk
extra columns of zeros and the initial state is [0 | I], so the last dk columns of the final state are M and those
of the output are Q. Every rank sends [S_loc | M] of each of its runs in one all-gather; the state at a run's start
is the fold of the runs before it in sequence order (in fp32, whichever rank holds them under the zigzag layout),
and its outputs are corrected by Q @ S_in. Autograd through the fold and the all-gather, whose backward sums each
state's gradient back to the rank that owns the run, gives the backward; no rank waits on another in a chain.

A state that decays by one scalar per head and token (Mamba-2) needs no extra columns: a run's transition is the
exponential of its total log decay, and Q follows from the read vectors and the running decay
(`scalar_decay_over_ranks`). So does a state that decays elementwise, by exp(decay[d, n] * rate_t[d]) (Mamba 1's
selective scan, `channel_decay_over_ranks`): the run's transition is exp(decay * total rate); and a vector state
that is its own output, gated per channel (RG-LRU, `gated_sum_over_ranks`): the product of the run's gates.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..distributed.collectives import all_gather
from ..layout import StepBatch


def _runs(x: torch.Tensor, count: int, dim: int = 1) -> torch.Tensor:
    """(B, count * n, ...) -> (count * B, n, ...), the token dim at `dim`: this rank's runs stacked along the batch."""
    return torch.cat(x.chunk(count, dim=dim), 0)


def _unruns(x: torch.Tensor, count: int, dim: int = 1) -> torch.Tensor:
    """(count * B, n, ...) -> (B, count * n, ...), the token dim at `dim`."""
    return torch.cat(x.chunk(count, dim=0), dim)


def _fold_in_order(table: torch.Tensor, step: StepBatch, state: torch.Tensor, advance: Callable) -> torch.Tensor:
    """The state at the start of each of this rank's runs, (runs, ...): `table` holds every run's row in
    layout.all_ranges() order, `state` is the state at the sequence start, advance(row, state) the state after a run.

    Every rank's result is picked from the whole fold, so that it depends on the all-gather of `table` (its backward
    is a collective every rank must join, also a rank whose only run starts the sequence)."""
    starts = [first for first, _ in step.layout.all_ranges()]
    order = sorted(range(len(starts)), key=starts.__getitem__)  # runs in sequence order, back to back
    prefix = []
    for i in order:
        prefix.append(state)
        state = advance(table[i], state)
    at = {starts[i]: n for n, i in enumerate(order)}
    mine = torch.tensor([at[first] for first, _ in step.layout.ranges(step.rank)], device=table.device)
    return torch.stack(prefix).index_select(0, mine)


def fold_initial_states(finals: torch.Tensor, step: StepBatch, group) -> torch.Tensor:
    """The state at the start of each of this rank's runs.

    finals: (runs, B, H, dk, dv + dk) fp32, each local run's [S_loc | M] in local order.
    Returns: (runs, B, H, dk, dv) fp32; zero for the run at the sequence start.
    """
    dk = finals.shape[-2]
    dv = finals.shape[-1] - dk
    table = all_gather(finals, group, 0)  # (runs * cp, ...) in layout.all_ranges() order
    start = finals.new_zeros(finals.shape[1:-1] + (dv,))  # (B, H, dk, dv)
    return _fold_in_order(table, step, start, lambda row, s: row[..., dv:] @ s + row[..., :dv])  # M @ S_in + S_loc


def chunked_rule_over_ranks(rule: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            per_token: dict, step: StepBatch, group, out_dtype: torch.dtype | None = None,
                            **options) -> torch.Tensor:
    """What `rule(query, key, value, **per_token, **options)[0]` gives over the global sequence, at this rank's tokens.

    Args:
        rule: the family's chunked kernel, called as rule(q, k, v, **per_token, initial_state=, output_final_state=True,
            **options) -> (out (B, n, Hv, dv), final state (B, Hv, dk, dv)); its state must be linear in the initial
            state and the values, column by column (the gated delta rule and KDA are).
        query, key: (B, L_local, Hk, dk); value: (B, L_local, Hv, dv), this rank's tokens in local order.
        per_token: tensors with the token dim at 1 (the decay g, beta), cut with the runs.
        out_dtype: the dtype the rule returns on one device (default: the query's).
        options: passed through (use_qk_l2norm_in_kernel).
    Returns: (B, L_local, Hv, dv) in out_dtype.

    Raises:
        RuntimeError: the rule's final state is not (B, Hv, dk, dv + dk).
    """
    count = len(step.layout.ranges(step.rank))
    batch, _, heads, dv = value.shape
    dk = key.shape[-1]
    f32 = torch.promote_types(value.dtype, torch.float32)  # the fold's dtype: fp32, or fp64 for fp64 inputs
    values = torch.cat([_runs(value, count).to(f32), value.new_zeros(count * batch, value.shape[1] // count, heads, dk,
                                                                     dtype=f32)], -1)  # (runs*B, n, Hv, dv + dk)
    identity = torch.eye(dk, dtype=f32, device=value.device).expand(count * batch, heads, dk, dk)
    initial = torch.cat([identity.new_zeros(count * batch, heads, dk, dv), identity], -1)  # [0 | I]
    out, final = rule(_runs(query, count).to(f32), _runs(key, count).to(f32), values,
                      **{k: _runs(t, count) for k, t in per_token.items()}, initial_state=initial,
                      output_final_state=True, **options)
    if tuple(final.shape) != (count * batch, heads, dk, dv + dk):
        raise RuntimeError(f"hfcp: the recurrent kernel returned a final state of shape {tuple(final.shape)}, not "
                           f"{(count * batch, heads, dk, dv + dk)} (batch, heads, key dim, value dims): its state is "
                           "not the form hfcp folds")
    finals = final.to(f32).reshape(count, batch, heads, dk, dv + dk)
    at_start = fold_initial_states(finals, step, group).reshape(count * batch, heads, dk, dv)
    out = out.to(f32)
    corrected = out[..., :dv] + torch.einsum("bnhk,bhkv->bnhv", out[..., dv:], at_start)  # (runs*B, n, Hv, dv)
    return _unruns(corrected, count).to(out_dtype or query.dtype)


def scalar_decay_over_ranks(scan: Callable, log_decay: torch.Tensor, read: torch.Tensor, per_token: dict,
                            step: StepBatch, group, out_dtype: torch.dtype, **options) -> torch.Tensor:
    """What `scan(**per_token, **options)` gives over the global sequence, at this rank's tokens, for a scan whose
    state h (B, H, P, N) decays by one scalar per head and token (Mamba-2's SSD): h_t = exp(l_t) h_{t-1} + u_t and
    y_t = h_t read_t + (terms without the state). A run's transition is then exp(sum of l) and the response of its
    outputs to the initial state exp(cumsum l)_t h_in read_t, both from l directly, so the kernel runs once per run
    on its own columns; only the final states and the runs' total log decays travel.

    Args:
        scan: called as scan(**per_token cut into runs, return_final_states=True, **options) -> (out (B, n, H, P),
            final state (B, H, P, N)).
        log_decay: (B, L_local, H) l_t, as the kernel computes it.
        read: (B, L_local, H, N) the vector each token's output reads the state with.
        per_token: the kernel's per-token arguments (token dim 1).
    Returns: (B, L_local, H, P) in out_dtype.
    """
    count = len(step.layout.ranges(step.rank))
    f32 = torch.promote_types(log_decay.dtype, torch.float32)
    out, final = scan(**{k: _runs(t, count) for k, t in per_token.items()}, return_final_states=True, **options)
    runs = count * log_decay.shape[0]
    if not (final.dim() == out.dim() == 4 and final.shape[0] == out.shape[0] == runs
            and (final.shape[1], final.shape[2]) == (out.shape[2], out.shape[3])):
        raise RuntimeError(f"hfcp: the scan returned a final state of shape {tuple(final.shape)} and an output of "
                           f"{tuple(out.shape)}: not the form hfcp folds")
    cum = _runs(log_decay, count).to(f32).cumsum(1)  # (runs*B, n, H)
    state_shape = final.shape[2:]
    mine = torch.cat([final.to(f32).flatten(2), cum[:, -1, :, None]], -1)  # (runs*B, H, P*N + 1)
    table = all_gather(mine.reshape((count, -1) + mine.shape[1:]), group, 0)  # (runs*cp, B, H, P*N + 1)
    start = table.new_zeros(table.shape[1:-1] + state_shape)  # (B, H, P, N)
    at_start = _fold_in_order(table, step, start, lambda row, s: row[..., -1, None, None].exp() * s
                              + row[..., :-1].reshape(s.shape)).flatten(0, 1)  # (runs*B, H, P, N)
    response = torch.einsum("bnhs,bhps->bnhp", _runs(read, count).to(f32), at_start) * cum.exp()[..., None]
    return _unruns(out.to(f32) + response, count).to(out_dtype)


def channel_decay_over_ranks(scan: Callable, rate: torch.Tensor, decay: torch.Tensor, read: torch.Tensor,
                             per_token: dict, step: StepBatch, group) -> torch.Tensor:
    """What `scan(**per_token, **options)` gives over the global sequence, at this rank's tokens, for a scan whose state
    h (B, D, N) decays elementwise (Mamba 1's selective scan): h_t = exp(decay * rate_t[:, None]) h_{t-1} + u_t and
    y_t[d] = sum_n h_t[d, n] read_t[n] + (terms without the state). A run's transition is exp(decay * its total
    rate), and the response of its outputs to the initial state sum_n read_t[n] exp(decay * cumsum rate)_t h_in, so
    the kernel runs once per run as on one device; only the final states and the runs' total rates travel.

    The tensors are in the kernel's layout, channels before tokens (the token dim last):
        scan: called as scan(**per_token cut into runs) -> (out (B, D, n), final state (B, D, N)).
        rate: (B, D, L_local) the discretised step of each channel (Mamba's softplus(dt + bias)).
        decay: (D, N), the log decay per unit rate (Mamba's A).
        read: (B, N, L_local) the vector each token's output reads the state with (Mamba's C).
        per_token: the kernel's per-token arguments (token dim last).
    Returns: (B, D, L_local) in the dtype the kernel returns.
    """
    count = len(step.layout.ranges(step.rank))
    f32 = torch.promote_types(rate.dtype, torch.float32)
    out, final = scan(**{k: _runs(t, count, -1) for k, t in per_token.items()})
    runs, channels = count * rate.shape[0], rate.shape[1]
    if tuple(final.shape) != (runs, channels, decay.shape[-1]) or tuple(out.shape[:2]) != (runs, channels):
        raise RuntimeError(f"hfcp: the scan returned a final state of shape {tuple(final.shape)} and an output of "
                           f"{tuple(out.shape)}, not ({runs}, {channels}, {decay.shape[-1]}) and ({runs}, {channels}, "
                           "tokens): not the form hfcp folds")
    cum = _runs(rate, count, -1).to(f32).cumsum(-1)  # (runs*B, D, n)
    decay = decay.to(f32)
    mine = torch.cat([final.to(f32), cum[..., -1:]], -1)  # (runs*B, D, N + 1)
    table = all_gather(mine.reshape((count, -1) + mine.shape[1:]), group, 0)  # (runs*cp, B, D, N + 1)
    start = table.new_zeros(table.shape[1:-1] + decay.shape[-1:])  # (B, D, N)
    at_start = _fold_in_order(table, step, start, lambda row, s: (decay * row[..., -1:]).exp() * s
                              + row[..., :-1]).flatten(0, 1)  # (runs*B, D, N)
    decayed = (decay[None, :, :, None] * cum[:, :, None, :]).exp()  # (runs*B, D, N, n)
    response = torch.einsum("bnt,bdnt,bdn->bdt", _runs(read, count, -1).to(f32), decayed, at_start)
    return _unruns(out + response.to(out.dtype), count, -1)


def gated_sum_over_ranks(scan: Callable, gate: torch.Tensor, per_token: dict, step: StepBatch, group) -> torch.Tensor:
    """What `scan(**per_token)` gives over the global sequence, at this rank's tokens, for a scan whose state h (B, W)
    is its output, h_t = gate_t * h_{t-1} + u_t (RG-LRU's linear recurrence, a gate per channel in [0, 1], zero at a
    document start). A run's transition is the product of its gates, and the response of its outputs to the initial
    state the running product times h_in (products, not log sums: a gate of zero is a reset).

    Args:
        scan: called as scan(**per_token cut into runs) -> (out (B, n, W), final state (B, W)).
        gate: (B, L_local, W) gate_t, as the scan applies it (resets included).
        per_token: the scan's per-token arguments (token dim 1).
    Returns: (B, L_local, W) in the dtype the scan returns.
    """
    count = len(step.layout.ranges(step.rank))
    f32 = torch.promote_types(gate.dtype, torch.float32)
    out, final = scan(**{k: _runs(t, count) for k, t in per_token.items()})
    runs, width = count * gate.shape[0], gate.shape[-1]
    if tuple(final.shape) != (runs, width) or tuple(out.shape[::2]) != (runs, width):
        raise RuntimeError(f"hfcp: the scan returned a final state of shape {tuple(final.shape)} and an output of "
                           f"{tuple(out.shape)}, not ({runs}, {width}) and ({runs}, tokens, {width}): not the form "
                           "hfcp folds")
    running = _runs(gate, count).to(f32).cumprod(1)  # (runs*B, n, W)
    mine = torch.cat([final.to(f32), running[:, -1]], -1)  # (runs*B, 2W)
    table = all_gather(mine.reshape(count, -1, 2 * width), group, 0)  # (runs*cp, B, 2W)
    start = table.new_zeros(table.shape[1:-1] + (width,))  # (B, W)
    at_start = _fold_in_order(table, step, start, lambda row, s: row[..., width:] * s + row[..., :width]).flatten(0, 1)
    return _unruns(out + (running * at_start[:, None]).to(out.dtype), count)
