"""The vision-language sweep: every model_type of transformers' image-text-to-text mapping, a tiny random config
(text and vision parts shrunk, placeholder token ids inside the tiny vocabulary), patched (cp 2, ring) against the
unpatched model, loss and every gradient, with a text-only batch and with images built by hand: two 16 x 16 images
per batch (one per row, one straddling the zigzag cut), as pixel_values (images, C, H, W) or, for towers that take
patch rows and grids (Qwen-VL style), as rows with `image_grid_thw`. The image-token count is read from the model
(its image features for these pixels). Types without a record are tried with the one a generated record gives
them (language model and vision tower read from the model, patches/verified_vlm.py). Run on every rank of a
2-process pool."""
from __future__ import annotations

import copy
import sys

import torch.distributed as dist

from hfcp.testing.tiny_vlm import image_batch, text_batch, tiny_vlm
from ..compare import grad_error

# the family sweep's tolerances and helpers
from .families import GRAD_TOL, LOSS_TOL, _averaged, _grads, _grads_of_any_rank


def _compare(make, make_batch, strategy: str = "ring") -> dict:
    """{"result": exact | refused | mismatch | error | not built | reference failed, "detail"} for one batch; make():
    a fresh copy of the type's tiny model; patched over every process of the group with `strategy`."""
    import hfcp

    try:
        ref = make()
        model = copy.deepcopy(ref)  # the same weights, without building it again
        data = make_batch(ref)
    except Exception as e:  # noqa: BLE001 - the sweep reports, it does not fail
        return {"result": "not built", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
    try:
        want = ref(**data, use_cache=False).loss
        want.backward()
    except Exception as e:  # noqa: BLE001
        return {"result": "reference failed", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
    try:
        hfcp.patch(model, process_group=dist.group.WORLD, strategy=strategy)
        got = model(**data).loss
        got.backward()
    except (ValueError, RuntimeError, TypeError) as e:
        ours = isinstance(e, ValueError) or (isinstance(e, RuntimeError) and "hfcp" in str(e))
        refused = ours and not isinstance(e, hfcp.CollectiveError)
        return {"result": "refused" if refused else "error", "detail": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        hfcp.unpatch(model)
    grads = _averaged(_grads_of_any_rank(model))
    ref_grads = _grads(ref)
    loss_err = abs(got.item() - want.item()) / abs(want.item())
    grad_err = grad_error(grads, ref_grads) if grads.keys() == ref_grads.keys() else float("inf")
    exact = loss_err < LOSS_TOL and grad_err < GRAD_TOL
    return {"result": "exact" if exact else "mismatch",
            "detail": f"loss within {LOSS_TOL:.0e}, every gradient within {GRAD_TOL:.0e}" if exact
            else f"loss {loss_err:.1e}, grad {grad_err:.1e}", "errors": f"loss {loss_err:.1e}, grad {grad_err:.1e}"}


def check_multimodal(model_type: str, build, batches: dict) -> tuple[dict, object]:
    """({"type", "text_type", "result", "detail", and each batch's result by its name}, the built model or None):
    `build(model_type)` once, then _compare with each of `batches` ({name: make_batch}); a type or its text type
    without a record is tried with the one a generated record gives it (read from the model). The result is exact
    only when every batch is, refused when hfcp refused one, else the worst."""
    from hfcp.families.registry import REGISTRY, Patcher

    added = []
    if REGISTRY.get(model_type) is None:  # tried as patches/verified_vlm.py registers a type
        REGISTRY.register(Patcher(model_type=model_type, attention_classes=(), read_from_model=True,
                                  language_model="auto", vision_tower="auto"))
        added.append(model_type)
    built, failed = None, None
    try:
        built = build(model_type)  # built once: each comparison runs a copy (building is most of the sweep's time)
        text_type = built.config.get_text_config().model_type
        if REGISTRY.get(text_type) is None:  # its text model, checked at patch time like any read-from-model type
            REGISTRY.register(Patcher(model_type=text_type, attention_classes=(), read_from_model=True))
            added.append(text_type)
    except Exception as e:  # noqa: BLE001 - not built: _compare says why
        text_type, failed = None, e

    def make():
        if built is None:
            raise failed
        return copy.deepcopy(built)

    try:
        got = {name: _compare(make, make_batch) for name, make_batch in batches.items()}
    finally:
        for t in added:
            REGISTRY._patchers.pop(t)
    order = ("error", "mismatch", "refused", "reference failed", "not built", "exact")
    worst = min(got.values(), key=lambda r: order.index(r["result"]))["result"]
    detail = ("; ".join(f"{name}: {r['detail']}" for name, r in got.items()) if worst != "exact"
              else f"{' and '.join(got)}: {next(iter(got.values()))['detail']}")
    return {"type": model_type, "text_type": text_type, "result": worst, "detail": detail,
            **{name: r["result"] for name, r in got.items()}}, built


def check(model_type: str) -> dict:
    """{"type", "result", "detail", "text", "images", "tower"}: check_multimodal with a text-only batch and two
    images; the tower: split over the ranks or whole on every rank."""
    from hfcp.families.towers import splits_tower

    result, built = check_multimodal(model_type, tiny_vlm, {"text": text_batch, "images": image_batch})
    exact = result["result"] == "exact"  # (then it was built)
    tower = "split over the ranks" if exact and splits_tower(built.config.vision_config) else "whole on every rank"
    return {**result, "tower": tower if exact else ""}


def sweep(types=None, progress: bool = False) -> list[dict]:
    from transformers.models.auto import modeling_auto

    results = []
    for t in types or sorted(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if progress and dist.get_rank() == 0:
            print(f"vlm sweep: {t}", file=sys.stderr, flush=True)
        results.append(check(t))
    return results
