"""The process mesh of a CP group: which ranks share a sequence (the CP group), and which share a batch.

Ranks of one CP group share a batch; under tensor parallelism the ranks of one TP group do too, so a data-parallel
group is a CP group times a TP group. hfcp's own groups (`cp_size`) put cp inside dp and outside tp, in the rank
order of accelerate's ParallelismConfig and transformers' DistributedConfig: rank = (d * cp + c) * tp + t. A group
given by the caller (`process_group`, `device_mesh`) may be any set of ranks: the data-parallel coordinates are then
read from every rank's groups in one all-gather over the world at patch time (every rank of the world calls patch).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from ..state import as_timedelta  # noqa: F401 - (hfcp.distributed.mesh.as_timedelta, as before)

log = logging.getLogger("hfcp")


@dataclass(frozen=True)
class Mesh:
    cp_group: object  # ProcessGroup
    cp_size: int
    cp_rank: int
    dp_size: int  # groups of ranks that share a batch (CP x TP groups)
    dp_rank: int
    # the global ranks of every CP group of the world, in the same order everywhere
    cp_groups: tuple[tuple[int, ...], ...]
    data_leaders: tuple[int, ...]  # the first global rank of each data-parallel group, by dp_rank


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_size() -> int:
    """The distributed world size, or 1 when no process group is initialised.

    Raises RuntimeError when the environment announces several processes but none is initialised,
    since each process would otherwise silently train on the whole sequence alone.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if env_world_size() > 1:
        raise RuntimeError(
            f"WORLD_SIZE={env_world_size()} but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() (or create an accelerate Accelerator) before hfcp.patch"
        )
    return 1


OTHER_DIMENSIONS = ("dp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp", "fsdp", "tp", "pp", "ep", "sp")


def cp_group_of_device_mesh(device_mesh) -> dist.ProcessGroup:
    """The process group of a DeviceMesh's CP dimension.

    Args:
        device_mesh: a 1-D torch DeviceMesh (unnamed, or named other than a data, tensor, pipeline, expert or
            sequence dimension), or a larger one with a dimension named "cp".
    Returns:
        The CP dimension's process group (this rank's).
    Raises:
        ValueError: not a DeviceMesh; a larger mesh without a "cp" dimension; a 1-D mesh named as another dimension
            (mesh["dp"] passed for mesh["cp"]).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"device_mesh={device_mesh!r} must be a torch DeviceMesh (such as mesh['cp'] of "
                         "init_device_mesh(..., mesh_dim_names=(..., 'cp', ...)))")
    names = device_mesh.mesh_dim_names or ()
    if device_mesh.ndim > 1:
        if "cp" not in names:
            raise ValueError(f"device_mesh has {device_mesh.ndim} dimensions {names} and none named 'cp': pass the "
                             "CP dimension, device_mesh=mesh['<name>']")
        device_mesh = device_mesh["cp"]
    elif names and names[0] in OTHER_DIMENSIONS:
        raise ValueError(f"device_mesh is the mesh's {names[0]!r} dimension, not its CP one: pass mesh['cp']")
    return device_mesh.get_group()


def tp_ranks_of_device_mesh(device_mesh) -> list[int] | None:
    """The global ranks of this rank's "tp" dimension of a larger DeviceMesh, or None (1-D, no "tp", or tp of 1)."""
    names = device_mesh.mesh_dim_names or ()
    if device_mesh.ndim < 2 or "tp" not in names or device_mesh["tp"].size() == 1:
        return None
    return dist.get_process_group_ranks(device_mesh["tp"].get_group())


def build_mesh(cp_size: int | None, process_group=None, timeout=None, tp_ranks: list[int] | None = None) -> Mesh | None:
    """The CP group of this rank, or None when context parallelism is a no-op (one process, cp_size 1).

    Args:
        cp_size: ranks per CP group; None means the whole world (divided by the TP size), or the size of
            `process_group`.
        process_group: use this group as the CP group instead of building the mesh.
        timeout: bounds every collective on the CP group (seconds or timedelta).
        tp_ranks: the global ranks of this rank's tensor-parallel group (the model's), None without TP.
    Raises:
        ValueError: cp_size not a positive int, larger than or not dividing the world size (over the TP size); a
            CP group that shares ranks with the TP group or that does not hold this rank.
    """
    td = as_timedelta(timeout)
    tp = len(tp_ranks) if tp_ranks else 1
    if process_group is not None:
        return _given_group(process_group, cp_size, td, tp_ranks)
    world = world_size()
    if tp > 1 and (world % tp or tp_ranks != consecutive_block(dist.get_rank() // tp, tp)):
        raise ValueError(f"the model's tensor-parallel group has ranks {tp_ranks}: hfcp builds its CP groups outside "
                         "TP groups of consecutive ranks (as accelerate and transformers lay them out); pass "
                         "device_mesh=mesh['cp'] (or process_group=) for another layout")
    if cp_size is None:
        cp_size = world // tp
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive integer (or None for the whole world)")
    if cp_size * tp > world or world % (cp_size * tp):
        room = world // tp
        what = f"{room} (the world size {world} over the model's tp_size={tp})" if tp > 1 else f"the world size {world}"
        raise ValueError(f"cp_size={cp_size} must divide {what}; "
                         f"choose one of {[d for d in range(1, room + 1) if room % d == 0]}")
    if cp_size == 1:
        return None
    rank = dist.get_rank()
    groups = tuple(tuple((d * cp_size + c) * tp + t for c in range(cp_size))
                   for d in range(world // (cp_size * tp)) for t in range(tp))
    mine = None
    for ranks in groups:  # every rank creates every group, in the same order
        group = dist.new_group(list(ranks), timeout=td) if td is not None else dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    d, c = rank // (cp_size * tp), (rank // tp) % cp_size
    log.info("hfcp: mesh dp=%d x cp=%d x tp=%d, rank %d is cp rank %d", world // (cp_size * tp), cp_size, tp, rank, c)
    leaders = tuple(range(0, world, cp_size * tp))
    return Mesh(mine, cp_size, c, len(leaders), d, groups, leaders)


def consecutive_block(index: int, size: int) -> list[int]:
    """The ranks [index * size, (index + 1) * size): the index-th group of hfcp's own layout."""
    return list(range(index * size, (index + 1) * size))


def _given_group(process_group, cp_size, td, tp_ranks) -> Mesh | None:
    """A CP group the caller made: compared with every rank's in one all-gather over the world (every rank of the world
    calls patch, as every rank called new_group), and refused on every rank when one rank's group is wrong or they
    disagree, so none is left waiting."""
    # new_group gives non-members a placeholder, not the group: hfcp cannot see its ranks then
    member = process_group is not dist.GroupMember.NON_GROUP_MEMBER
    ranks = dist.get_process_group_ranks(process_group) if member else []
    me, world = dist.get_rank(), dist.get_world_size()
    problem = None
    if me not in ranks:
        problem = (f"process_group has global ranks {ranks or '(not a member)'}, which do not include rank {me}: "
                   "pass every rank the CP group it belongs to (or pass cp_size and let hfcp build the groups)")
    elif cp_size is not None and cp_size != len(ranks):
        problem = f"cp_size={cp_size} differs from the size {len(ranks)} of the given process_group"
    elif td is not None:
        problem = ("timeout= applies to the groups hfcp creates; create your process_group with "
                   "torch.distributed.new_group(..., timeout=...) instead")
    elif tp_ranks and set(ranks) & set(tp_ranks) != {me}:
        problem = (f"the CP group {ranks} shares ranks with the model's tensor-parallel group {tp_ranks}: the CP "
                   "group must be orthogonal to TP (mesh['cp'] of a mesh with both 'cp' and 'tp' dimensions)")
    every = [None] * world
    dist.all_gather_object(every, (problem, tuple(ranks), tuple(tp_ranks or [me])))
    refused = [(r, p) for r, (p, _, _) in enumerate(every) if p is not None]
    if refused:
        raise ValueError(problem if problem is not None else f"rank {refused[0][0]} refused its process_group: "
                         f"{refused[0][1]}")
    return _coordinates(process_group, [(cp, tp) for _, cp, tp in every])


def _coordinates(process_group, every: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Mesh | None:
    """Every rank's (CP ranks, TP ranks), the same list on every rank: checked (so refused on every rank alike), then
    the data-parallel groups are their unions (a CP group times a TP group)."""
    me, world = dist.get_rank(), dist.get_world_size()
    cp_ranks = list(every[me][0])
    cps = sorted({cp for cp, _ in every})
    tps = sorted({tp for _, tp in every})
    disagree = [(r, c) for r, (cp, _) in enumerate(every) for c in cp if every[c][0] != cp]
    if disagree:
        r, c = disagree[0]
        raise ValueError(f"rank {r} passes the CP group {list(every[r][0])} and its member rank {c} passes "
                         f"{list(every[c][0])}: every rank of a CP group must pass that same group")
    if len({len(cp) for cp in cps}) > 1:
        raise ValueError(f"the ranks pass CP groups of different sizes ({cps}): give every rank one of the same size")
    misaligned = [tp for tp in tps if len({every[t][0].index(t) for t in tp}) > 1]
    if misaligned:
        raise ValueError(f"the ranks of the tensor-parallel group {list(misaligned[0])} hold different CP ranks in "
                         f"the CP groups {cps}: they would compute different tokens; build the CP groups over one "
                         "mesh with both dimensions (mesh['cp'])")
    mixed = [cp for cp in cps if len({every[c][1].index(c) for c in cp}) > 1]
    if mixed:
        raise ValueError(f"the ranks of the CP group {list(mixed[0])} hold different tensor-parallel shards (TP groups "
                         f"{tps}): their attention would exchange keys and values of different heads; build the CP "
                         "groups over one mesh with both dimensions (mesh['cp'])")
    data = [{x for c in cp for x in every[c][1]} | set(tp) for cp, tp in every]  # each rank's data group
    groups = sorted({tuple(sorted(g)) for g in data})
    covered = sorted(x for g in groups for x in g)
    want = len(cps[0]) * len(tps[0])
    if covered != list(range(world)) or any(len(g) != want for g in groups):
        raise ValueError(f"the CP groups {cps} with the TP groups {tps} do not split the world into data-parallel "
                         f"groups of cp x tp = {want} ranks: build both over one mesh")
    if len(cp_ranks) == 1:
        return None
    mine = next(i for i, g in enumerate(groups) if me in g)
    log.info("hfcp: CP group %s, data-parallel group %d of %d", cp_ranks, mine, len(groups))
    return Mesh(process_group, len(cp_ranks), cp_ranks.index(me), len(groups), mine, tuple(cps),
                tuple(g[0] for g in groups))
