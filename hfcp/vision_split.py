"""A VLM's vision tower with its work split over the CP group (DESIGN.md "Vision-language models").

For towers that encode each image on its own (CLIP, SigLIP, InternViT: images along dim 0 of every per-image input),
each rank of the CP group encodes ceil(n / cp) of the n images (the last ranks' shares padded with copies of the
first image), and the outputs are all-gathered along dim 0 and cut back to n, so every rank merges all features as
one device does. The gather's backward sums each feature's gradient over the group and returns it to the rank that
encoded it: rank r's vision gradient is cp times its images' share (the loss convention), so the mean over the
group is the single-device gradient. Activations of the tower for backward are held for a rank's own images only.
"""
from __future__ import annotations

import torch
from accelerate.hooks import ModelHook

from .collectives import all_gather


def _is_per_image(v, n: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n


class VisionTowerSplitHook(ModelHook):
    """pre_forward: this rank's share of the images; post_forward: every image's outputs, gathered."""

    def __init__(self, state):
        self.state = state
        self._n = self._k = None

    def pre_forward(self, module, *args, **kwargs):
        cp, rank = self.state.mesh.cp_size, self.state.mesh.cp_rank
        images = args[0] if args else kwargs.get("pixel_values")
        if not isinstance(images, torch.Tensor) or images.dim() < 2:
            raise ValueError(f"{type(module).__name__}: hfcp splits a vision tower's images along dim 0 of its "
                             f"first input (pixel_values); got {type(images).__name__}")
        n = images.shape[0]
        k = -(-n // cp)
        take = torch.arange(rank * k, (rank + 1) * k, device=images.device)
        take = torch.where(take < n, take, torch.zeros_like(take))  # padding: copies of image 0, dropped after

        def share(v):
            return v.index_select(0, take.to(v.device)) if _is_per_image(v, n) else v

        self._n, self._k = n, k
        return tuple(share(a) for a in args), {name: share(v) for name, v in kwargs.items()}

    def post_forward(self, module, output):
        n, k = self._n, self._k
        group = self.state.mesh.cp_group

        def gather(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.dim() == 0 or t.shape[0] != k:
                raise ValueError(f"{type(module).__name__} returned a tensor of shape {tuple(t.shape)} for {k} images: "
                                 "hfcp splits only towers that encode each image on its own (outputs along dim 0)")
            return all_gather(t, group, 0)[:n]

        if isinstance(output, tuple) and not hasattr(output, "keys"):
            return tuple(tuple(gather(x) for x in v) if isinstance(v, tuple) else gather(v) for v in output)
        for name, v in list(output.items()):
            output[name] = tuple(gather(x) for x in v) if isinstance(v, tuple) else gather(v)
        return output
