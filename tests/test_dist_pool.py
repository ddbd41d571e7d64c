"""The test pool itself (tests/dist_pool.py): a task's process groups outlive every rank's part of the task."""
import os
import signal
import subprocess
import threading

import torch.distributed as dist


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
