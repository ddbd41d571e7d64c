"""LFM2, LFM2-MoE and LFM3: hybrids of attention layers and gated short convolutions (docs/concepts/recurrent-state.md).

A short-conv layer computes y = out_proj(C * conv(B * x)), where in_proj(h) = (B, C, x) and conv is a causal
depthwise convolution of kernel `conv_L_cache`; it mixes tokens only through that convolution, which hfcp computes
over the global sequence with a halo from the previous chunk (hfcp/mixers/conv_halo.py). The attention layers are read
from the model like any family. The module's own forward is replaced while patched, after checking that its code
is the code fingerprinted below (a newer transformers that changes it is refused, not guessed).

What transformers does on one device, and hfcp reproduces:
- padding: the layer input is zeroed at padded positions (the family's own `apply_mask_to_padding_states`, called
  with this rank's columns of the padding, from the step: the mask transformers passes the layer is cut to the
  local length, which under CP is another rank's columns);
- packed rows: the torch path of `causal_conv1d_fn` ignores document boundaries (its `seq_idx` and other keyword
  arguments are dropped), while the attention layers keep documents apart; hfcp refuses packed rows here rather
  than pick one of the two.
"""
from __future__ import annotations

import sys

from hfcp.mixers.conv_halo import causal_depthwise_conv1d
from hfcp.mixers.binding import check_step_tokens, local_key_valid
from hfcp.families.registry import Patcher, register_patcher
from hfcp.families.source_guard import check_source

from .verified import TRANSFORMERS_VERSION

# source_fingerprint of the short-conv forward hfcp's forward reproduces, in transformers 5.24 (the same in all three)
FINGERPRINTS = {f"{cls}.forward": "1d07ca85b588af88" for cls in ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")}


def _check_form(module) -> None:
    check_source(module, FINGERPRINTS, TRANSFORMERS_VERSION)
    conv = module.conv
    if conv.padding[0] != conv.kernel_size[0] - 1 or conv.groups != conv.in_channels:
        raise ValueError(f"hfcp: {type(module).__name__}'s conv is not a causal depthwise convolution; this model is "
                         "not supported")


def short_conv_forward(state, module, step_of):
    """The forward hfcp binds to a short-conv module (its form checked once, here, at patch time): the layer's own
    computation, with its convolution over the global sequence. step_of() is the step of the current call."""
    _check_form(module)
    pad_states = sys.modules[type(module).__module__].apply_mask_to_padding_states  # the family's own rule

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        step = step_of()
        if cache is not None:
            raise ValueError("hfcp: a cache in a short-convolution layer (generation): unpatch to generate")
        check_step_tokens(self, hidden_states, step, "short convolution")
        # hfcp's own end padding is zeroed too, which a causal convolution never carries back
        valid = local_key_valid(step)
        hidden_states = pad_states(hidden_states, valid)
        B, C, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
        weight = self.conv.weight.squeeze(1)
        mixed = causal_depthwise_conv1d((B * x).to(weight.dtype), weight, self.conv.bias, step, state.mesh.cp_group)
        y = C * mixed.to(B.dtype)
        return self.out_proj(y.transpose(-1, -2).contiguous())

    return forward


for _type, _cls in (("lfm2", "Lfm2ShortConv"), ("lfm2_moe", "Lfm2MoeShortConv"), ("lfm3", "Lfm3ShortConv")):
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True,
                             verified_with=TRANSFORMERS_VERSION, mixers=((_cls, short_conv_forward),)), replace=True)
