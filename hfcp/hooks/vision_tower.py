"""A VLM's vision tower with its work split over the CP group (docs/how-to/vision-language.md).

Towers of two kinds: those called with images along dim 0 (CLIP, SigLIP, InternViT), and Qwen-VL's, called with
every image's patches as one (patches, D) sequence and a `grid_thw` row per image (attention stays within each image,
outputs are rows per patch or per merged patch): both are split by images. A patch-sequence tower registered as
encoding each temporal frame alone (Qwen-VL's: attention, windows and position embeddings within a frame) is split
by frames: a video's grid row (t, h, w) is t units (1, h, w), so one long video is shared over the group too.

For towers that encode each image on its own (images along dim 0 of every per-image input),
each rank of the CP group encodes ceil(n / cp) of the n images (the last ranks' shares padded with copies of the
first image), and the outputs are all-gathered along dim 0 and cut back to n, so every rank merges all features as
one device does. The gather's backward sums each feature's gradient over the group and returns it to the rank that
encoded it: rank r's vision gradient is cp times its images' share (the loss convention), so the mean over the
group is the single-device gradient. Activations of the tower for backward are held for a rank's own images only.
"""
from __future__ import annotations

import torch
from accelerate.hooks import ModelHook

from ..distributed.collectives import all_gather

# vision configs' model_types whose towers encode each image on its own (filled by patches/: model knowledge); a
# record with vision_tower="auto" splits only these, and runs any other tower whole on every rank
_PER_IMAGE_TOWERS: set[str] = set()
_PER_FRAME_TOWERS: set[str] = set()  # of those, patch-sequence towers that encode each temporal frame alone


def register_per_image_tower(model_type: str, frames_alone: bool = False) -> None:
    """Declare that vision towers of config model_type `model_type` encode each image (or Qwen-VL grid) alone, so
    that hfcp may split their images over the CP group; frames_alone: a patch-sequence tower whose output for a
    grid (t, h, w) is that of its t frames (1, h, w) encoded one by one, so that a video's frames are split too."""
    _PER_IMAGE_TOWERS.add(model_type)
    if frames_alone:
        _PER_FRAME_TOWERS.add(model_type)


def splits_tower(vision_config) -> bool:
    """Whether a tower of this vision config is one hfcp splits (register_per_image_tower)."""
    return getattr(vision_config, "model_type", None) in _PER_IMAGE_TOWERS


def splits_frames(vision_config) -> bool:
    """Whether hfcp splits this tower's videos by frames (register_per_image_tower(..., frames_alone=True))."""
    return getattr(vision_config, "model_type", None) in _PER_FRAME_TOWERS


def _is_per_image(v, n: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n


class VisionTowerSplitHook(ModelHook):
    """pre_forward: this rank's share of the images; post_forward: every image's outputs, gathered."""

    def __init__(self, state, frames_alone: bool = False):
        self.state, self.frames_alone = state, frames_alone
        self._n = self._k = None
        self._grid = None  # a patch-sequence tower's call: (per-image patches, this rank's images, every rank's)

    def pre_forward(self, module, *args, **kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        if isinstance(grid, torch.Tensor):
            return self._split_patches(module, args, kwargs, grid)
        self._grid = None
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

    def _split_patches(self, module, args, kwargs, grid):
        """Qwen-VL: rows of pixel patches, grid_thw (n, 3); each rank takes the patches of its images (or frames)."""
        cp, rank = self.state.mesh.cp_size, self.state.mesh.cp_rank
        patches = args[0] if args else kwargs.get("hidden_states")
        total = int(grid.prod(-1).sum())
        if not isinstance(patches, torch.Tensor) or patches.shape[0] != total:
            raise ValueError(f"{type(module).__name__}: {total} patches in grid_thw but pixel rows of shape "
                             f"{tuple(getattr(patches, 'shape', ()))}")
        if self.frames_alone and grid.dim() == 2 and grid.shape[-1] == 3:  # each frame a unit: (t, h, w) -> t x (1, h, w)
            grid = torch.cat([torch.ones_like(grid[:, :1]), grid[:, 1:]], 1).repeat_interleave(grid[:, 0], dim=0)
        sizes = grid.prod(-1).tolist()  # patches per unit
        n = len(sizes)
        k = -(-n // cp)
        shares = [[i if i < n else 0 for i in range(r * k, (r + 1) * k)] for r in range(cp)]  # padded with image 0
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in shares[rank]]).to(patches.device)
        local = patches.index_select(0, rows)
        local_grid = grid.index_select(0, torch.tensor(shares[rank], device=grid.device))
        self._grid = (sizes, shares, n)
        args = (local, local_grid, *args[2:]) if len(args) > 1 else ((local,) if args else ())
        kwargs = {**kwargs, **({"grid_thw": local_grid} if "grid_thw" in kwargs else {})}
        if not args:
            kwargs["hidden_states"] = local
        return args, kwargs

    def _gather_patches(self, module, t):
        """Rows of this rank's images (per patch or per merged patch) -> rows of every image, in image order."""
        sizes, shares, n = self._grid
        k = len(shares[0])
        mine = sum(sizes[i] for i in shares[self.state.mesh.cp_rank])
        if t.dim() == 0 or any(sizes[i] * t.shape[0] % mine for share in shares for i in share):
            raise ValueError(f"{type(module).__name__} returned rows {tuple(t.shape)} for {mine} patches: hfcp splits "
                             "only towers whose outputs are rows per patch or per merged patch")
        per = [[sizes[i] * t.shape[0] // mine for i in share] for share in shares]  # rows of each image, per rank
        longest = max(sum(p) for p in per)
        padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, longest - t.shape[0]))
        every = all_gather(padded, self.state.mesh.cp_group, 0)  # (cp * longest, ...)
        pieces = []
        for r, counts in enumerate(per):
            at = r * longest
            for j, count in enumerate(counts):
                if r * k + j < n:  # not a padding copy
                    pieces.append(every[at:at + count])
                at += count
        return torch.cat(pieces)

    def post_forward(self, module, output):
        n, k = self._n, self._k
        group = self.state.mesh.cp_group

        def gather(t):
            if self._grid is not None:
                return self._gather_patches(module, t) if isinstance(t, torch.Tensor) else t
            if not isinstance(t, torch.Tensor):
                return t
            if t.dim() == 0 or t.shape[0] != k:
                raise ValueError(f"{type(module).__name__} returned a tensor of shape {tuple(t.shape)} for {k} images: "
                                 "hfcp splits only towers that encode each image on its own (outputs along dim 0)")
            return all_gather(t, group, 0)[:n]

        def each(v):  # a tuple or list of tensors (hidden states per layer, Qwen3-VL's deepstack features)
            return type(v)(gather(x) for x in v) if isinstance(v, (tuple, list)) else gather(v)

        if isinstance(output, tuple) and not hasattr(output, "keys"):
            return tuple(each(v) for v in output)
        for name, v in list(output.items()):
            output[name] = each(v)
        return output
