"""Recurrent layers with a chunked scan (docs/concepts/recurrent-state.md): gated delta nets (Qwen3-Next, Qwen3.5 and
its MoE, OLMo-hybrid, Lara-mini), Kimi delta attention (Kimi-Linear, Bailing-hybrid) and Mamba-2 (mamba2, Bamba,
Falcon-H1, Granite-4.0-H), each in a hybrid with attention layers (Mamba-2 also alone).

Such a layer mixes tokens only in calls of module-level functions of its family: the padding rule
`apply_mask_to_padding_states`, the causal depthwise convolution `causal_conv1d_fn`, and its chunked scan
(`torch_chunk_gated_delta_rule`; `chunk_kimi_delta_attention`, whose decay is per key dimension;
`mamba2_chunk_scan`); the per-token decode steps run only with a cache, and Mamba-2's fused training kernel only
with mamba-ssm. While patched, hfcp runs the family's own forward code with those names bound to its
context-parallel versions:
- the padding: the family's rule, with this rank's columns of the padding from the step (the mask transformers
  passes the layer is cut to the local length, another rank's columns under CP);
- the convolution: over the global sequence with a halo from the chunk before (hfcp/mixers/conv_halo.py);
- the scan: the family's kernel on each run of this rank's tokens, with the state at the run's start folded from
  the runs before it (hfcp/mixers/state_fold.py; Mamba-2's decay is a scalar per head, folded as such);
- the decode steps and the fused kernel (which has no halo): refused, or declined so that the torch path runs; the
  scan is always the family's torch kernel (flash-linear-attention's and mamba-ssm's have not run under hfcp).
The forward's code is checked first: the globals it reads must be those names and torch, each token-mixing call
appears as often as in the form hfcp knows, and it never calls its convolution module; a newer transformers that
changes the form is refused, not guessed.

What transformers does on one device, and hfcp reproduces: padded positions are zeroed where the family zeroes them
(left padding exact). Packed rows are refused: the torch paths raise or cross document boundaries without
flash-linear-attention / mamba-ssm, while the attention layers keep documents apart.
"""
from __future__ import annotations

import dis
import inspect
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from hfcp.mixers.conv_halo import causal_depthwise_conv1d
from hfcp.mixers.binding import check_step_tokens, local_key_valid
from hfcp.families.registry import Patcher, register_patcher
from hfcp.mixers.state_fold import channel_decay_over_ranks, chunked_rule_over_ranks, scalar_decay_over_ranks

from .verified import TRANSFORMERS_VERSION


@dataclass(frozen=True)
class Scan:
    """One kind of chunked scan, as the family code calls it."""

    chunked: str  # the chunked kernel's name in the family module
    decode: str  # its per-token decode step (cache only)
    masks: int  # how often the forward calls apply_mask_to_padding_states
    fused: str = ""  # a fused training kernel the forward tries first (it returns None without its package)


DELTA = Scan("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", masks=1)
KDA = Scan("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", masks=1)
MAMBA2 = Scan("mamba2_chunk_scan", "mamba2_selective_state_update", masks=2, fused="mamba2_split_conv1d_scan_combined")
MAMBA1 = Scan("mamba_selective_scan", "mamba_selective_state_update", masks=2, fused="mamba_inner_fn")
SCANS = (DELTA, KDA, MAMBA2, MAMBA1)
RULES = tuple((s.chunked, s.decode) for s in SCANS)  # (chunked kernel, decode step) names
_OTHER_GLOBALS = ("apply_mask_to_padding_states", "causal_conv1d_fn", "causal_conv1d_update", "torch", "F",
                  "hasattr", "range")  # builtins Falcon-Mamba, Jamba (a quantized config) and Zamba (a loop over heads) use


def _raw_forward(module):
    """(the family's forward code without transformers' decorators (kwarg renames, accelerate offload hooks), its
    Scan)."""
    forward = inspect.unwrap(type(module).forward)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        source = ""
    used = {i.argval for i in dis.get_instructions(forward) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    scan = next((s for s in SCANS if s.chunked in used), DELTA)
    counts = {"apply_mask_to_padding_states(": scan.masks, "causal_conv1d_fn(": 1, f"{scan.chunked}(": 1,
              "hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)": 1}
    problems = [f"{call} {source.count(call)} times, not {n}" for call, n in counts.items() if source.count(call) != n]
    problems += sorted(used - set(_OTHER_GLOBALS + (scan.chunked, scan.decode, scan.fused)))
    problems += ["self.conv1d("] if "self.conv1d(" in source else []
    conv = getattr(module, "conv1d", None)
    if (problems or forward.__closure__ or not isinstance(conv, torch.nn.Conv1d)
            or conv.padding[0] != conv.kernel_size[0] - 1 or conv.groups != conv.in_channels):
        raise ValueError(f"hfcp: {type(module).__name__}'s forward is not the recurrent layer hfcp reproduces "
                         f"(differs at: {problems or 'its convolution'}); this transformers version is not supported")
    if any(getattr(m, "_hf_hook", None) is not None for m in module.modules()):
        raise ValueError(f"hfcp: {type(module).__name__} has accelerate hooks (device_map offloading): hfcp runs its "
                         "forward without them; load the model without offloading to train it under CP")
    return forward, scan


def _refuse_state(initial, final, packed) -> None:
    if initial is not None or final or packed is not None:
        raise ValueError("hfcp: a recurrent scan with a cache or packed sequences: unpatch to generate, and pass one "
                         "document per row")


def _refuse_unknown_tensors(options: dict, known: tuple) -> None:
    """A tensor argument of the scan that hfcp does not know could be per token, which the runs would not cut."""
    unknown = sorted(k for k, v in options.items() if isinstance(v, torch.Tensor) and k not in known)
    if unknown:
        raise ValueError(f"hfcp: the recurrent scan gets tensor arguments {unknown} that hfcp does not split over the "
                         "ranks; this transformers version is not supported")


def _delta_rule(kernel, step_of, group):
    """The family's delta-rule kernel over the global sequence; its output in the kernel's dtype (the query's)."""
    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **options):
        _refuse_state(initial_state, output_final_state, cu_seqlens)
        _refuse_unknown_tensors(options, ())
        out = chunked_rule_over_ranks(kernel, query, key, value, {"g": g, "beta": beta}, step_of(), group,
                                      out_dtype=query.dtype, **options)
        return out, None

    return rule


def _mamba2_scan(kernel, step_of, group):
    """mamba2_chunk_scan over the global sequence. Its state h (B, H, head_dim, N) decays by one scalar per head and
    token, exp(A dt_t) with dt_t discretised as the kernel does (dt + dt_bias, softplus, clamped to dt_limit), and is
    read by C_t: hfcp/mixers/state_fold.py's scalar-decay fold."""
    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), return_final_states=False, seq_idx=None, cu_seqlens=None, **options):
        _refuse_state(initial_states, return_final_states, seq_idx if seq_idx is not None else cu_seqlens)
        _refuse_unknown_tensors(options, ())  # a gate z would be per token: refused
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


def _mamba1_scan(kernel, step_of, group):
    """mamba_selective_scan over the global sequence. Its state h (B, D, N) decays elementwise, by exp(A dt_t) with
    dt_t discretised as the kernel does (dt + delta_bias, softplus), and is read by C_t: hfcp/mixers/state_fold.py's
    channel-decay fold. The gate z multiplies the output after the state's contribution, so the kernel runs without
    it and hfcp applies it to the corrected output."""
    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
             **options):
        _refuse_state(None, return_last_state, None)
        _refuse_unknown_tensors(options, ())
        rate = dt + delta_bias.to(dt.dtype)[..., None] if delta_bias is not None else dt  # (B, D, L)
        rate = F.softplus(rate) if delta_softplus else rate

        def run(hidden_states, dt, B, C):
            return kernel(hidden_states, dt, A, B, C, D=D, z=None, delta_bias=delta_bias, delta_softplus=delta_softplus,
                          return_last_state=True, **options)

        out = channel_decay_over_ranks(run, rate, A, C, {"hidden_states": hidden_states, "dt": dt, "B": B, "C": C},
                                       step_of(), group)
        return out * F.silu(z) if z is not None else out

    return scan


def recurrent_forward(state, module, step_of):
    """The forward hfcp binds to a recurrent module (checked once, here, at patch time): the family's own code with
    its token-mixing calls over the global sequence. step_of() is the step of the current call."""
    raw, scan = _raw_forward(module)
    family = sys.modules[type(module).__module__]
    # the torch kernel under transformers' hub wrapper: with flash-linear-attention or mamba-ssm installed the wrapper
    # dispatches to their kernels, which have not run under hfcp (no GPU yet), so hfcp keeps to the torch path
    pad_states, kernel = family.apply_mask_to_padding_states, inspect.unwrap(getattr(family, scan.chunked))
    group = state.mesh.cp_group

    def padding(hidden_states, attention_mask):  # (B, L_local, ...): this rank's columns of the padding, from the step
        return pad_states(hidden_states, local_key_valid(step_of()))

    def convolution(x, weight, bias=None, activation=None, **kwargs):  # (B, C, L_local) -> the same
        _refuse_unknown_tensors(kwargs, ())  # seq_idx (packed documents) is refused with the step's packed rows
        out = causal_depthwise_conv1d(x.to(weight.dtype), weight, bias, step_of(), group)
        return (ACT2FN[activation](out) if activation is not None else out).to(x.dtype)

    def decode_step(*args, **kwargs):
        raise ValueError(f"hfcp: {type(module).__name__}'s cached decode step (generation): unpatch to generate")

    def no_fused_kernel(*args, **kwargs):  # the family then takes its torch path, whose calls hfcp replaces
        return None

    chunked = {MAMBA2: _mamba2_scan, MAMBA1: _mamba1_scan}.get(scan, _delta_rule)(kernel, step_of, group)
    bound = dict(raw.__globals__, apply_mask_to_padding_states=padding, causal_conv1d_fn=convolution,
                 causal_conv1d_update=decode_step, **{scan.chunked: chunked, scan.decode: decode_step})
    if scan.fused:
        bound[scan.fused] = no_fused_kernel
    code = types.FunctionType(raw.__code__, bound, raw.__name__, raw.__defaults__)
    code.__kwdefaults__ = raw.__kwdefaults__

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("cache_params", None)
        if cache is not None:
            raise ValueError(f"hfcp: a cache in {type(self).__name__} (generation): unpatch to generate")
        check_step_tokens(self, hidden_states, step_of(), "recurrent scan")
        return code(self, hidden_states, cache=None, attention_mask=attention_mask, **kwargs)

    return forward


RECORDS = (("qwen3_next", "Qwen3NextGatedDeltaNet"), ("qwen3_5_text", "Qwen3_5GatedDeltaNet"),
           ("qwen3_5_moe_text", "Qwen3_5MoeGatedDeltaNet"), ("olmo_hybrid", "OlmoHybridGatedDeltaNet"),
           ("lara_mini", "LaraMiniGatedDeltaNet"),
           ("kimi_linear", "KimiLinearDeltaAttention"), ("bailing_hybrid", "BailingHybridDeltaAttention"),
           ("mamba2", "Mamba2Mixer"), ("bamba", "BambaMixer"), ("falcon_h1", "FalconH1Mixer"),
           ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
           ("mamba", "MambaMixer"), ("falcon_mamba", "FalconMambaMixer"), ("jamba", "JambaMambaMixer"),
           ("zamba", "ZambaMambaMixer"), ("zamba2", "Zamba2MambaMixer"), ("nemotron_h", "NemotronHMamba2Mixer"))
TOKEN_WISE = {"nemotron_h": ("NemotronHMLP", "NemotronHMoE")}  # its layers without a mixer hold one of these
for _type, _cls in RECORDS:
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True,
                             verified_with=TRANSFORMERS_VERSION, mixers=((_cls, recurrent_forward),),
                             token_wise_classes=TOKEN_WISE.get(_type, ())), replace=True)
