"""hfcp.balance_report: per-rank tokens, attention work and bytes of a batch under a layout, counted from the batch
and the model's config: no forward, no process group, so a user can plan before launching."""
from __future__ import annotations

import torch

from .attention.blocks import MaskSpec
from .attention.interface import attention_chunk
from .attention.volume import comm_bytes
from .balance import balanced_layout, segment_starts
from .checks import check_shapes
from .families.resolve import patcher_for, plan_patch
from .hooks.batch import default_positions, take_packed_lengths, text_positions
from .layout import Layout, StepBatch, build_step_batch
from .state import Settings, cp_state, find_pretrained
from .work import imbalance, position_work, rank_work

BALANCE_CHOICES = ("row",)


def layer_masks(modules, causal: bool) -> list[tuple[MaskSpec, int]]:
    """(mask, number of layers) of the model's attention modules, as their calls pass it: each module's own
    sliding_window (Gemma, Qwen2), else its config's (Mistral), and its layer's attention chunk (Llama 4)."""
    counts: dict[MaskSpec, int] = {}
    for m in modules:
        window = getattr(m, "sliding_window", getattr(getattr(m, "config", None), "sliding_window", None))
        spec = MaskSpec(causal, int(window) if window else None, chunk=attention_chunk(m))
        counts[spec] = counts.get(spec, 0) + 1
    return list(counts.items()) or [(MaskSpec(causal, None), 1)]


def _model_facts(model, cp_size):
    """(cp, patcher, attention modules, model kind, strategy, ulysses size) of a patched model (its settings) or of
    an unpatched one planned for cp_size with the default strategy."""
    state = cp_state(model)
    if state is not None:
        if cp_size is not None and cp_size != state.mesh.cp_size:
            raise ValueError(f"cp_size={cp_size} but the model is patched with cp_size={state.mesh.cp_size}; leave "
                             "cp_size out to report the patched layout")
        p = state.patcher
        kind = "vision" if p.embeddings_classes else "vlm" if p.language_model else "lm"
        u = getattr(state.attention_group, "ulysses_size", None)
        return state.mesh.cp_size, p, state.modules, kind, state.strategy, u
    if cp_size is None:
        raise ValueError("balance_report of an unpatched model needs cp_size= (the ranks of one CP group)")
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive int")
    inner = find_pretrained(model)
    plan = plan_patch(inner, patcher_for(inner), Settings(cp_size))
    return cp_size, plan.patcher, plan.modules, plan.kind, "ring", None


def _step_of(patcher, layout: Layout, batch: dict) -> StepBatch:
    """The step's documents and key padding as the hooks derive them from the whole batch."""
    kw = dict(batch)
    x = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
    B, L = x.shape[:2]
    check_shapes({k: kw.get(k) for k in ("attention_mask", "position_ids")}, B, L)
    take_packed_lengths(kw, B, L)
    mask, pos = kw.get("attention_mask"), kw.get("position_ids")
    if pos is None:
        pos = default_positions(patcher, mask, B, L, x.device)
    pos = pos.expand(*pos.shape[:-2], B, L) if pos.dim() >= 2 else pos.expand(B, L)
    return build_step_batch(layout, 0, B, text_positions(pos), mask, "cpu")


def _counts(layout: Layout, work: torch.Tensor, volume: float) -> dict:
    per_rank = rank_work(layout, work)
    return {"tokens": [layout.local_len] * layout.cp_size, "attention_work": per_rank,
            "imbalance": imbalance(per_rank), "bytes_per_layer": [volume] * layout.cp_size,
            "ranges": [list(layout.ranges(r)) for r in range(layout.cp_size)]}


def balance_report(model, cp_size: int | None = None, balance: str | None = None, **batch) -> dict:
    """Per-rank tokens, attention work and communication of `batch` under the layout hfcp uses, counted without
    running the model or a process group.

    Args:
        model: a patched model (its cp_size and strategy are read) or an unpatched one (pass cp_size; the strategy
            counted is "ring").
        cp_size: ranks of one CP group (an unpatched model only; a patched model's must match when given).
        balance: the layout to report: None or "row" (the layout hfcp runs today: zigzag for causal models,
            contiguous otherwise).
        **batch: the model's inputs as they would be passed to it: input_ids or inputs_embeds, and position_ids
            (resets mark packed documents), attention_mask, cu_seq_lens_q/k as the forward takes them; others ignored.
    Returns:
        {"layout": the name of the layout, "tokens", "attention_work", "bytes_per_layer": per rank,
         "imbalance": max / mean attention work, "ranges": each rank's (start, length) global ranges,
         "row": the same dict for the row layout, "balanced_plan": the same dict for the layout hfcp.balance plans
         for this batch, which hfcp does not run yet (or the row layout's when the batch has no packed documents or
         the model cannot take another layout; "reason" then says why)}.
        attention_work counts the allowed query-key pairs of each rank's queries under the model's masks (causal,
        sliding windows, attention chunks, documents, key padding), summed over the batch's rows and the model's
        attention layers; bytes_per_layer is what a rank sends per attention layer in one training step.
    Raises:
        ValueError: an unknown balance, no cp_size for an unpatched model, a batch without input_ids or inputs_embeds.
        UnsupportedModelError: a model hfcp.patch would refuse.
    """
    if balance not in (None,) + BALANCE_CHOICES:
        raise ValueError(f"balance={balance!r} is not one of {list(BALANCE_CHOICES)} (or None: the model's setting)")
    if batch.get("input_ids") is None and batch.get("inputs_embeds") is None:
        raise ValueError("balance_report needs the batch's input_ids or inputs_embeds (its shape: rows x tokens)")
    cp, patcher, modules, kind, strategy, u = _model_facts(model, cp_size)
    x = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    row = Layout(x.shape[1], cp, zigzag=patcher.causal)
    sb = _step_of(patcher, row, batch)
    work = position_work(layer_masks(modules, patcher.causal), sb)
    cfg = find_pretrained(model).config.get_text_config()
    heads = getattr(cfg, patcher.num_heads_attr, None) or 1
    kv_heads = getattr(cfg, patcher.num_kv_heads_attr, None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    element = next(find_pretrained(model).parameters()).element_size()
    volume = comm_bytes(strategy, x.shape[0], row.padded_len, heads, kv_heads, head_dim, cp, u, element) \
        if cp > 1 else 0.0
    report = {"layout": "row", **_counts(row, work, volume)}
    report["row"] = _counts(row, work, volume)
    reason = _why_row_only(kind, patcher, sb)
    planned = row if reason else balanced_layout(row, work, segment_starts(sb.doc_ids, row.padded_len))
    report["balanced_plan"] = {**_counts(planned, work, volume),
                               "reason": reason or ("" if planned.balanced else "the row layout is as balanced")}
    return report


def _why_row_only(kind: str, patcher, sb: StepBatch) -> str:
    """Why this model or batch keeps the row layout, or ""."""
    if kind != "lm":
        return f"a {'vision' if kind == 'vision' else 'vision-language'} model keeps the row layout"
    if patcher.mixers:
        return "recurrent mixers pass their state in sequence order: the row layout"
    if sb.doc_ids is None:
        return "no packed documents (position_ids resets without an attention_mask)"
    return ""
