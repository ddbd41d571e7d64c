"""Hooks for token-sequence models (ViT, VideoMAE, ViViT, DINOv2): shard right after the embeddings, and give
heads exactly what they see on one device.

- the embeddings module's output (B, N, H) is padded to a multiple of cp, split contiguously, and its
  padding masked as keys (bidirectional attention needs no load balancing);
- a classification model: its base model's sequence output is gathered (autograd all-gather, padding
  stripped) before the head, so CLS / mean pooling, logits and loss are whole and identical on every rank;
- a base model: last_hidden_state stays local; pooler_output is computed from the global CLS token.
"""
from __future__ import annotations

import weakref

import torch

from accelerate.hooks import ModelHook, add_hook_to_module

from ..distributed.input_checks import check_same_batch
from ..compiler import eager
from .batch import as_kwargs
from .output_stamps import check_attention_ran, first_field
from ..distributed.collectives import all_gather
from ..state import ForwardData
from ..layout import Layout, build_step_batch


class ShardEmbeddingsHook(ModelHook):
    """On the embeddings module: its (B, N, H) output -> this rank's (B, N_pad/cp, H) slice, and the step layout."""

    def __init__(self, state, model):
        self.state, self.model = state, model
        self._last = None  # weakref to the previous forward's sharded output: alive while its graph is

    def _refuse_if_recompute_would_see_this_layout(self, N: int) -> None:
        last = self._last() if self._last is not None else None
        if last is None or not last.requires_grad:
            return
        if any(getattr(m, "gradient_checkpointing", False) for m in self.model.modules()):
            raise ValueError(
                f"a forward with {N} tokens while the graph of the previous forward ({self.state.step.layout.seq_len} "
                "tokens) is still alive under gradient checkpointing: its layers would be recomputed in backward "
                "with this forward's layout. Run backward (or drop the previous outputs) before a forward with "
                "another token count, or disable gradient checkpointing"
            )

    @eager
    def post_forward(self, module, output):
        st = self.state
        N = output.shape[1]
        layout = Layout(N, st.mesh.cp_size, zigzag=False)
        kv = st.step.key_valid if st.step is not None else None
        if st.step is None or st.step.layout != layout or (kv is not None and kv.device != output.device):
            if st.step is not None and st.step.layout != layout:
                self._refuse_if_recompute_would_see_this_layout(N)
            # one row for the whole batch: the only mask is the layout's padding, the same for every image, so
            # the step depends on N alone and a checkpointed layer recomputed after a later forward of another
            # batch with the same N sees exactly its own step (block plans are reused too)
            st.step = build_step_batch(layout, st.mesh.cp_rank, 1, None, None, output.device)
        local = st.step.local(output, fill=0.0)  # (B, N_pad/cp, H)
        self._last = weakref.ref(local)
        return local


class CheckPixelsHook(ModelHook):
    """Top-level: every rank of a CP group must get the same pixels (and labels)."""

    def __init__(self, state):
        self.state = state

    @eager
    def pre_forward(self, module, *args, **kwargs):
        kwargs = as_kwargs(module, args, kwargs)
        for name in ("attention_mask", "bool_masked_pos", "head_mask"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"{name} is not supported by hfcp on {type(module).__name__}: the token sequence is split "
                    "after the embeddings and this argument would be silently ignored or mis-split; drop it, "
                    "or call hfcp.unpatch(model)"
                )
        if self.state.check_inputs:
            names = ("pixel_values", "labels")
            check_same_batch(kwargs, self.state.mesh.cp_group, names)
        self.state.fwd = ForwardData()
        return (), kwargs

    @eager
    def post_forward(self, module, output):
        st = self.state
        check_attention_ran(st, module)
        st.fwd.local_output_names = stamp_local_sequences(output, st)
        if st.head != "base":
            return output
        with_module = st.patcher.first_token_pooler and getattr(module, "pooler", None) is not None
        if not (with_module or st.patcher.pooler_output_is_first_token):
            return output
        hidden = first_field(output, "last_hidden_state")
        firsts = all_gather(hidden[:, :1], st.mesh.cp_group, dim=1)  # (B, cp, H): [:, 0] is the global CLS
        pooled = module.pooler(firsts) if with_module else firsts[:, 0]
        if isinstance(output, tuple):
            return (output[0], pooled, *output[2:])
        output["pooler_output"] = pooled
        return output


def stamp_local_sequences(output, state) -> frozenset:
    """Tag the outputs that stay local (a base model's last_hidden_state, any model's hidden_states) with their
    step, so that gather_sequence (and HfcpTrainer's predictions) know them from whole tensors. Returns the names
    of those output fields."""
    get = (lambda k: None) if isinstance(output, tuple) else output.get
    fields = [("last_hidden_state", get("last_hidden_state"))] if state.head == "base" else []
    fields += [("hidden_states", t) for t in get("hidden_states") or ()]
    names = set()
    for name, t in fields:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == state.step.layout.local_len:
            t.hfcp_step = state.step
            names.add(name)
    return frozenset(names)


class GatherForHeadHook(ModelHook):
    """On the base model inside a classification model: its sequence output becomes the full sequence."""

    def __init__(self, state):
        self.state = state

    @eager
    def post_forward(self, module, output):
        st = self.state
        hidden = first_field(output, "last_hidden_state")
        layout = st.step.layout
        full = all_gather(hidden, st.mesh.cp_group, dim=1)  # contiguous: rank order is sequence order
        full = full[:, : layout.seq_len]
        if isinstance(output, tuple):
            return (full, *output[1:])
        output["last_hidden_state"] = full
        return output


def attach(inner, state, embeddings) -> list:
    """Attach the token hooks; returns [(module, hook)] for unpatch."""
    hooks = [(embeddings, ShardEmbeddingsHook(state, inner)), (inner, CheckPixelsHook(state))]
    if state.head == "classification":
        hooks.append((inner.base_model, GatherForHeadHook(state)))
    for module, hook in hooks:
        add_hook_to_module(module, hook, append=True)
    return hooks
