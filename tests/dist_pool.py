"""A pool of gloo worker processes shared by many test cases (process-group start-up is paid once)."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release_groups(dist) -> None:
    """Destroy the process groups a task created with new_group: gloo runs 3 threads per group, and the hundreds that
    the tests' hfcp.patch calls would otherwise leave in a worker slow every collective that follows (10x measured
    here). A DeviceMesh's groups stay: libraries cache meshes across calls (transformers' tensor-parallel mesh)."""
    import gc

    from torch.distributed import distributed_c10d

    created = [g for g in list(distributed_c10d._world.pg_map)
               if g is not dist.group.WORLD and not g.group_desc.startswith("mesh")]
    for g in created:
        dist.destroy_process_group(g)
    if created:
        gc.collect()  # the models of the task hold the groups: their threads stop when the groups are freed
        # what survived is live (imports, caches): later collections need not walk it again (0.16 s each, on every
        # task that patched, before this)
        gc.freeze()


def _worker(rank, world, port, tasks, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while True:
        item = tasks.get()
        # the previous task's groups go only now: the parent sends a task once every rank has returned the previous
        # one, so no peer is still inside a new_group of it. Destroyed at once, a rank whose new_group had returned
        # (gloo's connecting side returns once it has written to the peer) closed the connection under a peer that
        # had not yet accepted it, on a loaded machine: "Gloo connectFullMesh failed ... Connection closed by peer"
        _release_groups(dist)
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """`run(fn, *args)` calls fn(*args) on every rank and returns the list of results in rank order."""

    def __init__(self, world: int, daemon: bool = True):
        """daemon=False lets the workers start processes of their own (DataLoader workers); close() then matters."""
        ctx = mp.get_context("spawn")
        self.world = world
        port = _free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results), daemon=daemon)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 300.0, expect=None):
        """`expect`: the ranks whose results to wait for (default all; a test that kills a rank waits for the rest, then
        closes the pool: a rank not waited for may still be in the task when the next one starts)."""
        for q in self.tasks:
            q.put((fn, args))
        out = [None] * self.world
        errors = []
        for _ in range(self.world if expect is None else len(expect)):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(f"{fn.__name__} did not finish on every rank within {timeout}s (hang?)")
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

    def close(self, kill: bool = False):
        for p, q in zip(self.procs, self.tasks):
            if kill:
                p.kill()
            else:
                q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
