"""Tiny random vision and video encoders (ViT, VideoMAE, DINOv2, ViViT) and their inputs, as the vision tests and the
family sweeps build them."""
from __future__ import annotations

import torch
import transformers

VISION_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)


def tiny_vision(family: str, head: str, **over):
    """A tiny seeded ViT, VideoMAE, DINOv2 or ViViT (family), its classifier (head "cls") or base model, in fp32 and
    training mode; `over`: config fields to change."""
    if family == "vit":
        cfg = transformers.ViTConfig(**{**VISION_SHAPE, "image_size": 32, "patch_size": 8, **over})
        cls = transformers.ViTForImageClassification if head == "cls" else transformers.ViTModel
    elif family == "videomae":
        cfg = transformers.VideoMAEConfig(**{**VISION_SHAPE, "image_size": 16, "patch_size": 8, "num_frames": 6,
                                             "tubelet_size": 2, **over})
        cls = transformers.VideoMAEForVideoClassification if head == "cls" else transformers.VideoMAEModel
    elif family == "dinov2":  # 16 patches + CLS = 17 tokens
        cfg = transformers.Dinov2Config(**{**VISION_SHAPE, "image_size": 32, "patch_size": 8, "mlp_ratio": 2, **over})
        cls = transformers.Dinov2ForImageClassification if head == "cls" else transformers.Dinov2Model
    else:
        cfg = transformers.VivitConfig(**{**VISION_SHAPE, "image_size": 16, "num_frames": 4, "tubelet_size": [2, 8, 8],
                                          "hidden_dropout_prob": 0.0, **over})
        cls = transformers.VivitForVideoClassification if head == "cls" else transformers.VivitModel
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg).float().train()


def pixel_values(family: str, batch: int, size: int | None = None, frames: int | None = None):
    """Seeded pixel values for tiny_vision(family): images (batch, 3, size, size) or videos (batch, frames, 3, 16,
    16)."""
    g = torch.Generator().manual_seed(5)
    if family in ("vit", "dinov2"):
        return torch.randn(batch, 3, size or 32, size or 32, generator=g)
    return torch.randn(batch, frames or (6 if family == "videomae" else 4), 3, 16, 16, generator=g)
