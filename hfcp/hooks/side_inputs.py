"""Per-token side inputs of a language model, split with its tokens; whole-sequence inputs hfcp cannot split, refused.

A language model may get, beside its sequence, inputs that hold something per token: Qwen3-VL's deepstack passes
`visual_pos_masks` (B, L) and `deepstack_visual_embeds`, one row per True entry of the mask (Patcher.
token_side_inputs names such (mask, rows) pairs). Both shard hooks use these functions: the VLM's language model
hook (hfcp.patch(model) on the outer model, hfcp/hooks/vlm.py) and the causal-LM / base-model hook when the language
model was patched alone and its outer model calls it (hfcp/hooks/causal_lm.py). Any other (batch, seq, ...) tensor that
reaches a patched model is refused by name: each rank's layers would read the whole sequence's values against their
shard of the tokens.
"""
from __future__ import annotations

import sys

import torch


# arguments of the whole sequence that the shard hooks split (or pop) themselves
SPLIT_BY_HFCP = frozenset({"input_ids", "inputs_embeds", "position_ids", "attention_mask", "token_type_ids", "labels",
                           "shift_labels", "seq_idx"})


def side_input_names(pairs) -> frozenset:
    """Every argument name of the (mask, rows) pairs."""
    return frozenset(name for pair in pairs for name in pair)


def check_side_inputs(module, kw: dict, pairs, batch_len) -> None:
    """Raises ValueError for a token side input that does not match the (B, L) sequence (decided by the call, so on
    every rank alike)."""
    for mask_name, rows_name in pairs:
        mask, rows = kw.get(mask_name), kw.get(rows_name)
        if mask is None:
            if rows is not None:
                raise ValueError(f"{type(module).__name__} got {rows_name} without {mask_name}, which says whose rows "
                                 "they are: hfcp cannot split them")
            continue
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(batch_len):
            raise ValueError(f"{type(module).__name__}: {mask_name} must be a bool tensor of the merged sequence's "
                             f"shape {tuple(batch_len)}, got {getattr(mask, 'dtype', type(mask).__name__)} "
                             f"{tuple(getattr(mask, 'shape', ()))}")
        n = int(mask.sum())
        for t in (rows if isinstance(rows, (list, tuple)) else [rows] if rows is not None else []):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
                raise ValueError(f"{type(module).__name__}: {rows_name} holds rows of shape "
                                 f"{tuple(getattr(t, 'shape', ()))} for the {n} positions of {mask_name}; they must "
                                 "match one to one")


def shard_side_inputs(kw: dict, pairs, sb) -> None:
    """Each (mask, rows) side input -> this rank's part: the mask's local columns (layout order), and the rows of
    the mask's True entries among them, in the row-major order the local mask enumerates them."""
    for mask_name, rows_name in pairs:
        mask = kw.get(mask_name)
        if mask is None:
            continue
        B, L = mask.shape
        order = (mask.reshape(-1).long().cumsum(0) - 1).view(B, L)  # (B, L) row number of each True entry
        local = sb.local(mask, fill=False)  # (B, L/cp)
        take = sb.local(order)[local]  # (n_local,)
        kw[mask_name] = local
        rows = kw.get(rows_name)
        if rows is not None:
            one = lambda t: t.index_select(0, take.to(t.device))  # noqa: E731
            kw[rows_name] = type(rows)(one(t) for t in rows) if isinstance(rows, (list, tuple)) else one(rows)


def _is_sequence_tensor(value, batch: int, length: int) -> bool:
    """A (batch, length, ...) tensor, or a list / tuple holding one (per-layer inputs)."""
    if isinstance(value, (list, tuple)):
        return any(_is_sequence_tensor(v, batch, length) for v in value)
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, length)


def refuse_unsplit_sequence_inputs(module, kw: dict, known, batch: int, length: int) -> None:
    """Raises ValueError naming every argument of kw, other than `known` ones, that holds a tensor of the whole
    (batch, length) sequence: hfcp does not know how to split it, and the layers that read it would pair each rank's
    tokens with the whole sequence's values (a raw shape error at best)."""
    names = sorted(k for k, v in kw.items() if k not in known and _is_sequence_tensor(v, batch, length))
    if names:
        raise ValueError(f"{type(module).__name__} got {names}, tensors of the whole sequence ({batch}, {length}) "
                         "beside its input: hfcp splits only the inputs it knows over the ranks (input_ids / "
                         "inputs_embeds, position_ids, attention_mask, token_type_ids, labels and the per-token side "
                         "inputs its record names, Patcher.token_side_inputs), so it refuses these. If an outer "
                         "model passes them to this patched language model, patch the outer model instead "
                         "(hfcp.patch(model)) where its type is supported; else leave them out")


def outer_model_call(module, depth: int = 64) -> dict:
    """What the outer model's forward was called with when `module`, a patched model whose head computes no loss (a
    language model patched alone), runs inside the forward of a transformers model that contains it: {"owner": that
    model, "labels": its labels tensor, "router_logits": whether it outputs router logits, "pools": whether it is a
    sequence classifier (it picks one token's score by an index computed from the whole input_ids)}, or {} when no such
    model called it. Read from the call stack: the outer model is not patched, so no hook of hfcp's sees its
    arguments. Its labels would be compared with this rank's shard of the logits, and its router aux loss taken over
    this rank's router logits only."""
    from transformers import PreTrainedModel

    found = {}
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_code.co_name == "forward":
            local = frame.f_locals
            owner = local.get("self")
            labels, router = local.get("labels"), local.get("output_router_logits")
            pools = type(owner).__name__.endswith("ForSequenceClassification")
            if (isinstance(owner, PreTrainedModel) and owner is not module
                    and (isinstance(labels, torch.Tensor) or router is True or pools)
                    and any(m is module for m in owner.modules())):
                found.setdefault("owner", owner)
                if isinstance(labels, torch.Tensor):
                    found.setdefault("labels", labels)
                found["router_logits"] = found.get("router_logits", False) or router is True
                found["pools"] = found.get("pools", False) or pools
        frame = frame.f_back
    return found


def refuse_outer_call(module, outer: dict) -> None:
    """Raises ValueError when the outer model (outer_model_call) of the patched language model `module` computes
    something from the whole sequence that this rank holds a shard of: a token's score, a loss from labels, a router
    aux loss."""
    owner = type(outer["owner"]).__name__
    if outer.get("pools"):
        raise ValueError(f"{owner} picks each row's score at its last non-pad token, but only its "
                         f"{type(module).__name__} is hfcp-patched: it would pick it from this rank's shard of the "
                         "sequence by an index into the whole one. Patch the whole model, hfcp.patch(model)")
    if outer.get("labels") is not None:
        raise ValueError(f"{owner} was called with labels, but only its {type(module).__name__} is hfcp-patched: it "
                         "would compute the loss from this rank's shard of the logits against the whole labels. Call "
                         "it with labels=None and compute the loss from the whole logits, "
                         "hfcp.gather_sequence(out.logits, language_model), shifting the labels over the whole "
                         "sequence; or patch the whole model, hfcp.patch(model), where its type is supported: hfcp "
                         "then computes the loss from the labels itself (chunked, no whole logits)")
    if outer.get("router_logits"):
        raise ValueError(f"{owner} outputs router logits (output_router_logits=True, argument or config), but only "
                         f"its {type(module).__name__} is hfcp-patched: it would compute the MoE router aux loss "
                         "from this rank's tokens only. Pass output_router_logits=False")
