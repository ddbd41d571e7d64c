"""What hfcp reads from a model that transformers loaded tensor-parallel (`tp_plan="auto"` / DistributedConfig).

Under TP each rank of a TP group computes some heads of every attention layer and the same tokens, so a TP group
shares its batch and its sequence shard: the CP group runs across TP groups, never inside one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_parallel_ranks(model) -> list[int] | None:
    """The global ranks of this rank's TP group, or None when the model is not tensor-parallel.

    transformers records the degree as `model.tp_size` and the mesh it sharded over as `model._device_mesh` (its
    "tp" dimension when the mesh has several).

    Raises:
        ValueError: a model split into pipeline stages (DistributedConfig pp_size > 1: a CP group would span
            stages), a TP degree without a mesh hfcp can read, or one that disagrees with the mesh.
    """
    pp = getattr(getattr(model.config, "distributed_config", None), "pp_size", None) or 1
    if pp > 1:
        raise ValueError(f"{type(model).__name__} is split into pipeline stages (pp_size={pp}): hfcp does not run CP "
                         "with pipeline parallelism; load it without pp_size")
    size = getattr(model, "tp_size", None) or 1
    if size <= 1:
        return None
    mesh = getattr(model, "_device_mesh", None)
    names = (getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
    if mesh is None or (mesh.ndim > 1 and "tp" not in names):
        raise ValueError(f"{type(model).__name__} has tp_size={size} but no device mesh with a 'tp' dimension hfcp "
                         "can read the tensor-parallel group from (model._device_mesh); load it with transformers' "
                         "tp_plan or DistributedConfig")
    if mesh.ndim > 1:
        mesh = mesh["tp"]
    ranks = dist.get_process_group_ranks(mesh.get_group())
    if len(ranks) != size:
        raise ValueError(f"{type(model).__name__} has tp_size={size} but its tp mesh has ranks {ranks}")
    return ranks


def is_sharded(weight: torch.Tensor) -> bool:
    """A DTensor parameter (tensor parallel or sharded data parallel): a plain matmul with it would raise or
    read one shard."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)
