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
import inspect
import sys
import warnings

import torch
import torch.distributed as dist

from hfcp.verify import grad_error

L, B = 48, 2
IMAGE, VIDEO, START, BOI, EOI = 90, 91, 92, 93, 94
TOKEN_IDS = {"image_token_id": IMAGE, "image_token_index": IMAGE, "video_token_id": VIDEO,
             "video_token_index": VIDEO, "vision_start_token_id": START, "boi_token_index": BOI,
             "eoi_token_index": EOI, "boi_token_id": BOI, "eoi_token_id": EOI}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2,
              image_size=16, patch_size=4, embed_dim=32, out_hidden_size=32, projection_dim=32,
              num_position_embeddings=16, deepstack_visual_indexes=[0], fullatt_block_indexes=[0],
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_channels=3, window_size=8,
              attention_dropout=0.0, dropout=0.0, head_dim=16)
MAX_PARAMS = 4_000_000
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def tiny_vlm(model_type: str, seed: int = 0):
    """A tiny random VLM of `model_type` in train mode, weights perturbed away from their init."""
    import transformers
    from transformers.models.auto import modeling_auto

    from hfcp.tiny import tiny_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type)
        vision = getattr(cfg, "vision_config", None)
        if vision is None:
            raise ValueError("no vision_config")
        for k, v in VISION.items():
            if hasattr(vision, k):
                old = getattr(vision, k)
                setattr(vision, k, [v, v] if isinstance(old, (list, tuple)) and isinstance(v, int) else copy.copy(v))
        for k, v in TOKEN_IDS.items():
            if hasattr(cfg, k):
                setattr(cfg, k, v)
        for k, v in (("projector_hidden_size", 32), ("mm_hidden_size", 32), ("mm_tokens_per_image", 4),
                     ("image_grid_pinpoints", [[16, 16]])):
            if hasattr(cfg, k):
                setattr(cfg, k, v)
        text = cfg.get_text_config()
        rope = getattr(text, "rope_parameters", None)
        if isinstance(rope, dict) and ("mrope_section" in rope or "_vl" in text.model_type):  # 3-D rope sections
            # over the tiny head dim (8); a Qwen-VL text config without them takes its full-size default
            text.rope_parameters = {**rope, "mrope_section": [1, 1, 2]}
        cls = getattr(transformers, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(copy.deepcopy(cfg)).parameters())
        if size > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {size / 1e6:.1f}M parameters")
        torch.manual_seed(seed)
        model = cls(copy.deepcopy(cfg)).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def text_batch(model) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 88, (B, L), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    out = {"input_ids": ids, "labels": labels}
    if _accepts(model, "mm_token_type_ids"):
        out["mm_token_type_ids"] = torch.zeros_like(ids, dtype=torch.int)
    if _accepts(model, "token_type_ids"):
        out["token_type_ids"] = torch.zeros_like(ids)
    return out


def _pixel_variants(model) -> list[dict]:
    """Two images as towers take them: (2, C, H, W), with image_sizes, as tiles per image (LLaVA-NeXT's anyres:
    the base image and one tile), or patch rows with image_grid_thw (Qwen-VL style)."""
    g = torch.Generator().manual_seed(4)
    v = model.config.vision_config
    if _accepts(model, "image_grid_thw"):
        rows = getattr(v, "in_channels", 3) * getattr(v, "temporal_patch_size", 1) * getattr(v, "patch_size", 4) ** 2
        return [{"pixel_values": torch.randn(2 * 16, rows, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]] * 2)}]
    size = v.image_size if isinstance(v.image_size, int) else v.image_size[0]
    images = torch.randn(2, getattr(v, "num_channels", 3), size, size, generator=g)
    sizes = torch.tensor([[size, size]] * 2)
    out = [{"pixel_values": images}, {"pixel_values": images[:, None]}]  # (images, ...) or (rows, images per row, ...)
    if _accepts(model, "image_sizes"):
        out += [{"pixel_values": images, "image_sizes": sizes},
                {"pixel_values": torch.stack([images, images.flip(-1)], 1), "image_sizes": sizes}]
    return out


def _feature_rows(model, pixels: dict) -> list[int]:
    """How many placeholder tokens each image's features fill, read from the model."""
    with torch.no_grad():
        feats = model.model.get_image_features(**pixels, return_dict=True)
    feats = getattr(feats, "pooler_output", feats)
    if isinstance(feats, torch.Tensor):
        feats = list(feats) if feats.dim() == 3 else [feats]
    rows = [f.reshape(-1, f.shape[-1]).shape[0] for f in feats]
    if len(rows) != 2:
        raise ValueError(f"image features of {len(rows)} parts for 2 images")
    return rows


def _pixels(model) -> tuple[dict, list[int]]:
    """The first way of giving two images that the model's image features accept, and their token counts."""
    errors = []
    for pixels in _pixel_variants(model):
        try:
            return pixels, _feature_rows(model, pixels)
        except Exception as e:  # noqa: BLE001 - try the next form
            errors.append(f"{type(e).__name__}: {str(e)[:80]}")
    raise ValueError(f"no image input built ({'; '.join(errors)})")


def image_batch(model) -> dict:
    """Text with one image per row: row 0 early, row 1 across the middle (where the zigzag layout cuts)."""
    out = text_batch(model)
    pixels, rows = _pixels(model)
    ids = out["input_ids"]
    for row, (at, n) in enumerate(zip((4, L // 2 - rows[1] // 2), rows)):
        if at + n + 1 >= L:
            raise ValueError(f"{n} tokens per image do not fit {L}")
        ids[row, at:at + n] = IMAGE
        ids[row, at - 1] = START if _accepts(model, "image_grid_thw") else ids[row, at - 1]
    out["labels"] = ids.masked_fill(ids == IMAGE, -100)
    out["labels"][:, :3] = -100
    image = ids == IMAGE
    if "mm_token_type_ids" in out:
        out["mm_token_type_ids"] = image.int()
    if "token_type_ids" in out:
        out["token_type_ids"] = image.long()
    return {**out, **pixels}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model_type: str, make_batch) -> dict:
    """{"result": exact | refused | mismatch | error | not built | reference failed, "detail"} for one batch."""
    import hfcp

    try:
        ref, model = tiny_vlm(model_type), tiny_vlm(model_type)
        data = make_batch(ref)
    except Exception as e:  # noqa: BLE001 - the sweep reports, it does not fail
        return {"result": "not built", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
    try:
        want = ref(**data, use_cache=False).loss
        want.backward()
    except Exception as e:  # noqa: BLE001
        return {"result": "reference failed", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
    try:
        hfcp.patch(model, process_group=dist.group.WORLD)
        got = model(**data).loss
        got.backward()
    except (ValueError, RuntimeError, TypeError) as e:
        ours = isinstance(e, ValueError) or (isinstance(e, RuntimeError) and "hfcp" in str(e))
        refused = ours and not isinstance(e, hfcp.CollectiveError)
        return {"result": "refused" if refused else "error", "detail": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        hfcp.unpatch(model)
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    ref_grads = _grads(ref)
    loss_err = abs(got.item() - want.item()) / abs(want.item())
    grad_err = grad_error(grads, ref_grads) if grads.keys() == ref_grads.keys() else float("inf")
    exact = loss_err < LOSS_TOL and grad_err < GRAD_TOL
    return {"result": "exact" if exact else "mismatch",
            "detail": f"loss within {LOSS_TOL:.0e}, every gradient within {GRAD_TOL:.0e}" if exact
            else f"loss {loss_err:.1e}, grad {grad_err:.1e}", "errors": f"loss {loss_err:.1e}, grad {grad_err:.1e}"}


def check(model_type: str) -> dict:
    """{"type", "result", "detail", "text", "images"}: result is exact only when both batches are, refused when
    hfcp refused either, else the worst of the two."""
    from hfcp.registry import REGISTRY, Patcher
    from hfcp.vision_split import splits_tower

    added = []
    if REGISTRY.get(model_type) is None:  # tried as patches/verified_vlm.py registers a type
        REGISTRY.register(Patcher(model_type=model_type, attention_classes=(), read_from_model=True,
                                  language_model="auto", vision_tower="auto"))
        added.append(model_type)
    tower = ""
    try:
        built = tiny_vlm(model_type)
        text_type = built.config.get_text_config().model_type
        tower = "split over the ranks" if splits_tower(built.config.vision_config) else "whole on every rank"
        if REGISTRY.get(text_type) is None:  # its text model, checked at patch time like any read-from-model type
            REGISTRY.register(Patcher(model_type=text_type, attention_classes=(), read_from_model=True))
            added.append(text_type)
    except Exception:  # noqa: BLE001 - not built: _compare says why
        text_type = None
    try:
        text, images = _compare(model_type, text_batch), _compare(model_type, image_batch)
    finally:
        for t in added:
            REGISTRY._patchers.pop(t)
    order = ("error", "mismatch", "refused", "reference failed", "not built", "exact")
    worst = min((text, images), key=lambda r: order.index(r["result"]))
    return {"type": model_type, "text_type": text_type, "result": worst["result"],
            "detail": f"text: {text['detail']}; images: {images['detail']}" if worst["result"] != "exact"
            else f"text and images: {text['detail']}", "text": text["result"], "images": images["result"],
            "tower": tower if worst["result"] == "exact" else ""}


def sweep(types=None, progress: bool = False) -> list[dict]:
    from transformers.models.auto import modeling_auto

    results = []
    for t in types or sorted(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if progress and dist.get_rank() == 0:
            print(f"vlm sweep: {t}", file=sys.stderr, flush=True)
        results.append(check(t))
    return results
