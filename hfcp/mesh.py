"""The (dp, cp) process mesh: cp is the inner dimension, so ranks [d*cp, (d+1)*cp) form CP group d."""
from __future__ import annotations

import datetime
import logging
import math
import os
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger("hfcp")


@dataclass(frozen=True)
class Mesh:
    cp_group: object  # ProcessGroup
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int


def as_timedelta(timeout) -> datetime.timedelta | None:
    """None, seconds (int/float) or a timedelta -> timedelta or None.

    Raises ValueError for anything else, including zero, negative, NaN and infinite values (a collective cannot
    wait forever: None keeps the process group's default).
    """
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) and seconds > 0
    if not ok:
        raise ValueError(f"timeout={timeout!r} must be a positive, finite number of seconds or datetime.timedelta "
                         "(None: the process group's default timeout)")
    return datetime.timedelta(seconds=float(seconds))


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


def build_mesh(cp_size: int | None, process_group=None, timeout=None) -> Mesh | None:
    """The CP group of this rank, or None when context parallelism is a no-op (one process, cp_size 1).

    Args:
        cp_size: ranks per CP group; None means the whole world (or the size of `process_group`).
        process_group: use this group as the CP group instead of building the mesh.
        timeout: bounds every collective on the CP group (seconds or timedelta).
    Raises:
        ValueError: cp_size not a positive int, larger than or not dividing the world size.
    """
    td = as_timedelta(timeout)
    if process_group is not None:
        # new_group gives non-members a placeholder, not the group: hfcp cannot see its ranks then
        member = process_group is not dist.GroupMember.NON_GROUP_MEMBER
        ranks = dist.get_process_group_ranks(process_group) if member else "(not a member)"
        if not member or dist.get_rank() not in ranks:
            raise ValueError(
                f"process_group has global ranks {ranks}, which do not include this rank {dist.get_rank()}: pass "
                "every rank the CP group it belongs to (or pass cp_size and let hfcp build the groups)"
            )
        size = dist.get_world_size(process_group)
        if cp_size is not None and cp_size != size:
            raise ValueError(f"cp_size={cp_size} differs from the size {size} of the given process_group")
        if td is not None:
            raise ValueError("timeout= applies to the groups hfcp creates; create your process_group with "
                             "torch.distributed.new_group(..., timeout=...) instead")
        if size == 1:
            return None
        if ranks != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size:
            raise ValueError(
                f"process_group ranks {ranks}: hfcp needs consecutive blocks [d*cp, (d+1)*cp) to know each rank's "
                "data-parallel index; pass cp_size instead and let hfcp build the groups"
            )
        world = dist.get_world_size()
        return Mesh(process_group, size, dist.get_rank(process_group), world // size, ranks[0] // size)
    world = world_size()
    if cp_size is None:
        cp_size = world
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive integer (or None for the whole world)")
    if cp_size > world or world % cp_size:
        raise ValueError(
            f"cp_size={cp_size} must divide the world size {world}; "
            f"choose one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if cp_size == 1:
        return None
    rank = dist.get_rank()
    mine = None
    for d in range(world // cp_size):  # every rank creates every group, in the same order
        ranks = list(range(d * cp_size, (d + 1) * cp_size))
        group = dist.new_group(ranks, timeout=td) if td is not None else dist.new_group(ranks)
        if rank in ranks:
            mine = group
    log.info("hfcp: mesh dp=%d x cp=%d, rank %d is cp rank %d", world // cp_size, cp_size, rank, rank % cp_size)
    return Mesh(mine, cp_size, rank % cp_size, world // cp_size, rank // cp_size)
