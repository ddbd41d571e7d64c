"""Data-parallel coordinates for data loading: every rank of a CP group must get the same batch."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mesh import consecutive_block
from ..state import cp_state, find_pretrained
from .tensor_parallel import tensor_parallel_ranks


def data_parallel_rank_and_size(model) -> tuple[int, int]:
    """(dp_rank, dp_size) to shard a dataset by: CP groups, not processes.

    A patched model: its mesh's dp coordinates (ranks of one CP group, and of one TP group, share dp_rank).
    Unpatched: every process is its own data-parallel rank (plain DDP), the ranks of one TP group share one for a
    tensor-parallel model, and (0, 1) without torch.distributed. A model split by hfcp.pipeline: its data groups
    (every stage and CP rank of one shares a batch).
    """
    try:
        pipelined = getattr(find_pretrained(model), "_hfcp_pipeline_data", None)
    except TypeError:  # not a transformers model
        pipelined = None
    if pipelined is not None:
        return pipelined
    state = cp_state(model)
    if state is not None:
        return state.mesh.dp_rank, state.mesh.dp_size
    if dist.is_available() and dist.is_initialized():
        try:
            inner = find_pretrained(model)
        except TypeError:  # not a transformers model: no TP that hfcp could read
            inner = None
        tp = tensor_parallel_ranks(inner) if inner is not None else None
        if tp is None:
            return dist.get_rank(), dist.get_world_size()
        if tp != consecutive_block(tp[0] // len(tp), len(tp)):  # the ranks of a TP group share a batch
            raise ValueError(f"the model's tensor-parallel group has ranks {tp}, not a block of consecutive ranks: "
                             "hfcp cannot tell its data-parallel index; shard the data by your mesh's data dimensions")
        return tp[0] // len(tp), dist.get_world_size() // len(tp)
    return 0, 1


def average_gradients(model) -> None:
    """Without DDP: average every parameter's .grad over the CP group (then each equals the single-device
    gradient). Under DDP/accelerate this is already done by the data-parallel all-reduce: do not call it."""
    state = cp_state(model)
    if state is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                # a tensor-parallel (DTensor) gradient: its local shard, the same shard on every rank of the CP group
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(grad, group=state.mesh.cp_group)
                grad.div_(state.mesh.cp_size)
