"""Masks built for a patched model by code outside its forward.

Inside a patched forward transformers' mask builders see hfcp's 4D step token and return it unchanged, so
hfcp's mask builder (key "hfcp") runs only when code outside the patched model builds a mask for it: a
vision-language model building the mask of its language model (PaliGemma's prefix-LM block, Gemma 3's dict of
full and sliding masks with bidirectional image blocks), or a user calling `create_causal_mask` themselves.
The builder returns an `OuterMask` that records the mask's form instead of a tensor; the patched model's hook
accepts the forms hfcp reproduces from global indices (causal or sliding-window causal, with key padding, each
optionally OR-ed with transformers' bidirectional blocks, `block_sequence_ids`) and refuses every other one with
the reason, before any collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import masking_utils as mu


@dataclass(frozen=True, eq=False)
class OuterMask:
    """What hfcp's mask builder returns for a mask built outside the patched forward.

    form: "causal", "sliding" (sliding-window causal) or "bidirectional", each with key padding only; None for a
        mask hfcp does not reproduce (`why` says what it holds).
    padding: (B, L) bool key padding (True: attend), or None when every key is valid.
    window: the window of a "sliding" mask (a key attends when q - k < window).
    blocks: (B, L) long block ids of a causal or sliding mask OR-ed with transformers' blockwise overlay: a query
        also sees every key of its own block (id >= 0; -1: no block); else None.
    """

    form: str | None
    padding: torch.Tensor | None
    why: str = ""
    window: int | None = None
    blocks: torch.Tensor | None = None
    blocks_windowed: bool = True  # the window limits a block's keys too (else a block is seen whole)


def _closure_parts(fn) -> tuple:
    """The mask functions an and_masks / or_masks combination was built from, or ()."""
    for cell in getattr(fn, "__closure__", None) or ():
        if isinstance(cell.cell_contents, tuple):
            return cell.cell_contents
    return ()


def _is(fn, qualname: str) -> bool:
    return getattr(fn, "__qualname__", "") == qualname


def _cell(fn, name: str):
    code = getattr(fn, "__code__", None)
    cells = dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}
    return cells[name].cell_contents if name in cells else None


def _window_of(fn) -> int | None:
    """The window of transformers' sliding_window_overlay(window), or None for any other function."""
    window = _cell(fn, "sliding_window") if _is(fn, "sliding_window_overlay.<locals>.inner_mask") else None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def _plain_causal(fn) -> tuple[bool, int | None]:
    """(True, None) for the causal mask function, (True, window) for it and_masks-ed with a sliding-window overlay
    (either order), else (False, None)."""
    if fn is mu.causal_mask_function:
        return True, None
    parts = _closure_parts(fn) if _is(fn, "and_masks.<locals>.and_mask") else ()
    if len(parts) == 2:
        for base, overlay in (parts, parts[::-1]):
            window = _window_of(overlay)
            if base is mu.causal_mask_function and window is not None:
                return True, window
    return False, None


def _with_blocks(fn) -> tuple[bool, int | None, torch.Tensor | None]:
    """(True, window, ids) for or_masks(a plain causal mask, blockwise_overlay(ids)), else (False, None, None)."""
    parts = _closure_parts(fn) if _is(fn, "or_masks.<locals>.or_mask") else ()
    if len(parts) == 2 and _is(parts[1], "blockwise_overlay.<locals>.inner_mask"):
        ok, window = _plain_causal(parts[0])
        ids = _cell(parts[1], "block_sequence_ids")
        if ok and isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
            return True, window, ids
    return False, None, None


def _parse_causal(fn) -> tuple[int | None, torch.Tensor | None, bool] | None:
    """(window, block ids, whether the window also limits a block's keys) of the causal mask functions hfcp
    reproduces, None for any other:
      causal [AND window]                       -> (window, None, True)
      (causal [AND window]) OR block            -> (window, ids, False): a block is seen whole (PaliGemma 2's sliding)
      (causal OR block) AND window              -> (window, ids, True): Gemma 3's sliding layers
    """
    ok, window = _plain_causal(fn)
    if ok:
        return window, None, True
    ok, window, ids = _with_blocks(fn)
    if ok:
        return window, ids, window is None
    parts = _closure_parts(fn) if _is(fn, "and_masks.<locals>.and_mask") else ()
    if len(parts) == 2:
        for base, overlay in (parts, parts[::-1]):
            ok, inner, ids = _with_blocks(base)
            window = _window_of(overlay)
            if ok and inner is None and window is not None:
                return window, ids, True
    return None


def hfcp_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
              mask_function=mu.causal_mask_function, attention_mask=None, allow_is_causal_skip=True,
              allow_is_bidirectional_skip=False, **kwargs) -> OuterMask:
    """Mask builder for key "hfcp" (transformers' mask-interface signature): the form of the requested mask."""
    padding = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    if attention_mask is not None and padding is None:
        return OuterMask(None, None, f"a prepared attention mask of type {type(attention_mask).__name__}")
    if padding is not None:
        padding = padding.to(torch.bool)
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int) or q_offset or kv_offset \
            or q_length != kv_length:
        return OuterMask(None, padding, "a mask over cached keys (q_offset / kv_offset / kv_length differ)")
    parsed = _parse_causal(mask_function)
    if parsed is not None and (allow_is_causal_skip or parsed[1] is not None):  # (a plain causal mask without the
        window, blocks, windowed = parsed  # skip flag is one transformers made for a compileable cache: refused)
        return OuterMask("causal" if window is None else "sliding", padding, window=window, blocks=blocks,
                         blocks_windowed=windowed)
    if mask_function is mu.bidirectional_mask_function and allow_is_bidirectional_skip:
        return OuterMask("bidirectional", padding)
    return OuterMask(None, padding, "a mask with overlays (bidirectional image or prefix blocks such as "
                                    "token_type_ids make, packed documents, or a custom or_/and_mask_function)")


_REFUSAL = ("hfcp builds attention masks from global token indices and reproduces causal and sliding-window masks "
            "with key padding and bidirectional blocks (block_sequence_ids) only; {what} cannot be split exactly "
            "over the ranks, so it is refused. {todo}")
_TODO_OUTER = ("A vision-language model building its language model's mask is not supported by patching the language "
               "model alone (see hfcp's docs: reference/support-matrix.md)")


def resolve_attention_mask(kw: dict) -> dict | None:
    """Replace kw["attention_mask"] by the (B, L) key padding it stands for, or None, and return the forms of the
    masks built outside the patched forward ({layer type: OuterMask}, key None for a single mask; None when there
    is none), which every attention call applies (`layer_mask`).

    Raises ValueError for a mask hfcp cannot reproduce exactly (a 4D tensor, a BlockMask, an overlay, a dict whose
    entries pad differently), the same on every rank of a CP group given the same call: decided by the call, so
    run before any collective.
    """
    mask = kw.get("attention_mask")
    if mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return None
    if isinstance(mask, dict):  # per layer type (Gemma 3, PaliGemma 2): one key padding for all of them
        paddings = [_padding_of(v, f"attention_mask[{k!r}]") for k, v in mask.items()]
        first = paddings[0] if paddings else None
        if any(not _same_padding(p, first) for p in paddings[1:]):
            raise ValueError(_REFUSAL.format(what="a dict of masks whose key padding differs between entries",
                                             todo=_TODO_OUTER))
        kw["attention_mask"] = first
        forms = {k: v for k, v in mask.items() if isinstance(v, OuterMask)}
        if forms and len(forms) != len(mask):
            raise ValueError(_REFUSAL.format(what="a dict mixing masks built by transformers with other ones",
                                             todo=_TODO_OUTER))
        blocks = [f.blocks for f in forms.values() if f.blocks is not None]
        if any(b.shape != blocks[0].shape or not torch.equal(b, blocks[0]) for b in blocks[1:]):
            raise ValueError(_REFUSAL.format(what="a dict of masks whose bidirectional blocks (block_sequence_ids) "
                                                  "differ between entries", todo=_TODO_OUTER))
        return forms or None
    kw["attention_mask"] = _padding_of(mask, "attention_mask")
    return {None: mask} if isinstance(mask, OuterMask) else None


def step_blocks(forms: dict | None, batch: int, length: int, padded_len: int) -> torch.Tensor | None:
    """(B, padded_len) long block ids of the step's outer masks (the same in every entry, resolve_attention_mask
    checked), padding positions -1; None when no mask has blocks. Raises ValueError when they do not match the
    batch."""
    blocks = next((f.blocks for f in (forms or {}).values() if f.blocks is not None), None)
    if blocks is None:
        return None
    if blocks.shape[-1] != length or blocks.shape[0] not in (1, batch):
        raise ValueError(f"the bidirectional blocks of the mask built outside the patched model (block_sequence_ids) "
                         f"have shape {tuple(blocks.shape)} for a batch of {batch} x {length} tokens")
    blocks = blocks.long().expand(batch, -1)
    return torch.nn.functional.pad(blocks, (0, padded_len - length), value=-1)


def layer_mask(module, forms: dict | None, causal: bool, window, chunk: int | None = None):
    """(causal, window, blocks) hfcp applies for this attention layer: its own arguments (is_causal, sliding_window;
    blocks None), or, when an outer model built its mask, that mask's form, which is what transformers applies
    (sdpa and eager take the mask alone: PaliGemma's Gemma is built with use_bidirectional_attention, yet runs its
    causal prefix-LM mask). blocks: how the step's bidirectional blocks join the mask (MaskSpec.blocks): "windowed"
    (the window limits a block's keys too), "whole" (a block is seen whole) or None.

    Raises ValueError where the layer's own sliding window or attention chunk disagrees with the outer mask (other
    attention implementations apply the layer's arguments), or where hfcp cannot tell which mask of a dict applies.
    """
    if not forms:
        return causal, window, None
    name = type(module).__name__
    if chunk is not None:  # hfcp applies the layer's chunks from the config; no outer form carries them
        raise ValueError(f"{name} attends in chunks of {chunk} (chunked attention) but got a mask built outside the "
                         f"patched model, which transformers would apply alone; {_TODO_OUTER}")
    if None in forms:
        outer, key = forms[None], None
    else:
        types, idx = getattr(getattr(module, "config", None), "layer_types", None), getattr(module, "layer_idx", None)
        key = (types[idx] if isinstance(idx, int) and isinstance(types, (list, tuple)) and 0 <= idx < len(types)
               else None)
        outer = forms.get(key)
        if outer is None:
            raise ValueError(f"{name} (layer_idx={idx!r}) got a dict of masks {sorted(map(str, forms))} and hfcp "
                             f"cannot tell which one applies to it (config.layer_types[{idx!r}] = {key!r}); "
                             f"{_TODO_OUTER}")
    want = outer.window if outer.form == "sliding" else None
    if (int(window) if window else None) != want:
        shown = "causal" if want is None else f"sliding-window causal (window {want})"
        raise ValueError(f"the mask built outside the patched model for {name}{'' if key is None else f' ({key})'} is "
                         f"{shown}, but the layer itself has sliding_window={window!r}; attention implementations "
                         f"disagree on which applies, so this is refused. {_TODO_OUTER}")
    blocks = None if outer.blocks is None else "windowed" if outer.blocks_windowed or want is None else "whole"
    return True, want, blocks


def _padding_of(mask, name: str):
    if mask is None:
        return None
    if isinstance(mask, OuterMask):
        if mask.form in ("causal", "sliding"):
            return mask.padding
        what = f"{name}, {mask.why}," if mask.form is None else f"{name}, a {mask.form} mask for a causal model,"
        raise ValueError(_REFUSAL.format(what=what, todo=_TODO_OUTER))
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.to(torch.bool)
    shown = f"of shape {tuple(mask.shape)}" if isinstance(getattr(mask, "shape", None), torch.Size) else \
        f"of type {type(mask).__name__}"
    raise ValueError(_REFUSAL.format(what=f"{name} {shown}", todo="Pass a 2D (batch, seq) padding mask, "
                                                                  "and position_ids resets for packed documents"))


def _same_padding(a, b) -> bool:
    """Whether two key paddings are the same (None: every key valid)."""
    if a is None or b is None:
        given = b if a is None else a
        return given is None or bool(given.all())
    return a.shape == b.shape and torch.equal(a, b)
