"""A recurrent layer's own forward code with its token-mixing calls over the global sequence
(docs/concepts/recurrent-state.md). A record names the module-level functions its family's forward calls to mix
tokens (a `Scan`); while patched, hfcp runs the forward with those names bound to context-parallel versions:
- the padding rule `apply_mask_to_padding_states`: with this rank's columns of the padding, from the step (the mask
  transformers passes the layer is cut to the local length, another rank's columns under CP);
- the causal depthwise convolution `causal_conv1d_fn`: over the global sequence with a halo (conv_halo.py);
- the chunked scan: the family's kernel on each run of this rank's tokens, with the state at the run's start folded
  from the runs before it (state_fold.py), by the kind of decay the kernel has;
- the per-token decode steps: refused (a cache); a fused training kernel (no halo): declined, so the torch path runs.
The record checks the code first (hfcp/families/source_guard.py): the forward reads these names and no others that
mix tokens.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .binding import check_step_tokens, local_key_valid
from .conv_halo import causal_depthwise_conv1d
from .family_code import with_globals
from .state_fold import channel_decay_over_ranks, chunked_rule_over_ranks, scalar_decay_over_ranks


@dataclass(frozen=True)
class Scan:
    """One kind of chunked scan, as a family's code calls it."""

    chunked: str  # the chunked kernel's name in the family module
    decode: str  # its per-token decode step (cache only)
    over_ranks: Callable  # (kernel, step_of, group) -> the kernel's drop-in over the global sequence (below)
    fused: str = ""  # a fused training kernel the forward tries first (it returns None without its package)


def refuse_state(initial, final, packed) -> None:
    if initial is not None or final or packed is not None:
        raise ValueError("hfcp: a recurrent scan with a cache or packed sequences: unpatch to generate, and pass one "
                         "document per row")


def refuse_unknown_tensors(options: dict, known: tuple = ()) -> None:
    """A tensor argument of the scan that hfcp does not know (not in `known`) could be per token, which the runs
    would not cut."""
    unknown = sorted(k for k, v in options.items() if isinstance(v, torch.Tensor) and k not in known)
    if unknown:
        raise ValueError(f"hfcp: the recurrent scan gets tensor arguments {unknown} that hfcp does not split over the "
                         "ranks; this transformers version is not supported")


def delta_rule(kernel, step_of, group):
    """A delta-rule kernel (gated delta net, Kimi delta attention) over the global sequence; its output in the
    kernel's dtype (the query's)."""
    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **options):
        refuse_state(initial_state, output_final_state, cu_seqlens)
        refuse_unknown_tensors(options)
        out = chunked_rule_over_ranks(kernel, query, key, value, {"g": g, "beta": beta}, step_of(), group,
                                      out_dtype=query.dtype, **options)
        return out, None

    return rule


def scalar_decay_scan(kernel, step_of, group):
    """Mamba-2's chunk scan over the global sequence. Its state h (B, H, head_dim, N) decays by one scalar per head
    and token, exp(A dt_t) with dt_t discretised as the kernel does (dt + dt_bias, softplus, clamped to dt_limit), and
    is read by C_t: state_fold.py's scalar-decay fold."""
    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), return_final_states=False, seq_idx=None, cu_seqlens=None, **options):
        refuse_state(initial_states, return_final_states, seq_idx if seq_idx is not None else cu_seqlens)
        refuse_unknown_tensors(options)  # a gate z would be per token: refused
        step_dt = dt + dt_bias.to(dt.dtype) if dt_bias is not None else dt  # (B, L, H), as the kernel computes it
        step_dt = torch.clamp(F.softplus(step_dt) if dt_softplus else step_dt, min=dt_limit[0], max=dt_limit[1])
        log_decay = A.float() * step_dt.float()
        read = C.repeat_interleave(hidden_states.shape[2] // C.shape[2], dim=2)  # (B, L, H, N): groups to heads

        def run(hidden_states, dt, B, C, return_final_states):
            return kernel(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=dt_limit, return_final_states=return_final_states, **options)

        # (B, L, H, head_dim) in fp32, as the kernel returns it
        return scalar_decay_over_ranks(run, log_decay, read, {"hidden_states": hidden_states, "dt": dt, "B": B, "C": C},
                                       step_of(), group, torch.float32)

    return scan


def channel_decay_scan(kernel, step_of, group):
    """Mamba 1's selective scan over the global sequence. Its state h (B, D, N) decays elementwise, by exp(A dt_t)
    with dt_t discretised as the kernel does (dt + delta_bias, softplus), and is read by C_t: state_fold.py's
    channel-decay fold. The gate z multiplies the output after the state's contribution, so the kernel runs without
    it and hfcp applies it to the corrected output."""
    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
             **options):
        refuse_state(None, return_last_state, None)
        refuse_unknown_tensors(options)
        rate = dt + delta_bias.to(dt.dtype)[..., None] if delta_bias is not None else dt  # (B, D, L)
        rate = F.softplus(rate) if delta_softplus else rate

        def run(hidden_states, dt, B, C):
            return kernel(hidden_states, dt, A, B, C, D=D, z=None, delta_bias=delta_bias, delta_softplus=delta_softplus,
                          return_last_state=True, **options)

        out = channel_decay_over_ranks(run, rate, A, C, {"hidden_states": hidden_states, "dt": dt, "B": B, "C": C},
                                       step_of(), group)
        return out * F.silu(z) if z is not None else out

    return scan


def _check_module(module) -> None:
    """What the code check cannot see: a causal depthwise nn.Conv1d (the halo's form), and no accelerate hooks (the
    rebound forward runs without them)."""
    name, conv = type(module).__name__, getattr(module, "conv1d", None)
    if (not isinstance(conv, torch.nn.Conv1d) or conv.padding[0] != conv.kernel_size[0] - 1
            or conv.groups != conv.in_channels):
        raise ValueError(f"hfcp: {name}'s conv1d is not the causal depthwise convolution hfcp computes over the "
                         "global sequence; this model is not supported")
    if any(getattr(m, "_hf_hook", None) is not None for m in module.modules()):
        raise ValueError(f"hfcp: {name} has accelerate hooks (device_map offloading): hfcp runs its forward without "
                         "them; load the model without offloading to train it under CP")


def scan_forward(state, module, step_of, scan: Scan):
    """The forward hfcp binds to a recurrent module whose code the record checked: the family's own forward with its
    token-mixing calls over the global sequence. step_of() is the step of the current call."""
    _check_module(module)
    raw, family = inspect.unwrap(type(module).forward), sys.modules[type(module).__module__]
    # the torch kernel under transformers' hub wrapper: with flash-linear-attention or mamba-ssm installed the wrapper
    # dispatches to their kernels, which have not run under hfcp (no GPU yet), so hfcp keeps to the torch path
    pad_states, kernel = family.apply_mask_to_padding_states, inspect.unwrap(getattr(family, scan.chunked))
    group = state.mesh.cp_group

    def padding(hidden_states, attention_mask):  # (B, L_local, ...): this rank's columns of the padding, from the step
        return pad_states(hidden_states, local_key_valid(step_of()))

    def convolution(x, weight, bias=None, activation=None, **kwargs):  # (B, C, L_local) -> the same
        refuse_unknown_tensors(kwargs)  # seq_idx (packed documents) is refused with the step's packed rows
        out = causal_depthwise_conv1d(x.to(weight.dtype), weight, bias, step_of(), group)
        return (ACT2FN[activation](out) if activation is not None else out).to(x.dtype)

    def decode_step(*args, **kwargs):
        raise ValueError(f"hfcp: {type(module).__name__}'s cached decode step (generation): unpatch to generate")

    def no_fused_kernel(*args, **kwargs):  # the family then takes its torch path, whose calls hfcp replaces
        return None

    names = {"apply_mask_to_padding_states": padding, "causal_conv1d_fn": convolution,
             "causal_conv1d_update": decode_step, scan.chunked: scan.over_ranks(kernel, step_of, group),
             scan.decode: decode_step}
    code = with_globals(raw, **names, **({scan.fused: no_fused_kernel} if scan.fused else {}))

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("cache_params", None)
        if cache is not None:
            raise ValueError(f"hfcp: a cache in {type(self).__name__} (generation): unpatch to generate")
        check_step_tokens(self, hidden_states, step_of(), "recurrent scan")
        return code(self, hidden_states, cache=None, attention_mask=attention_mask, **kwargs)

    return forward
