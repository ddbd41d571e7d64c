"""Masks built for a patched model by code outside its forward.

Inside a patched forward transformers' mask builders see hfcp's 4D step token and return it unchanged, so
hfcp's mask builder (key "hfcp") runs only when code outside the patched model builds a mask for it: a
vision-language model building the mask of its language model (PaliGemma's prefix-LM block, Gemma 3's dict of
full and sliding masks with bidirectional image blocks), or a user calling `create_causal_mask` themselves.
The builder returns an `OuterMask` that records the mask's form instead of a tensor; the patched model's hook
accepts the forms hfcp reproduces from global indices (causal or sliding-window causal, with key padding) and
refuses every other one with the reason, before any collective.
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
    """

    form: str | None
    padding: torch.Tensor | None
    why: str = ""
    window: int | None = None


def _closure_parts(fn) -> tuple:
    """The mask functions an and_masks / or_masks combination was built from, or ()."""
    for cell in getattr(fn, "__closure__", None) or ():
        if isinstance(cell.cell_contents, tuple):
            return cell.cell_contents
    return ()


def _sliding_causal_window(fn) -> int | None:
    """The window of transformers' sliding_window_causal_mask_function(window), or None for any other function."""
    parts = _closure_parts(fn)
    if not (getattr(fn, "__qualname__", "") == "and_masks.<locals>.and_mask" and len(parts) == 2
            and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"
            and parts[1] is mu.causal_mask_function):
        return None
    cells = dict(zip(parts[0].__code__.co_freevars, parts[0].__closure__ or ()))
    window = cells["sliding_window"].cell_contents if "sliding_window" in cells else None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


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
    if mask_function is mu.causal_mask_function and allow_is_causal_skip:
        return OuterMask("causal", padding)
    window = _sliding_causal_window(mask_function)
    if window is not None and allow_is_causal_skip:
        return OuterMask("sliding", padding, window=window)
    if mask_function is mu.bidirectional_mask_function and allow_is_bidirectional_skip:
        return OuterMask("bidirectional", padding)
    return OuterMask(None, padding, "a mask with overlays (bidirectional image or prefix blocks such as "
                                    "token_type_ids make, packed documents, or a custom or_/and_mask_function)")


_REFUSAL = ("hfcp builds attention masks from global token indices and reproduces causal and sliding-window masks "
            "with key padding only; {what} cannot be split exactly over the ranks, so it is refused. {todo}")
_TODO_OUTER = ("A vision-language model building its language model's mask is not supported by patching the language "
               "model alone (see README, Support matrix)")


def resolve_attention_mask(kw: dict) -> dict | None:
    """Replace kw["attention_mask"] by the (B, L) key padding it stands for, or None, and return the forms of the
    masks built outside the patched forward ({layer type: OuterMask}, key None for a single mask; None when there
    is none), which every attention call checks against what it computes (`check_layer_form`).

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
        return forms or None
    kw["attention_mask"] = _padding_of(mask, "attention_mask")
    return {None: mask} if isinstance(mask, OuterMask) else None


def check_layer_form(module, forms: dict | None, causal: bool, window, chunk: int | None = None) -> None:
    """Raises ValueError when the mask an outer model built for this attention layer is not the one hfcp computes
    for it (causality, window and attention chunk from the module and its config): transformers would apply the
    mask alone."""
    if not forms:
        return
    name = type(module).__name__
    if chunk is not None:  # hfcp applies the layer's chunks from the config; no outer form carries them
        raise ValueError(f"{name} attends in chunks of {chunk} (chunked attention) but got a mask built outside the "
                         f"patched model, which transformers would apply alone; {_TODO_OUTER}")
    if None in forms:
        outer, key = forms[None], None
    else:
        types, idx = getattr(getattr(module, "config", None), "layer_types", None), getattr(module, "layer_idx", None)
        key = types[idx] if isinstance(idx, int) and isinstance(types, (list, tuple)) and 0 <= idx < len(types) else None
        outer = forms.get(key)
        if outer is None:
            raise ValueError(f"{name} (layer_idx={idx!r}) got a dict of masks {sorted(map(str, forms))} and hfcp cannot "
                             f"tell which one applies to it (config.layer_types[{idx!r}] = {key!r}); {_TODO_OUTER}")
    want = (True, outer.window if outer.form == "sliding" else None)
    got = (bool(causal), int(window) if window else None)
    if got != want:
        shown = "causal" if outer.form == "causal" else f"sliding-window causal (window {outer.window})"
        mine = ("causal" if got[0] else "bidirectional") + (f" with window {got[1]}" if got[1] else "")
        raise ValueError(f"the mask built outside the patched model for {name}{'' if key is None else f' ({key})'} is "
                         f"{shown}, but the layer itself attends {mine} (its is_causal / sliding_window arguments); "
                         f"transformers would apply the mask, hfcp the layer's arguments, so this is refused. "
                         f"{_TODO_OUTER}")


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
