"""The test pool itself (hfcp/testing/dist_pool.py): a task's process groups outlive every rank's part of the task;
tasks of two pools run side by side."""
import os
import signal
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from hfcp.testing.dist_pool import DistPool, OneAfterAnother, run_side_by_side


def frozen_in_new_group(frozen: int) -> None:
    """Rank `frozen` is stopped (SIGSTOP) as it enters new_group and resumed 0.5 s later by a shell, as a loaded
    machine can leave a process unscheduled; the other rank returns as soon as its own new_group does."""
    if dist.get_rank() == frozen:
        pid = os.getpid()

        def freeze():
            subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -CONT {pid}"])  # started first: the resume is certain
            os.kill(pid, signal.SIGSTOP)

        threading.Thread(target=freeze, daemon=True).start()
    dist.new_group([0, 1])


def test_a_rank_that_finishes_first_leaves_its_groups_to_a_slower_peer(pool2):
    """The groups of a task were destroyed as soon as a rank had finished it: a peer still accepting the connection
    of a new_group then failed with "Gloo connectFullMesh failed ... Connection closed by peer" (a third of these
    runs, before). Both ranks take the stopped part in turn, since gloo picks which side connects by port."""
    for i in range(8):
        assert pool2.run(frozen_in_new_group, i % 2, timeout=60) == [None, None], i


def make_device_mesh() -> int:
    """A DeviceMesh over both ranks, as accelerate's ParallelismConfig and FSDP2 tests build one: its groups."""
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    return len(distributed_c10d._world.pg_map) - 1


def groups_left() -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map) - 1  # (the world group excepted)


def test_a_device_mesh_leaves_no_group_to_the_next_task(pool2):
    """A DeviceMesh's groups were kept for the rest of the session: 154 a pool4 worker by the end of the suite,
    whose idle gloo threads took 0.15 of a core per worker and slowed every later test."""
    assert all(n >= 1 for n in pool2.run(make_device_mesh)), "the mesh made no groups"
    assert pool2.run(groups_left) == [0, 0]


_HELD = []  # (in each worker: a mesh kept across tasks, as a library's cache keeps one)


def make_held_device_mesh() -> int:
    from torch.distributed.device_mesh import init_device_mesh

    _HELD.append(init_device_mesh("cpu", (2, 1), mesh_dim_names=("cp", "dp")))
    return groups_left()


def reduce_over_held_mesh() -> float:
    import torch

    t = torch.ones(1)
    dist.all_reduce(t, group=_HELD[0].get_group("cp"))
    return float(t)


def test_a_mesh_a_cache_keeps_keeps_its_groups_while_later_meshes_go():
    """The groups of a mesh still alive stay (the release before the next task froze it, so later releases, which
    walk only what is newer, must not mistake it for garbage), and a mesh made and dropped after it leaves nothing.
    (A pool of its own: a kept mesh's groups stay for the workers' life.)"""
    pool = DistPool(2)
    try:
        held = pool.run(make_held_device_mesh)
        assert pool.run(groups_left) == held and held[0] >= 1, held
        assert pool.run(make_device_mesh) and pool.run(groups_left) == held
        assert pool.run(reduce_over_held_mesh) == [2.0, 2.0]
    finally:
        pool.close()


def wait_then_rank(seconds: float) -> int:
    time.sleep(seconds)
    return dist.get_rank()


def wait_for_file(path: str) -> bool:
    """True once `path` exists (another pool's task writes it), False after 60 s without it."""
    for _ in range(600):
        if os.path.exists(path):
            return True
        time.sleep(0.1)
    return False


def write_file(path: str) -> int:
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write("here")
    return dist.get_rank()


def fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")


def test_tasks_of_two_pools_run_side_by_side(pool1, pool2, tmp_path):
    """run_side_by_side: the tasks overlap (pool1's task waits for a file that pool2's task, started after it,
    writes: one after the other, it would wait in vain), their results come back by pool and rank, and a task that
    fails still leaves both pools free for the next."""

    marker = str(tmp_path / "written")
    assert run_side_by_side((pool1, wait_for_file, marker), (pool2, write_file, marker)) == [[True], [0, 1]]
    with pytest.raises(RuntimeError, match="rank 1 fails"):
        run_side_by_side((pool2, fail_on_rank_one), (pool1, wait_then_rank, 0.1))
    assert pool2.run(wait_then_rank, 0.0) == [0, 1] and pool1.run(wait_then_rank, 0.0) == [0]
    task = pool1.submit(wait_then_rank, 0.0)
    with pytest.raises(RuntimeError, match="still running wait_then_rank"):
        pool1.submit(wait_then_rank, 0.0)
    assert task.result() == [0]


def test_background_work_runs_one_piece_after_another():
    """OneAfterAnother (conftest.py's STARTs): the second piece starts once the first has ended, each result is taken
    by name, and a piece that fails raises where its result is taken."""
    log = []

    class Handle:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail
            log.append(("start", name))

        def result(self, timeout):
            time.sleep(0.2)
            log.append(("end", self.name))
            if self.fail:
                raise ValueError(f"{self.name} failed")
            return self.name.upper()

        def close(self):
            log.append(("close", self.name))

    work = OneAfterAnother({"a": lambda: Handle("a"), "b": lambda: Handle("b", fail=True)})
    assert "a" in work and "c" not in work
    assert work.result("a", timeout=10) == "A"
    with pytest.raises(ValueError, match="b failed"):
        work.result("b", timeout=10)
    assert log == [("start", "a"), ("end", "a"), ("close", "a"), ("start", "b"), ("end", "b"), ("close", "b")]
    work.close()
