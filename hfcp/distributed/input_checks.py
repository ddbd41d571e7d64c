"""Input checks run by the shard hooks.

Order matters for "no rank hangs": `check_same_batch` (one tiny all-gather of a digest per step) runs before
anything that could raise on one rank only, and compares a digest that any change of any element changes.
Once the ranks agree that they hold the same batch, the checks that read the data (`check_lm_batch`) raise
on every rank of the CP group alike, before any other collective.
"""
from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist

from .collectives import all_gather_no_grad

BATCH_NAMES = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "token_type_ids", "labels",
               "shift_labels", "num_items_in_batch", "ignore_index", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx",
               # vision-language models: what the outer model encodes and merges on every rank
               "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes",
               "mm_token_type_ids", "second_per_grid_ts",
               # audio-language and omni models: the clips, their frame masks and lengths
               "input_features", "feature_attention_mask", "input_features_mask", "padding_mask",
               "audio_feature_lengths", "video_second_per_grid", "use_audio_in_video")
_BLOCK = 1 << 18  # words per weighted block
_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=8)
def _weights(device: str) -> torch.Tensor:
    """(_BLOCK,) odd int64 weights from a fixed seed: the same on every rank."""
    g = torch.Generator().manual_seed(0x5EED)
    return (torch.randint(-(1 << 62), 1 << 62, (_BLOCK,), generator=g, dtype=torch.int64) * 2 + 1).to(device)


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _block_multiplier(j: int) -> int:
    return _signed((2 * j + 1) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) | 1


def _meta_digest(value) -> int:
    """Shape and dtype of a tensor (or the repr of anything else) -> int64."""
    text = f"{value.dtype}{tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
    return _signed(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little"))


def content_digest(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on t's device: sum over the bytes of t, read as words w_i, of w_i * c_i mod 2^64,
    with pseudo-random odd weights c_i that differ per position. Changing, swapping or compensating edits of
    elements change it (except with probability ~2^-48); computed block by block, so no copy of a large
    tensor is made (only a non-contiguous one is made contiguous)."""
    x = t.detach()
    x = x.contiguous() if not x.is_contiguous() else x
    words = x.reshape(-1).view(torch.uint8)
    if words.numel() % 4 == 0:
        words = words.view(torch.int32)
    elif words.numel() % 2 == 0:
        words = words.view(torch.int16)
    w = _weights(str(words.device))
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for j, start in enumerate(range(0, words.numel(), _BLOCK)):
        part = words[start : start + _BLOCK]
        total += (part.long() * w[: part.numel()]).sum() * _block_multiplier(j)  # int64 arithmetic wraps
    return total


def batch_digest(kw: dict, names=BATCH_NAMES, device=None) -> torch.Tensor:
    """(2 * len(names),) int64: (meta, content) digest of each named argument (None and absent alike)."""
    device = device or torch.device("cpu")
    parts = []
    for name in names:
        v = kw.get(name)
        parts.append(torch.tensor(_meta_digest(v), dtype=torch.int64, device=device))
        parts.append(content_digest(v).to(device) if isinstance(v, torch.Tensor)
                     else torch.zeros((), dtype=torch.int64, device=device))
    return torch.stack(parts)


def check_same_batch(kw: dict, group, names=BATCH_NAMES) -> None:
    """Raises ValueError on every rank of `group` if any rank's batch differs (shape, dtype or any element).

    Never raises before its collective for any input, so every rank reaches it and no rank hangs.
    """
    device = None
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    every = all_gather_no_grad(batch_digest(kw, names, device)[None], group, dim=0).cpu()  # (cp, 2 * len(names))
    differs = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
    if differs:
        ranks = dist.get_process_group_ranks(group)
        which = [n for i, n in enumerate(names)
                 if not bool((every[:, 2 * i : 2 * i + 2] == every[0, 2 * i : 2 * i + 2]).all())]
        raise ValueError(
            f"ranks of one CP group got different batches ({', '.join(which)}): global ranks "
            f"{[ranks[r] for r in differs]} differ from rank {ranks[0]}. Every rank of a CP group must get the same "
            "full batch: split data over data-parallel groups with hfcp.data_parallel_rank_and_size(model) (or train "
            "with hfcp.integrations.HfcpTrainer, which does), and keep any randomness of the data pipeline the same on "
            "every rank of a CP group; pass check_inputs=False to hfcp.patch to skip this check"
        )


def check_shapes(kw: dict, batch: int, length: int) -> None:
    """Raises ValueError when labels / attention_mask / position_ids / token_type_ids do not match (batch, length)."""
    for name in ("labels", "shift_labels", "attention_mask", "position_ids", "token_type_ids"):
        t = kw.get(name)
        if t is None:
            continue
        rows = (1, batch) if name in ("position_ids", "token_type_ids") else (batch,)
        ok = t.dim() == 2 and t.shape[1] == length and t.shape[0] in rows
        if name == "position_ids":  # any leading dims: (B, L), (3, B, L) mRoPE, (4, B, L) with a text row
            ok = t.dim() >= 2 and t.shape[-1] == length and t.shape[-2] in rows
        if not ok:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but the input is (batch={batch}, seq={length}); "
                f"pass {name} of shape ({batch}, {length})"
            )


def check_token_range(name: str, t: torch.Tensor, vocab: int, ignore: int | None = None) -> None:
    """Raises ValueError unless every element of the integer tensor `t` is in [0, vocab) or equals `ignore`."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {t.dtype}; pass integer token ids (torch.long)")
    bad = (t < 0) | (t >= vocab)
    if ignore is not None:
        bad &= t != ignore
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        also = f" and is not the ignore_index {ignore}" if ignore is not None else ""
        raise ValueError(f"{name}[{', '.join(map(str, where))}] = {int(t[where])} is outside the vocabulary "
                         f"[0, {vocab}){also}; fix the batch")
