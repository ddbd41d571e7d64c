"""What a hook reads from the batch and gives the model: the call checked, the batch checked whole, and this rank's
slice of the per-token inputs with the step's layout (shared by the causal-LM, VLM and vision hooks)."""
from __future__ import annotations


import torch

from ..attention.outer_mask import resolve_attention_mask, step_blocks
from ..attention.step_token import step_token
from ..distributed.input_checks import check_shapes, check_token_range
from ..families.introspect import forward_parameters
from ..layout.balance import step_layout
from ..layout import Layout, build_step_batch, document_ids
from ..loss.cross_entropy import IGNORE_INDEX, shift_labels


def as_kwargs(module, args, kwargs) -> dict:
    """Positional arguments of the wrapped forward -> keyword arguments."""
    if not args:
        return dict(kwargs)
    params = [p for p in forward_parameters(module).values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name: a for p, a in zip(params, args)}
    if len(args) > len(params):
        raise TypeError(f"{type(module).__name__}.forward got {len(args)} positional arguments")
    return {**named, **kwargs}


def check_input_dims(ids: torch.Tensor | None, embeds: torch.Tensor | None) -> None:
    """Raises ValueError unless input_ids is (batch, seq) and inputs_embeds (batch, seq, hidden) (either may be None),
    with at least one row and one token."""
    if ids is not None and ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; hfcp needs (batch, seq): add a batch dimension")
    if embeds is not None and embeds.dim() != 3:
        raise ValueError(f"inputs_embeds has shape {tuple(embeds.shape)}; hfcp needs (batch, seq, hidden)")
    x = ids if ids is not None else embeds
    if x is not None and x.shape[0] == 0:
        raise ValueError(f"{'input_ids' if ids is not None else 'inputs_embeds'} has shape {tuple(x.shape)}: a batch "
                         "of no rows; skip the empty batch (or give the model at least one row)")
    if x is not None and x.shape[1] == 0:
        raise ValueError(f"{'input_ids' if ids is not None else 'inputs_embeds'} has shape {tuple(x.shape)}: no "
                         "tokens; skip the empty batch (or give the model at least one token per row)")


def check_call(kw: dict) -> dict | None:
    """Refuse call styles hfcp cannot run (decided by the call, not the data, so before any collective); a mask
    built outside the patched forward becomes the key padding it stands for, or is refused. Returns the forms of
    such masks (outer_mask.resolve_attention_mask)."""
    if kw.get("fused_lm_head"):  # TRL's fused head: its forward calls the backbone around this hook
        raise ValueError("fused_lm_head=True runs the model's backbone around hfcp (each rank would attend within its "
                         "own shard only); train with hfcp.integrations.HfcpSFTTrainer, whose loss and metrics go "
                         "through hfcp's chunked loss")
    outer_masks = resolve_attention_mask(kw)
    keep = kw.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor) or isinstance(keep, bool) or not isinstance(keep, (int, type(None))) or \
            (keep or 0) < 0:
        raise ValueError(f"logits_to_keep={keep!r} is not supported by hfcp (an int: 0 for all logits, k for the last "
                         "k positions); take other positions from hfcp.gather_sequence(out.logits, model)")
    if keep and kw.get("labels") is not None:
        raise ValueError(f"logits_to_keep={keep} with labels: the loss needs every position's logits; pass one of them")
    return outer_masks


def vocab_size(module, which: str) -> int:
    """The input or output vocabulary of a model (its embedding's rows; the full shape of a DeepSpeed ZeRO-3 weight or
    of one hfcp.pipeline freed on another stage)."""
    layer = module.get_input_embeddings() if which == "input" else module.get_output_embeddings()
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return int(module.config.get_text_config().vocab_size)
    shape = getattr(weight, "ds_shape", None) or getattr(weight, "hfcp_full_shape", weight.shape)  # (empty locally)
    return int(shape[0])


def check_lm_batch(module, kw: dict, labels_kind: str | None):
    """Validate a causal LM / base model / classifier batch (every rank holds all of it, so every rank raises alike).

    labels_kind: what the head's labels are: "shifted" (a causal LM: next-token targets), "token" (a token classifier:
    one class per token, not shifted), "sequence" (a sequence classifier: one label row per sequence, left in kw for
    the model's own loss) or None (no labels of hfcp's concern).
    Returns (x, labels, targets): x is input_ids or inputs_embeds; labels as given (None: no loss by hfcp); targets
    (B, L) the target of each token (labels shifted over the whole sequence, shift_labels, or the token classes),
    IGNORE_INDEX where none. Pops the loss keywords shift_labels and ignore_index from kw for a causal LM, labels for
    a causal LM and a token classifier.
    """
    ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
    if ids is None and embeds is None:
        raise ValueError("hfcp needs input_ids or inputs_embeds to shard the sequence")
    check_input_dims(ids, embeds)
    x = ids if ids is not None else embeds
    if ids is not None:
        check_token_range("input_ids", ids, vocab_size(module, "input"))
    check_shapes({k: v for k, v in kw.items() if k != "labels"} if labels_kind == "sequence" else kw, *x.shape[:2])
    take_packed_lengths(kw, *x.shape[:2])
    if labels_kind == "token":
        return (x, *_token_labels(module, kw))
    if labels_kind != "shifted":
        return x, None, None
    labels, shifted = kw.pop("labels", None), kw.pop("shift_labels", None)
    ignore = kw.pop("ignore_index", IGNORE_INDEX)
    if labels is None:
        return x, None, None
    if not isinstance(ignore, int) or isinstance(ignore, bool):
        raise ValueError(f"ignore_index={ignore!r} must be an int")
    vocab = vocab_size(module, "output")
    if shifted is None:  # as transformers: labels[:, 0] is never a target
        check_token_range("labels[:, 1:]", labels[:, 1:], vocab, ignore)
        shifted = shift_labels(labels, ignore)
    else:  # transformers' loss uses shift_labels as they are and ignores labels
        check_token_range("shift_labels", shifted, vocab, ignore)
    targets = shifted.masked_fill(shifted == ignore, IGNORE_INDEX) if ignore != IGNORE_INDEX else shifted
    return x, labels, targets


def _token_labels(module, kw: dict):
    """(labels, targets) of a token classifier: its (B, L) labels are each token's class (not shifted), IGNORE_INDEX
    ignored, as transformers' token-classification loss takes them; popped from kw (hfcp computes the loss)."""
    labels = kw.pop("labels", None)
    if labels is None:
        return None, None
    num_labels = int(module.config.num_labels)
    check_token_range("labels", labels, num_labels, IGNORE_INDEX)
    return labels, labels


def take_packed_lengths(kw: dict, batch: int, length: int) -> None:
    """Padding-free collators (DataCollatorWithFlattening, TRL's) pass `cu_seq_lens_q/k` and `max_length_q/k` for
    flash attention, or `seq_idx`, beside position_ids. hfcp finds documents from position_ids (as transformers' SDPA
    path does), so it checks that both describe the same documents, fills position_ids when only the lengths are given,
    and pops them (they describe the whole sequence, not a rank's shard)."""
    cu_q, cu_k = kw.pop("cu_seq_lens_q", None), kw.pop("cu_seq_lens_k", None)
    kw.pop("max_length_q", None), kw.pop("max_length_k", None)
    seq_idx = kw.pop("seq_idx", None)  # (B, L) document index of each token (TRL's padding-free collator)
    if seq_idx is not None:
        starts = torch.diff(seq_idx.cpu(), dim=-1) != 0
        pos = kw.get("position_ids")
        if pos is None or not torch.equal(starts, torch.diff(document_ids(pos.cpu().expand_as(seq_idx)), dim=-1) != 0):
            raise ValueError("seq_idx and the position_ids resets describe different documents (or position_ids are "
                             "missing); hfcp finds packed documents from position_ids")
    if cu_q is None and cu_k is None:
        return
    cu = cu_q if cu_q is not None else cu_k
    if cu_k is not None and not torch.equal(cu.cpu(), cu_k.cpu()):
        raise ValueError(f"cu_seq_lens_q {cu.tolist()} and cu_seq_lens_k {cu_k.tolist()} differ; hfcp supports "
                         "self-attention over packed documents only")
    lengths = torch.diff(cu.cpu().long())
    if batch != 1 or cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != length or bool((lengths <= 0).any()):
        raise ValueError(f"cu_seq_lens {cu.tolist()} do not describe documents packed into one row of {length} "
                         f"tokens (batch {batch})")
    if kw.get("attention_mask") is not None:
        raise ValueError("cu_seq_lens_q/k with an attention_mask: pass packed documents without a padding mask")
    from_lengths = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    pos = kw.get("position_ids")
    if pos is None:
        kw["position_ids"] = from_lengths.to(cu.device)
    elif not torch.equal(document_ids(pos.cpu()), document_ids(from_lengths)):
        raise ValueError(f"cu_seq_lens {cu.tolist()} and the position_ids resets describe different documents")


def shard_inputs(st, kw: dict, layout: Layout, outer_masks, masks=None) -> None:
    """The step's metadata from the whole batch in kw (st.step), then kw's per-token inputs replaced by this rank's
    slice: input_ids / inputs_embeds, position_ids of any leading shape ((B, L), (3, B, L) mRoPE, (4, B, L) with a
    text row) along their last dim, token_type_ids; the mask becomes the step token. masks: the model's attention
    masks ((MaskSpec, layers) pairs) to balance packed documents over (hfcp.layout.balance.step_layout), or None:
    `layout`."""
    ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
    x = ids if ids is not None else embeds
    B, L = x.shape[:2]
    mask = kw.get("attention_mask")
    pos = kw.get("position_ids")
    if pos is None:
        pos = default_positions(st.patcher, mask, B, L, x.device)
    pos = pos.expand(*pos.shape[:-2], B, L) if pos.dim() >= 2 else pos.expand(B, L)
    sb = build_step_batch(layout, st.mesh.cp_rank, B, text_positions(pos), mask, x.device)
    sb.outer_masks, sb.max_position = outer_masks, pos.amax()
    sb.blocks = step_blocks(outer_masks, B, L, layout.padded_len)
    if masks is not None:
        sb.layout = step_layout(sb, masks)
    st.step = sb
    if ids is not None:
        kw["input_ids"] = sb.local(ids)
    if embeds is not None:
        kw["inputs_embeds"] = sb.local(embeds, fill=0.0)
    kw["position_ids"] = sb.local(pos, dim=pos.dim() - 1)
    if kw.get("token_type_ids") is not None:  # per-token segment ids (BERT, GPT-2, CTRL): split like the tokens
        kw["token_type_ids"] = sb.local(kw["token_type_ids"].expand(B, -1))
    kw["attention_mask"] = step_token(sb, x.device)


def text_positions(pos: torch.Tensor) -> torch.Tensor | None:
    """(B, L) positions whose resets mark packed documents: the positions themselves, the text row of a (4, B, L)
    mRoPE tensor (Qwen-VL), or None for (3, B, L) mRoPE rows (an image's rows are not +1 steps: never read as
    document starts)."""
    if pos.dim() == 2:
        return pos
    return pos[0] if pos.dim() == 3 and pos.shape[0] == 4 else None


def default_positions(patcher, mask, batch: int, length: int, device) -> torch.Tensor:
    """(B, L) position ids of a batch given without them, over the whole sequence, as the family computes them:
    0, 1, 2, ..., or from the attention mask for a family that derives them from it (Patcher.positions_from_mask:
    OPT's cumsum(mask) * mask - 1, so left padding and mask holes shift the positions)."""
    if patcher.positions_from_mask and mask is not None:
        m = mask.to(device=device, dtype=torch.long).expand(batch, -1)
        return m.cumsum(1) * m - 1
    return torch.arange(length, device=device)[None].expand(batch, -1)


def check_length_limit(patcher, config, layout: Layout) -> None:
    """Raises ValueError when the family has a length limit (Patcher.max_seq_len) and this batch exceeds it."""
    limit = patcher.max_seq_len(config) if patcher.max_seq_len is not None else None
    if limit is not None and layout.padded_len > limit:
        raise ValueError(f"model_type={patcher.model_type!r}: {layout.seq_len} tokens ({layout.padded_len} padded for "
                         f"cp={layout.cp_size}) exceed the {limit} hfcp runs exactly for it: "
                         f"{patcher.max_seq_len_reason}")
