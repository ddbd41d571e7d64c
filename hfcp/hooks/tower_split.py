"""A VLM's vision tower, or an audio encoder, with its work split over the CP group (docs/how-to/vision-language.md,
docs/how-to/audio.md).

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

Audio encoders (docs/how-to/audio.md) are split the same way, by clips: those called with clips along dim 0
(Whisper-style encoders, each 30-second window attended alone) take the per-image path (never the grid one: their
second input is a mask, not a Qwen-VL grid); Qwen2.5-Omni's, called with every clip's frames concatenated along time
and a `feature_lens` entry per clip, gives each rank whole clips (as equal a count as can be; a rank left without
one encodes clip 0 and keeps none of it) and gathers the output rows in clip order, each rank's row count exchanged
first.

Before any gather, the ranks compare the shapes of what their tower returned (past dim 0 where row counts differ):
a tower registered for splitting whose outputs depend on the other items of its call raises on every rank.
"""
from __future__ import annotations

import zlib

import torch
from accelerate.hooks import ModelHook

from ..distributed.collectives import all_gather, all_gather_no_grad
from ..compiler import eager

def balanced_shares(n: int, cp: int) -> list[range]:
    """Items [0, n) in cp contiguous ranges whose sizes differ by at most one (empty ranges when n < cp)."""
    k, extra = divmod(n, cp)
    starts = [r * k + min(r, extra) for r in range(cp + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(cp)]


def _is_per_image(v, n: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n


class TowerSplitHook(ModelHook):
    """pre_forward: this rank's share of the images (or frames, or clips); post_forward: every one's outputs,
    gathered. mode: split_mode's value for the tower's config."""

    def __init__(self, state, mode: str = "items"):
        self.state, self.mode, self.frames_alone = state, mode, mode == "frames"
        self._n = self._k = None
        self._grid = None  # a patch-sequence tower's call: (per-image patches, this rank's images, every rank's)
        self._keeps = None  # clips in time: whether this rank keeps its output rows (False: a stand-in clip)
        self._valid = None  # clips along dim 0: which rows of this rank's share are the call's (False: padding)

    @eager
    def pre_forward(self, module, *args, **kwargs):
        self._keeps = None
        if self.mode == "time":
            return self._split_time(module, args, kwargs)
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)  # (an audio encoder's: its mask)
        if isinstance(grid, torch.Tensor) and self.mode != "clips":
            return self._split_patches(module, args, kwargs, grid)
        self._grid = None
        cp, rank = self.state.mesh.cp_size, self.state.mesh.cp_rank
        images = args[0] if args else kwargs.get("pixel_values", kwargs.get("input_features"))
        if not isinstance(images, torch.Tensor) or images.dim() < 2:
            raise ValueError(f"{type(module).__name__}: hfcp splits a tower's images or clips along dim 0 of its "
                             f"first input (pixel_values, input_features); got {type(images).__name__}")
        n = images.shape[0]
        k = -(-n // cp)
        take = torch.arange(rank * k, (rank + 1) * k, device=images.device)
        self._valid = take < n
        take = torch.where(self._valid, take, torch.zeros_like(take))  # padding: copies of image 0, dropped after

        def share(v):
            return v.index_select(0, take.to(v.device)) if _is_per_image(v, n) else v

        self._n, self._k = n, k
        return tuple(share(a) for a in args), {name: share(v) for name, v in kwargs.items()}

    def share_valid(self) -> torch.Tensor:
        """(k,) bool: which rows of this rank's share of the current call are the call's items (False: the copies
        of item 0 that pad it)."""
        if self._valid is None:
            raise RuntimeError("hfcp: a batch norm of a split encoder ran outside the encoder's call")
        return self._valid

    def _split_patches(self, module, args, kwargs, grid):
        """Qwen-VL: rows of pixel patches, grid_thw (n, 3); each rank takes the patches of its images (or frames)."""
        cp, rank = self.state.mesh.cp_size, self.state.mesh.cp_rank
        patches = args[0] if args else kwargs.get("hidden_states")
        total = int(grid.prod(-1).sum())
        if not isinstance(patches, torch.Tensor) or patches.shape[0] != total:
            raise ValueError(f"{type(module).__name__}: {total} patches in grid_thw but pixel rows of shape "
                             f"{tuple(getattr(patches, 'shape', ()))}")
        # each frame a unit: (t, h, w) -> t x (1, h, w)
        if self.frames_alone and grid.dim() == 2 and grid.shape[-1] == 3:
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
        kept = [sum(c for j, c in enumerate(counts) if r * k + j < n) for r, counts in enumerate(per)]  # (padding
        return self._gather_uneven(t, kept, max(sum(p) for p in per))  # copies end a share: its rows are dropped)

    def _gather_uneven(self, t, kept: list[int], longest: int):
        """Every rank's first kept[r] rows of its `t`, in rank order (each padded to `longest` rows to be gathered)."""
        padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, longest - t.shape[0]))
        every = all_gather(padded, self.state.mesh.cp_group, 0)  # (cp * longest, ...)
        return torch.cat([every[r * longest:r * longest + rows] for r, rows in enumerate(kept)])

    def _split_time(self, module, args, kwargs):
        """Qwen2.5-Omni: (mel, frames) of every clip concatenated, feature_lens (n,); each rank takes whole clips."""
        cp, rank = self.state.mesh.cp_size, self.state.mesh.cp_rank
        feats = args[0] if args else kwargs.get("input_features")
        lens = kwargs.get("feature_lens", args[1] if len(args) > 1 else None)
        if not isinstance(lens, torch.Tensor) or not isinstance(feats, torch.Tensor) or lens.dim() != 1 \
                or int(lens.sum()) != feats.shape[-1]:
            raise ValueError(f"{type(module).__name__}: hfcp splits this encoder's clips by feature_lens, one length "
                             f"per clip summing to the frames of input_features; got feature_lens "
                             f"{getattr(lens, 'tolist', lambda: lens)()} for input_features of shape "
                             f"{tuple(getattr(feats, 'shape', ()))}")
        n = lens.shape[0]
        mine = balanced_shares(n, cp)[rank]
        self._keeps = len(mine) > 0
        take = list(mine) if self._keeps else [0]  # a rank without a clip encodes clip 0 and keeps none of it
        starts = [0, *torch.cumsum(lens, 0).tolist()]
        cols = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in take]).to(feats.device)
        idx = torch.tensor(take, device=lens.device)

        def share(v):
            return v.index_select(0, idx.to(v.device)) if _is_per_image(v, n) else v

        local = feats.index_select(feats.dim() - 1, cols)
        kwargs = {name: share(v) for name, v in kwargs.items()}
        if args:
            return (local, *(share(a) for a in args[1:])), kwargs
        return (), {**kwargs, "input_features": local}

    def _gather_rows(self, t):
        """Rows of this rank's clips -> rows of every clip in clip order (each rank's count exchanged first)."""
        group = self.state.mesh.cp_group
        sizes = all_gather_no_grad(torch.tensor([[t.shape[0], t.shape[0] if self._keeps else 0]], device=t.device),
                                   group, 0).tolist()  # (cp, 2): rows returned, rows kept
        return self._gather_uneven(t, [kept for _, kept in sizes], max(s for s, _ in sizes))

    def _check_alike(self, module, output) -> None:
        """Raise on every rank unless every rank's tower returned as many tensors of the same shapes (past dim 0 where
        ranks hold different row counts): gathering unlike shapes aborts gloo and reads past the data on NCCL."""
        values = (output,) if isinstance(output, torch.Tensor) else output.values() if hasattr(output, "keys") \
            else output
        tensors = [t for v in values for t in (v if isinstance(v, (tuple, list)) else (v,))
                   if isinstance(t, torch.Tensor)]
        if not tensors:
            return
        rows_differ = self._keeps is not None or self._grid is not None
        shapes = [tuple(t.shape[1:] if rows_differ else t.shape) for t in tensors]
        mine = torch.tensor([[len(shapes), zlib.crc32(repr(shapes).encode())]], device=tensors[0].device)
        every = all_gather_no_grad(mine, self.state.mesh.cp_group, 0)  # (cp, 2)
        if not bool((every == mine).all()):
            raise ValueError(f"{type(module).__name__} returned tensors of shapes {shapes} on CP rank "
                             f"{self.state.mesh.cp_rank} and others on other ranks{' (past dim 0)' * rows_differ}: "
                             "hfcp splits only towers whose outputs are per image or clip, each alike whatever the "
                             "others are; register this one without splitting (it then runs whole on every rank)")

    @eager
    def post_forward(self, module, output):
        n, k = self._n, self._k
        group = self.state.mesh.cp_group
        self._check_alike(module, output)

        def gather(t):
            if self._keeps is not None and isinstance(t, torch.Tensor) and t.dim() == 0:
                raise ValueError(f"{type(module).__name__} returned a 0-dim tensor: hfcp splits only encoders whose "
                                 "outputs are rows per clip, in clip order")
            if self._keeps is not None:
                return self._gather_rows(t) if isinstance(t, torch.Tensor) else t
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

        if isinstance(output, torch.Tensor):
            return gather(output)
        if isinstance(output, tuple) and not hasattr(output, "keys"):
            return tuple(each(v) for v in output)
        for name, v in list(output.items()):
            output[name] = each(v)
        return output
