"""hfcp.balance_report: per-rank tokens, attention work and bytes of a batch under a layout, counted from the batch
and the model's config: no forward, no process group, so a user can plan before launching. hfcp.step_imbalance: the
same imbalance of the forward that just ran, from its layout."""
from __future__ import annotations

import torch

from .attention.volume import comm_bytes
from .distributed.input_checks import check_shapes
from .families.resolve import patcher_for, plan_patch
from .hooks.batch import check_input_dims, default_positions, take_packed_lengths, text_positions
from .layout import Layout, StepBatch, build_step_batch
from .layout.balance import step_layout, why_row_layout
from .layout.work import imbalance, layer_masks, position_work, rank_work, step_work, ulysses_width
from .state import Settings, check_balance, cp_state, find_pretrained


def _model_facts(model, cp_size):
    """(cp, patcher, attention modules, strategy, ulysses size, balance setting) of a patched model (its settings) or
    of an unpatched one planned for cp_size with patch's defaults."""
    state = cp_state(model)
    if state is not None:
        if cp_size is not None and cp_size != state.mesh.cp_size:
            raise ValueError(f"cp_size={cp_size} but the model is patched with cp_size={state.mesh.cp_size}; leave "
                             "cp_size out to report the patched layout")
        u = getattr(state.attention_group, "ulysses_size", None)
        return state.mesh.cp_size, state.patcher, state.modules, state.strategy, u, state.settings.balance
    if cp_size is None:
        raise ValueError("balance_report of an unpatched model needs cp_size= (the ranks of one CP group)")
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive int")
    inner = find_pretrained(model)
    plan = plan_patch(inner, patcher_for(inner), Settings(cp_size))
    return cp_size, plan.patcher, plan.modules, "ring", None, Settings().balance


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


def _counts(layout: Layout, work: torch.Tensor, volume: float, ulysses: int) -> dict:
    per_rank = rank_work(layout, work, ulysses)
    return {"layout": "balanced" if layout.balanced else "row", "tokens": [layout.local_len] * layout.cp_size,
            "attention_work": per_rank, "imbalance": imbalance(per_rank), "bytes_per_layer": [volume] * layout.cp_size,
            "ranges": [list(layout.ranges(r)) for r in range(layout.cp_size)]}


def balance_report(model, cp_size: int | None = None, balance: str | None = None, **batch) -> dict:
    """Per-rank tokens, attention work and communication of `batch` in a training forward, under the layout hfcp
    uses for it, counted without running the model or a process group.

    Args:
        model: a patched model (its cp_size, strategy and balance are read) or an unpatched one (pass cp_size; the
            strategy counted is "ring", the balance setting patch's default "auto").
        cp_size: ranks of one CP group (an unpatched model only; a patched model's must match when given).
        balance: the setting to report ("auto" or "row", as hfcp.patch takes it), or None: the model's.
        **batch: the model's inputs as they would be passed to it: input_ids or inputs_embeds, and position_ids
            (resets mark packed documents), attention_mask, cu_seq_lens_q/k as the forward takes them; others ignored.
    Returns:
        {"layout": "balanced" or "row", "tokens", "attention_work", "bytes_per_layer": per rank, "imbalance": max /
         mean attention work, "ranges": each rank's (start, length) global ranges, "reason": why the row layout is
         used ("" when balanced), "row": the same counts for balance="row"}.
        attention_work counts the allowed query-key pairs of each rank's queries under the model's masks (causal,
        sliding windows, attention chunks, documents, key padding), summed over the batch's rows and the model's
        attention layers (under "ulysses" and "usp", whose all-to-all gives every rank of a Ulysses group all of the
        group's queries for a share of the heads: the group's mean); bytes_per_layer is what a rank sends per attention
        layer in one training step.
    Raises:
        ValueError: an unknown balance, no cp_size for an unpatched model, a batch without input_ids or inputs_embeds
            or of a shape the forward refuses (not (batch, seq), no rows, no tokens).
        UnsupportedModelError: a model hfcp.patch would refuse.
    """
    if balance is not None:
        check_balance(balance)
    if batch.get("input_ids") is None and batch.get("inputs_embeds") is None:
        raise ValueError("balance_report needs the batch's input_ids or inputs_embeds (its shape: rows x tokens)")
    check_input_dims(batch.get("input_ids"), batch.get("inputs_embeds"))
    cp, patcher, modules, strategy, u, setting = _model_facts(model, cp_size)
    balance = balance or setting
    x = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    row = Layout(x.shape[1], cp, zigzag=patcher.causal)
    sb = _step_of(patcher, row, batch)
    masks = layer_masks(modules, patcher.causal)
    work = position_work(masks, sb)
    cfg = find_pretrained(model).config.get_text_config()
    heads = getattr(cfg, patcher.num_heads_attr, None) or 1
    kv_heads = getattr(cfg, patcher.num_kv_heads_attr, None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    element = next(find_pretrained(model).parameters()).element_size()
    volume = comm_bytes(strategy, x.shape[0], row.padded_len, heads, kv_heads, head_dim, cp, u, element) \
        if cp > 1 else 0.0
    reason = "balance='row'" if balance == "row" else why_row_layout(patcher) or (
        "no packed documents (position_ids resets without an attention_mask)" if sb.doc_ids is None else "")
    used = row if reason else step_layout(sb, masks)
    if not reason and not used.balanced:
        reason = "the row layout is as balanced"
    width = ulysses_width(strategy, cp, u)
    return {**_counts(used, work, volume, width), "reason": reason, "row": _counts(row, work, volume, width)}


def step_imbalance(model) -> float | None:
    """max / mean over the CP group's ranks of the attention work of the model's last forward, under the layout that
    forward ran (balanced or row): the count hfcp.balance_report reports as "imbalance" for that batch. Counted
    locally from the step's layout (every rank holds the whole batch, so each counts every rank's work alike, no
    collective), O(rows x tokens) per mask and at most once per step: the balance planner's count is reused.

    Args:
        model: a transformers model, patched by hfcp.patch or not (PEFT / DDP-wrapped or not).
    Returns:
        The ratio (1.0: even), or None where there is nothing to report: an unpatched model, cp_size 1, no forward
        yet, a decode step, a model without attention layers, or masks with the bidirectional blocks of a
        vision-language model (not counted).
    """
    state = cp_state(model)
    if state is None or state.mesh.cp_size == 1 or not state.modules:
        return None
    sb = state.step
    if sb is None or sb.blocks is not None or state.fwd.decoding:
        return None
    work = step_work(sb, layer_masks(state.modules, state.patcher.causal))
    width = ulysses_width(state.strategy, state.mesh.cp_size, getattr(state.attention_group, "ulysses_size", None))
    return imbalance(rank_work(sb.layout, work, width))
