"""Input checks run by the shard hook: shapes against input_ids, and one tiny collective per step that
verifies every rank of a CP group got the same batch (they must: each rank shards the FULL batch)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_no_grad


def check_shapes(kw: dict, batch: int, length: int) -> None:
    """Raises ValueError when labels / attention_mask / position_ids do not match (batch, length)."""
    for name in ("labels", "attention_mask", "position_ids"):
        t = kw.get(name)
        if t is None:
            continue
        ok = t.dim() == 2 and t.shape[1] == length and t.shape[0] in ((1, batch) if name == "position_ids" else (batch,))
        if name == "attention_mask" and t.dim() == 4:
            raise ValueError(
                f"attention_mask of shape {tuple(t.shape)}: hfcp builds masks from global token indices and accepts "
                "only a 2D (batch, seq) padding mask; a custom 4D mask cannot be split exactly, so it is refused"
            )
        if not ok:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but the input is (batch={batch}, seq={length}); "
                f"pass {name} of shape ({batch}, {length})"
            )


def _fingerprint(t: torch.Tensor | None) -> list[float]:
    """numel, the sum, and sums over two strided samples (so most reorderings change it too); fp64
    accumulation without materialising a copy of the tensor (a long video's pixels can be 100s of MB)."""
    if t is None:
        return [-1.0, 0.0, 0.0, 0.0]
    x = t.detach().reshape(-1)
    return [float(x.numel()), float(x.sum(dtype=torch.float64)), float(x[::7].sum(dtype=torch.float64)),
            float(x[5::13].sum(dtype=torch.float64))]


def check_same_batch(kw: dict, group, names=("input_ids", "inputs_embeds", "position_ids", "attention_mask", "labels")):
    """Raises ValueError on every rank of `group` if any rank's batch differs (shape or content)."""
    fp = torch.tensor([v for n in names for v in _fingerprint(kw.get(n))], dtype=torch.float64)
    ref = next((kw[n] for n in names if kw.get(n) is not None), None)
    if ref is not None and dist.get_backend(group) == "nccl":
        fp = fp.to(ref.device)
    every = all_gather_no_grad(fp[None], group, dim=0).cpu()  # (cp, 4 * len(names))
    differs = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
    if differs:
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(
            f"ranks of one CP group got different batches: global ranks {[ranks[r] for r in differs]} differ from "
            f"rank {ranks[0]} (every rank of a CP group must get the same full batch; split data over data-parallel "
            "groups with hfcp.data_parallel_rank_and_size(model)); pass check_inputs=False to hfcp.patch to skip this"
        )
