"""Tiny random vision-language models of any transformers image-text-to-text type, and batches for them built by
hand: what the VLM sweep (hfcp/testing/sweeps/vlms.py) and `hfcp verify --model MODEL_TYPE` run. Text and vision configs
are shrunk, placeholder token ids put inside the tiny vocabulary, and the number of placeholder tokens of an image
is read from the features the model returns for it."""
from __future__ import annotations

import copy
import inspect
import warnings

import torch

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


def tiny_vlm(model_type: str, seed: int = 0):
    """A tiny random VLM of `model_type` in train mode, weights perturbed away from their init."""
    import transformers
    from transformers.models.auto import modeling_auto

    from .tiny import tiny_config

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
        fit_text_config(cfg.get_text_config())
        cls = getattr(transformers, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
        return build_perturbed(cls, cfg, seed)


def build_perturbed(cls, cfg, seed: int):
    """cls(cfg) in fp32 and train mode, refused above MAX_PARAMS (counted on the meta device), its weights from
    `seed` and perturbed away from their init (so that no gradient is zero by construction)."""
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


def fit_text_config(text) -> None:
    """What the shrunk text config of a multimodal model must agree with: its layer types cut to its layers (what
    the layers read anyway; a saved config must agree to load again) and 3-D rope sections over the tiny head dim
    (8; a Qwen-VL text config without them takes its full-size default)."""
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and len(types) > text.num_hidden_layers:
        text.layer_types = types[:text.num_hidden_layers]
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and ("mrope_section" in rope or any(k in text.model_type for k in ("_vl", "_omni"))):
        text.rope_parameters = {**rope, "mrope_section": [1, 1, 2]}


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def text_batch(model, length: int = 48, rows: int = 2) -> dict:
    """Random text ids (below the placeholder ids) and labels, with the token-type inputs the model takes, zero."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 88, (rows, length), generator=g)
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
        return [{"pixel_values": torch.randn(2 * 16, rows, generator=g),
                 "image_grid_thw": torch.tensor([[1, 4, 4]] * 2)}]
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


def image_batch(model, length: int = 48) -> dict:
    """Two rows of text with one image each: row 0 early, row 1 across the middle (where the zigzag layout cuts).

    Raises:
        ValueError: no form of two images that the model's get_image_features accepts, or they do not fit.
    """
    L, cfg = length, model.config
    image_id = next((v for k in ("image_token_id", "image_token_index") if isinstance(v := getattr(cfg, k, None), int)),
                    IMAGE)  # the model's placeholder (IMAGE in the tiny models)
    start = getattr(cfg, "vision_start_token_id", START)
    out = text_batch(model, length)
    pixels, rows = _pixels(model)
    ids = out["input_ids"]
    for row, (at, n) in enumerate(zip((4, L // 2 - rows[1] // 2), rows)):
        if at + n + 1 >= L or at < 4:
            raise ValueError(f"{n} tokens per image do not fit {L}")
        ids[row, at:at + n] = image_id
        ids[row, at - 1] = start if _accepts(model, "image_grid_thw") else ids[row, at - 1]
    out["labels"] = ids.masked_fill(ids == image_id, -100)
    out["labels"][:, :3] = -100
    image = ids == image_id
    if "mm_token_type_ids" in out:
        out["mm_token_type_ids"] = image.int()
    if "token_type_ids" in out:
        out["token_type_ids"] = image.long()
    return {**out, **pixels}




def video_batch(model, length: int = 48) -> dict:
    """Two rows of text with a video of 4 frames each (as (videos, frames, C, H, W) pixel_values_videos): row 0
    early, row 1 across the middle; the rows grow to fit the videos' tokens, read from get_video_features.

    Raises:
        ValueError: the model takes no such videos.
    """
    cfg, v = model.config, model.config.vision_config
    video_id = next((x for k in ("video_token_id", "video_token_index") if isinstance(x := getattr(cfg, k, None), int)),
                    None)
    if video_id is None or not _accepts(model, "pixel_values_videos"):
        raise ValueError(f"{cfg.model_type} takes no pixel_values_videos")
    size = v.image_size if isinstance(v.image_size, int) else v.image_size[0]
    g = torch.Generator().manual_seed(6)
    videos = torch.randn(2, 4, getattr(v, "num_channels", 3), size, size, generator=g)
    with torch.no_grad():
        feats = model.model.get_video_features(pixel_values_videos=videos, return_dict=True)
    feats = getattr(feats, "pooler_output", feats)
    if isinstance(feats, (list, tuple)):
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    n = feats.reshape(-1, feats.shape[-1]).shape[0] // 2  # tokens per video
    L = max(length, 2 * n + 8)
    out = text_batch(model, L)
    ids = out["input_ids"]
    for row, at in enumerate((4, L // 2 - n // 2)):
        ids[row, at:at + n] = video_id
    out["labels"] = ids.masked_fill(ids == video_id, -100)
    out["labels"][:, :3] = -100
    if "mm_token_type_ids" in out:
        out["mm_token_type_ids"] = 2 * (ids == video_id).int()
    return {**out, "pixel_values_videos": videos}
