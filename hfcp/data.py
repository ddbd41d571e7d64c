"""Data-parallel coordinates for data loading: every rank of a CP group must get the same batch."""
from __future__ import annotations

import torch.distributed as dist

from .patch import cp_state


def data_parallel_rank_and_size(model) -> tuple[int, int]:
    """(dp_rank, dp_size) to shard a dataset by: CP groups, not processes.

    A patched model: its mesh's dp coordinates (ranks of one CP group share dp_rank). Unpatched: every
    process is its own data-parallel rank (plain DDP), or (0, 1) without torch.distributed.
    """
    state = cp_state(model)
    if state is not None:
        return state.mesh.dp_rank, state.mesh.dp_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def average_gradients(model) -> None:
    """Without DDP: average every parameter's .grad over the CP group (then each equals the single-device
    gradient). Under DDP/accelerate this is already done by the data-parallel all-reduce: do not call it."""
    state = cp_state(model)
    if state is None:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=state.mesh.cp_group)
            p.grad.div_(state.mesh.cp_size)
