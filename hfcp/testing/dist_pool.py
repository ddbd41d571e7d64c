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
    """Destroy the process groups a task left: gloo runs 3 threads per group, and the hundreds that the tests'
    hfcp.patch calls would otherwise leave in a worker slow every collective that follows (10x measured here). Idle,
    they still poll: a DeviceMesh's groups, once all kept (libraries cache meshes across calls: transformers'
    tensor-parallel mesh), came to 154 per pool4 worker over the suite (470 threads, 0.15 of a core each while
    idle), and the end-to-end runs that start processes of their own took 172 s instead of 95 s. So a DeviceMesh's
    groups go too once no DeviceMesh that is still alive holds them."""
    import gc

    from torch.distributed import distributed_c10d

    world = dist.group.WORLD
    created = [g for g in list(distributed_c10d._world.pg_map) if g is not world and not _of_a_mesh(g)]
    # the groups of a mesh made since the last look (those kept then are held by a cache: looked at once)
    meshes = [g for g in list(distributed_c10d._world.pg_map) if g is not world and _of_a_mesh(g)
              and id(g) not in _KEPT_MESH_GROUPS]
    if meshes:
        # only what is newer than the last release's freeze is walked: a mesh made since, the only kind that can hold
        # these groups, is among it, and so is a dead one in a cycle, freed here before the live ones are looked for
        # (with the whole heap unfrozen and walked twice, a pool4 task that made a mesh took 1.2 s more: test_mesh
        # 46 s, now 18 s)
        gc.collect()
        held = _groups_of_live_meshes()
        created += [g for g in meshes if id(g) not in held]
        _KEPT_MESH_GROUPS.update(id(g) for g in meshes if id(g) in held)
    for g in created:
        dist.destroy_process_group(g)
    if created or meshes:
        gc.collect()  # the models of the task hold the groups: their threads stop when the groups are freed
        # what survived is live (imports, caches): later collections need not walk it again (0.16 s each, on every
        # task that patched, before this)
        gc.freeze()


_KEPT_MESH_GROUPS: set[int] = set()  # (in each worker process: the mesh groups a live DeviceMesh held when looked at)


def _of_a_mesh(group) -> bool:
    return group.group_desc.startswith("mesh")


def _groups_of_live_meshes() -> set[int]:
    """id() of every process group that a DeviceMesh still alive in this process holds."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    held = set()
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            try:
                held |= {id(g) for g in obj.get_all_groups()}
            except RuntimeError:  # a mesh whose groups are gone already
                pass
    return held


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


PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "accelerate", "hfcp", "hfcp.integrations"]


class DistPool:
    """`run(fn, *args)` calls fn(*args) on every rank and returns the list of results in rank order."""

    def __init__(self, world: int, daemon: bool = True):
        """daemon=False lets the workers start processes of their own (DataLoader workers); close() then matters."""
        # forkserver: the server imports the heavy libraries once (PRELOAD), and each worker is a fork of it that
        # starts in milliseconds, where a spawned worker spent 6 CPU-seconds on its imports (about 15 workers in the
        # suite). The server imports only, starts no thread and touches no device: its forks are clean.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
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
        self._running = None

    def run(self, fn, *args, timeout: float = 300.0, expect=None):
        """fn(*args) on every rank: the results in rank order. `expect`: the ranks whose results to wait for (default
        all; a test that kills a rank waits for the rest, then closes the pool: a rank not waited for may still be in
        the task when the next one starts)."""
        return self.submit(fn, *args).result(timeout=timeout, expect=expect)

    def submit(self, fn, *args) -> "Task":
        """Start fn(*args) on every rank and return at once: the Task's result() waits as run() does. One task at a
        time per pool; tasks of different pools run side by side (run_side_by_side)."""
        if self._running is not None:
            raise RuntimeError(f"this pool is still running {self._running.fn.__name__}: take its result() first")
        for q in self.tasks:
            q.put((fn, args))
        self._running = Task(self, fn)
        return self._running

    def _collect(self, fn, timeout: float, expect) -> list:
        out = [None] * self.world
        errors = []
        try:
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
        finally:
            self._running = None
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


class Task:
    """A task started on every rank of a DistPool (DistPool.submit)."""

    def __init__(self, pool: DistPool, fn):
        self.pool, self.fn = pool, fn

    def result(self, timeout: float = 300.0, expect=None) -> list:
        """The results in rank order, once every rank (or those of `expect`) has returned; a rank's exception is a
        RuntimeError with its traceback, and no result within `timeout` seconds kills the pool (TimeoutError)."""
        return self.pool._collect(self.fn, timeout, expect)


def run_side_by_side(*calls, timeout: float = 300.0) -> list:
    """[pool.run(fn, *args) for (pool, fn, *args) in calls], the calls running at the same time on their pools (a
    one-process reference beside the context-parallel run it is compared with: the cores the one leaves idle, the
    other uses)."""
    tasks = [pool.submit(fn, *args) for pool, fn, *args in calls]
    results, failed = [], None
    for task in tasks:  # every task's result taken (its pool free again), the first failure raised after
        try:
            results.append(task.result(timeout=timeout))
        except Exception as e:  # noqa: BLE001 - raised below, once the other pools are free
            failed = failed or e
    if failed is not None:
        raise failed
    return results


def map_in_processes(fn, items: list, processes: int = 2, timeout: float = 600.0) -> list:
    """[fn(*item) for item in items], computed in `processes` processes without a process group (forks of the
    preloaded forkserver, as a DistPool's workers are): single-process work of a test module (hfcp's dry runs)
    spread over the cores that a test run in this process alone would leave idle. Results in the items' order."""
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with ProcessPoolExecutor(processes, mp_context=ctx) as executor:
        futures = [executor.submit(fn, *item) for item in items]
        return [f.result(timeout=timeout) for f in futures]


class InPool:
    """fn(*args) started on every rank of a DistPool of its own (`ranks` processes), its results (in rank order)
    taken later (result) or never (close)."""

    def __init__(self, ranks: int, fn, *args):
        self.pool = DistPool(ranks, daemon=False)
        self.task = self.pool.submit(fn, *args)

    def result(self, timeout: float = 300.0) -> list:
        return self.task.result(timeout=timeout)

    def close(self) -> None:
        self.pool.close()


class OneAfterAnother:
    """Work started now and run in the background, one piece after another ({name: a function that starts it and
    returns a handle with result(timeout) and close(), as InPool does}): two pieces never take the cores at once.
    result(name) waits for a piece's results (its exception raised); close() stops what is still running."""

    def __init__(self, starts: dict, timeout: float = 900.0):
        import threading

        self.results, self.done = {}, {name: threading.Event() for name in starts}
        self._handle, self._closed = None, False
        self._thread = threading.Thread(target=self._run, args=(dict(starts), timeout), daemon=True)
        self._thread.start()

    def _run(self, starts: dict, timeout: float) -> None:
        for name, start in starts.items():
            if self._closed:
                break
            try:
                self._handle = start()
                self.results[name] = (True, self._handle.result(timeout))
            except BaseException as e:  # noqa: BLE001 - raised where the result is taken
                self.results[name] = (False, e)
            finally:
                if self._handle is not None:
                    self._handle.close()
                    self._handle = None
                self.done[name].set()

    def __contains__(self, name) -> bool:
        return name in self.done

    def result(self, name: str, timeout: float = 900.0):
        if not self.done[name].wait(timeout):
            raise TimeoutError(f"the background work {name!r} did not finish within {timeout}s")
        ok, value = self.results[name]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._closed = True
        handle = self._handle
        if handle is not None:
            handle.close()
