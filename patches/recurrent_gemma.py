"""RecurrentGemma (Griffin): RG-LRU recurrent blocks beside local (sliding-window) attention
(docs/concepts/recurrent-state.md).

A recurrent block computes linear_out(act(linear_y(x)) * rg_lru(conv(linear_x(x)))), with a causal depthwise
convolution of kernel `conv1d_width` and the RG-LRU, a linear recurrence whose state is its output:
h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t), with per-channel gates a_t, i_t of the token alone and a_t = 0
at a document start (position id 0). These two are its only token mixing. While patched, hfcp runs the family's own
forward code of both modules, on a view of the module whose convolution is hfcp's over the global sequence (a halo
from the chunk before, hfcp/mixers/conv_halo.py) and whose scan is the family's own `_rnn_scan` on each run of this
rank's tokens, the state at the run's start folded from the runs before it
(hfcp/mixers/state_fold.py `gated_sum_over_ranks`).

The code of the three functions is checked first against the source transformers 5.24 ships (a fingerprint): a
version that changes any of them is refused, not guessed.

What transformers does on one device, and hfcp reproduces: padding is not masked in these layers (a padded token
is a token); the convolution runs across document boundaries while the RG-LRU resets at them, and the attention
keeps documents apart, so packed rows are refused rather than pick one.
"""
from __future__ import annotations

import inspect

import torch

from hfcp.mixers.conv_halo import causal_depthwise_conv1d
from hfcp.mixers.binding import check_step_tokens
from hfcp.mixers.family_code import ModuleView
from hfcp.families.source_guard import check_source
from hfcp.families.registry import Patcher, register_patcher
from hfcp.mixers.state_fold import gated_sum_over_ranks

from .verified import TRANSFORMERS_VERSION

# hfcp.families.source_guard.source_fingerprint of each function whose code hfcp runs, as transformers 5.24 has it
FINGERPRINTS = {"RecurrentGemmaRecurrentBlock.forward": "cce3570274ab15aa",
                "RecurrentGemmaRglru.forward": "b4ad72fdf0d80030",
                "RecurrentGemmaRglru._rnn_scan": "edcf0cbffabce491"}


def _plain_conv(module) -> torch.nn.Conv1d:
    """The block's convolution, refused unless it is a plain causal depthwise nn.Conv1d (hfcp uses its weight, not
    its forward: a hook or a wrapper would be bypassed)."""
    conv = module.conv_1d
    if (type(conv) is not torch.nn.Conv1d or conv._forward_hooks or conv._forward_pre_hooks
            or conv.padding[0] != conv.kernel_size[0] - 1 or conv.groups != conv.in_channels):
        raise ValueError(f"hfcp: {type(module).__name__}'s conv_1d is {type(conv).__name__}, not the plain causal "
                         "depthwise convolution hfcp computes over the global sequence (an adapter or a hook on it is "
                         "not supported)")
    return conv


def block_forward(state, module, step_of):
    """The recurrent block's own forward, with its convolution over the global sequence."""
    check_source(module, FINGERPRINTS, TRANSFORMERS_VERSION)
    raw = inspect.unwrap(type(module).forward)
    group = state.mesh.cp_group
    _plain_conv(module)

    def convolution(x):  # (B, W, L_local) -> the same (the family slices [..., :seq_len], a no-op here)
        conv = _plain_conv(module)  # as it is now (a hook or an adapter added after patching is refused)
        return causal_depthwise_conv1d(x.to(conv.weight.dtype), conv.weight.squeeze(1), conv.bias, step_of(), group)

    def forward(self, input_states, position_ids, attention_mask, use_cache=True, **kwargs):
        if use_cache or kwargs.get("cache") is not None:
            raise ValueError(f"hfcp: a cache in {type(self).__name__} (generation): unpatch to generate")
        check_step_tokens(self, input_states, step_of(), "convolution")
        return raw(ModuleView(self, conv_1d=convolution), input_states, position_ids, attention_mask, use_cache=False,
                   **kwargs)

    return forward


def rg_lru_forward(state, module, step_of):
    """The RG-LRU's own forward, with its scan over the global sequence."""
    check_source(module, FINGERPRINTS, TRANSFORMERS_VERSION)
    raw, group = inspect.unwrap(type(module).forward), state.mesh.cp_group

    def scan(hidden_states, recurrent_gate, reset, recurrent_states=None):  # (B, L_local, W), (B, L_local, 1) bool
        if recurrent_states is not None:
            raise ValueError(f"hfcp: {type(module).__name__} holds a decode state (generation): unpatch to generate")

        def run(hidden_states, recurrent_gate, reset):  # the family's scan of one run from a zero state
            return module._rnn_scan(hidden_states=hidden_states, recurrent_gate=recurrent_gate, reset=reset,
                                    recurrent_states=None)

        # the runs in fp32 (the family's accumulation dtype), the corrected output rounded once, as the family does
        out = gated_sum_over_ranks(run, recurrent_gate * ~reset, {"hidden_states": hidden_states.float(),
                                   "recurrent_gate": recurrent_gate, "reset": reset}, step_of(), group)
        return out.to(hidden_states.dtype), None

    def forward(self, activations, position_ids):
        return raw(ModuleView(self, _rnn_scan=scan), activations, position_ids)

    return forward


register_patcher(Patcher(model_type="recurrent_gemma", attention_classes=(), read_from_model=True,
                         verified_with=TRANSFORMERS_VERSION,
                         mixers=(("RecurrentGemmaRecurrentBlock", block_forward),
                                 ("RecurrentGemmaRglru", rg_lru_forward)),
                         token_wise_classes=("RecurrentGemmaMlp",)), replace=True)  # not a recurrence: the MLP
