"""Recurrent layers with a chunked scan (docs/concepts/recurrent-state.md): gated delta nets (Qwen3-Next, Qwen3.5 and
its MoE, OLMo-hybrid, Lara-mini), Kimi delta attention (Kimi-Linear, Bailing-hybrid), Mamba-2 (mamba2, Bamba,
Falcon-H1, Granite-4.0-H, Zamba2, Nemotron-H) and Mamba 1 (mamba, Falcon-Mamba, Jamba, Zamba), each in a hybrid with
attention layers or alone.

The model knowledge: such a layer mixes tokens only in calls of module-level functions of its family (the padding
rule `apply_mask_to_padding_states`, the causal depthwise convolution `causal_conv1d_fn`, its chunked scan below),
the per-token decode steps run only with a cache, and the fused training kernels only with mamba-ssm. While patched,
hfcp runs the family's own forward with those names bound to their context-parallel versions
(hfcp/mixers/scans.py). The code hfcp runs, the forward and its scan kernel, must be the code fingerprinted below
(transformers 5.24): a version that changes it is refused, not guessed.

What transformers does on one device, and hfcp reproduces: padded positions are zeroed where the family zeroes them
(left padding exact). Packed rows are refused: the torch paths raise or cross document boundaries without
flash-linear-attention / mamba-ssm, while the attention layers keep documents apart.
"""
from __future__ import annotations

from functools import partial

from hfcp.families.registry import Patcher, register_patcher
from hfcp.mixers.scans import Scan, channel_decay_scan, delta_rule, scalar_decay_scan, scan_forward
from hfcp.families.source_guard import check_source

from .verified import TRANSFORMERS_VERSION

DELTA = Scan("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", delta_rule)
KDA = Scan("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", delta_rule)  # its decay per key dimension
MAMBA2 = Scan("mamba2_chunk_scan", "mamba2_selective_state_update", scalar_decay_scan,
              fused="mamba2_split_conv1d_scan_combined")
MAMBA1 = Scan("mamba_selective_scan", "mamba_selective_state_update", channel_decay_scan, fused="mamba_inner_fn")
RULES = tuple((s.chunked, s.decode) for s in (DELTA, KDA, MAMBA2, MAMBA1))  # (chunked kernel, decode step) names

# (model type, mixer class, its scan, source_fingerprint of its forward and of its scan kernel in transformers 5.24)
RECORDS = (
    ("qwen3_next", "Qwen3NextGatedDeltaNet", DELTA, "d97f22719fb58479", "a1bbf783aa6563be"),
    ("qwen3_5_text", "Qwen3_5GatedDeltaNet", DELTA, "08cf65a63ca582a2", "a1bbf783aa6563be"),
    ("qwen3_5_moe_text", "Qwen3_5MoeGatedDeltaNet", DELTA, "08cf65a63ca582a2", "a1bbf783aa6563be"),
    ("olmo_hybrid", "OlmoHybridGatedDeltaNet", DELTA, "bc540b7a213f93d0", "a1bbf783aa6563be"),
    ("lara_mini", "LaraMiniGatedDeltaNet", DELTA, "08cf65a63ca582a2", "a1bbf783aa6563be"),
    ("kimi_linear", "KimiLinearDeltaAttention", KDA, "18a6676bcbf5260a", "1a4cae129dee4cc9"),
    ("bailing_hybrid", "BailingHybridDeltaAttention", KDA, "aa638068a776c7df", "1a4cae129dee4cc9"),
    ("mamba2", "Mamba2Mixer", MAMBA2, "c215be341ddf22ff", "8f4198702b90b969"),
    ("bamba", "BambaMixer", MAMBA2, "c215be341ddf22ff", "8f4198702b90b969"),
    ("falcon_h1", "FalconH1Mixer", MAMBA2, "d0ddba7970a9ddd1", "8f4198702b90b969"),
    ("granitemoehybrid", "GraniteMoeHybridMambaLayer", MAMBA2, "c215be341ddf22ff", "8f4198702b90b969"),
    ("zamba2", "Zamba2MambaMixer", MAMBA2, "c215be341ddf22ff", "8f4198702b90b969"),
    ("nemotron_h", "NemotronHMamba2Mixer", MAMBA2, "c215be341ddf22ff", "8f4198702b90b969"),
    ("mamba", "MambaMixer", MAMBA1, "e025d5d2ff405a0d", "b43a3221205e6ecd"),
    ("falcon_mamba", "FalconMambaMixer", MAMBA1, "50ea2dc0ef2688ba", "b43a3221205e6ecd"),
    ("jamba", "JambaMambaMixer", MAMBA1, "f8a5666001aecbbb", "b43a3221205e6ecd"),
    ("zamba", "ZambaMambaMixer", MAMBA1, "dc6d39dacee427d1", "8d894aa71cbb6289"),
)
TOKEN_WISE = {"nemotron_h": ("NemotronHMLP", "NemotronHMoE")}  # its layers without a mixer hold one of these


def recurrent_forward(scan: Scan, fingerprints: dict, state, module, step_of):
    """The forward hfcp binds to a recurrent module, its code checked once, here, at patch time."""
    check_source(module, fingerprints, TRANSFORMERS_VERSION)
    return scan_forward(state, module, step_of, scan)


for _type, _cls, _scan, _forward, _kernel in RECORDS:
    _prints = {f"{_cls}.forward": _forward, f"{_cls}.{_scan.chunked}": _kernel}
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True,
                             verified_with=TRANSFORMERS_VERSION, mixers=((_cls, partial(recurrent_forward, _scan,
                                                                                          _prints)),),
                             token_wise_classes=TOKEN_WISE.get(_type, ())), replace=True)
