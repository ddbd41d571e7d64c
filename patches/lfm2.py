"""LFM2, LFM2-MoE and LFM3: hybrids of attention layers and gated short convolutions (issue 19).

A short-conv layer computes y = out_proj(C * conv(B * x)), where in_proj(h) = (B, C, x) and conv is a causal
depthwise convolution of kernel `conv_L_cache`; it mixes tokens only through that convolution, which hfcp computes
over the global sequence with a halo from the previous chunk (hfcp/conv_halo.py). The attention layers are read
from the model like any family. The module's own forward is replaced while patched, after checking that its code
is the form above (a newer transformers that changes it is refused, not guessed).

What transformers does on one device, and hfcp reproduces:
- padding: the layer input is zeroed at padded positions, only for batches of more than one row
  (`apply_mask_to_padding_states`); hfcp takes the padding from the step (the mask transformers passes the layer
  is cut to the local length, which under CP is another rank's columns);
- packed rows: the torch path of `causal_conv1d_fn` ignores document boundaries (its `seq_idx` and other keyword
  arguments are dropped), while the attention layers keep documents apart; hfcp refuses packed rows here rather
  than pick one of the two.
"""
from __future__ import annotations

import inspect

from hfcp.conv_halo import causal_depthwise_conv1d
from hfcp.registry import Patcher, register_patcher

from .verified import TRANSFORMERS_VERSION

# the statements of the short-conv forward that hfcp's forward reproduces
_FORM = ("hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)",
         "BCx = self.in_proj(hidden_states).transpose(-1, -2)", "B, C, x = BCx.chunk(3, dim=-2)",
         "hidden_states = B * x", "causal_conv1d_fn(hidden_states, self.conv.weight.squeeze(1), self.conv.bias",
         "y = C * hidden_states", "y = self.out_proj(y)")


def _check_form(module) -> None:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = ""
    missing = [line for line in _FORM if line not in source]
    if missing or module.conv.padding[0] != module.conv.kernel_size[0] - 1 or module.conv.groups != module.conv.in_channels:
        raise ValueError(f"hfcp: {type(module).__name__}'s forward is not the gated short convolution hfcp reproduces "
                         f"(missing: {missing or 'a causal depthwise conv'}); this transformers version is not supported")


def short_conv_forward(state):
    """The forward hfcp binds to each short-conv module: the layer's own computation, its convolution over the
    global sequence."""

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        _check_form(self)
        step = state.step
        if cache is not None:
            raise ValueError("hfcp: a cache in a short-convolution layer (generation): unpatch to generate")
        if step is None or hidden_states.shape[1] != step.layout.local_len:
            raise RuntimeError(f"hfcp: {type(self).__name__} got {hidden_states.shape[1]} tokens outside a step of the "
                               "patched model (call the patched model, not its layers)")
        if step.doc_ids is not None:
            raise ValueError(f"hfcp: packed rows (position_ids restarting inside a row) in {type(self).__name__}: "
                             "transformers' short convolution crosses document boundaries while its attention does "
                             "not, so hfcp refuses them; pass one document per row (padding is exact)")
        if step.key_valid is not None and hidden_states.shape[0] > 1:  # as apply_mask_to_padding_states
            valid = step.key_valid.index_select(1, step.local_index.to(step.key_valid.device))
            hidden_states = (hidden_states * valid[:, :, None]).to(hidden_states.dtype)
        B, C, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
        weight = self.conv.weight.squeeze(1)
        mixed = causal_depthwise_conv1d((B * x).to(weight.dtype), weight, self.conv.bias, step, state.mesh.cp_group)
        y = C * mixed.to(B.dtype)
        return self.out_proj(y.transpose(-1, -2).contiguous())

    return forward


for _type, _cls in (("lfm2", "Lfm2ShortConv"), ("lfm2_moe", "Lfm2MoeShortConv"), ("lfm3", "Lfm3ShortConv")):
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True,
                             verified_with=TRANSFORMERS_VERSION, mixers=((_cls, short_conv_forward),)), replace=True)
