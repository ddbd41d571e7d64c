"""MiniMax-Text-01 (`minimax`): lightning attention layers beside softmax attention (docs/concepts/recurrent-state.md).

A lightning attention layer is linear attention with a fixed decay per head: with q, k, v = act(qkv_proj(x)) split
per head, its state S_t = exp(-s) S_{t-1} + k_t v_t^T (dk x dv) and its output o_t = q_t S_t, computed in blocks of
`block_size` tokens (within a block by the decayed q k^T, across blocks through S), then normed, gated by
sigmoid(output_gate(x)) and projected. The recurrence is inline in the layer's forward, so hfcp's forward
reproduces it (the family's code is checked first against the source transformers 5.24 ships, a fingerprint: a
version that changes it is refused, not guessed): the same projections, padding rule and blocks on each run of this
rank's tokens, and the state at the run's start folded from the runs before it as a scalar decay per head
(hfcp/mixers/state_fold.py `scalar_decay_over_ranks`: S^T plays Mamba-2's state, q its read vector).

What transformers does on one device, and hfcp reproduces: q, k and v are zeroed at padded positions (the family's
`apply_mask_to_padding_states`, given this rank's columns of the padding, as for the other recurrent layers); the
decay runs on over them. Packed rows are refused: the recurrence crosses document boundaries while the softmax
attention layers keep documents apart.
"""
from __future__ import annotations

import sys

import torch

from hfcp.mixers.binding import check_step_tokens, local_key_valid
from hfcp.families.source_guard import check_source
from hfcp.families.registry import Patcher, register_patcher
from hfcp.mixers.state_fold import scalar_decay_over_ranks

from .verified import TRANSFORMERS_VERSION

# source_fingerprint (hfcp/families/source_guard.py) of the code hfcp reproduces: the forward, and the decays its
# blocks and the fold use
FINGERPRINTS = {"MiniMaxLightningAttention.forward": "03c3f915c0c99c09",
                "MiniMaxLightningAttention.decay_factors": "ad8879a83947a830",
                "MiniMaxLightningAttention.get_slope_rate": "c7263d11caad997b"}


def lightning_blocks(module, q, k, v):
    """The layer's blocked recurrence from a zero state, on (B, n, H, d) q, k, v: (out (B, n, H, dv), the final
    state transposed, S^T (B, H, dv, dk)), block by block as the family computes it."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, n, d)
    state = q.new_zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))  # (B, H, dk, dv)
    out = []
    for start in range(0, q.shape[2], module.block_size):
        qb, kb, vb = (t[:, :, start:start + module.block_size] for t in (q, k, v))
        size = qb.shape[2]
        within = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * module.diagonal_decay[:, :, :size, :size], vb)
        out.append(within + torch.matmul(qb * module.query_decay[:, :size], state))
        state = (state * torch.exp(-module.slope_rate * size)
                 + torch.matmul((kb * module.key_decay[:, -size:]).transpose(-1, -2), vb))
    return torch.cat(out, 2).transpose(1, 2), state.transpose(-1, -2)


def lightning_forward(state, module, step_of):
    """The forward hfcp binds to a lightning attention layer: the family's computation with the recurrence over the
    global sequence."""
    check_source(module, FINGERPRINTS, TRANSFORMERS_VERSION)
    pad_states = sys.modules[type(module).__module__].apply_mask_to_padding_states  # the family's own rule
    group = state.mesh.cp_group

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"hfcp: a cache in {type(self).__name__} (generation): unpatch to generate")
        step = step_of()
        check_step_tokens(self, hidden_states, step, "lightning attention")
        batch, length, _ = hidden_states.shape
        qkv = pad_states(self.act_fn(self.qkv_proj(hidden_states)), local_key_valid(step))
        qkv = qkv.reshape(batch, length, self.num_attention_heads, 3 * self.head_dim)
        q, k, v = torch.split(qkv, self.head_dim, dim=3)
        log_decay = (-self.slope_rate.reshape(1, 1, -1)).expand(batch, length, -1)  # (B, L, H)

        def run(q, k, v, return_final_states):
            return lightning_blocks(self, q, k, v)

        out = scalar_decay_over_ranks(run, log_decay, q, {"q": q, "k": k, "v": v}, step, group, v.dtype)
        out = self.norm(out.reshape(batch, length, self.num_attention_heads * self.head_dim))
        out = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * out)
        return out, None

    return forward


register_patcher(Patcher(model_type="minimax", attention_classes=(), read_from_model=True,
                         verified_with=TRANSFORMERS_VERSION,
                         mixers=(("MiniMaxLightningAttention", lightning_forward),)), replace=True)
