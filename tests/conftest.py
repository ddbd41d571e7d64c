import os
import sys
from pathlib import Path

import pytest

# one compute thread per process, this one and every process the tests start (scripts, their workers): the tests
# run several processes at once on few cores, and processes of two threads each then spend much of their time
# waiting for each other's threads (a third of the suite's CPU time was system time before this)
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_pool import DistPool  # noqa: E402


# non-daemon workers may start processes of their own (DataLoader workers); the teardown closes them
@pytest.fixture(scope="session")
def pool2():
    pool = DistPool(2, daemon=False)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = DistPool(4, daemon=False)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool1():
    """One process with a (world 1) process group: the single-device reference of multi-process runs."""
    pool = DistPool(1, daemon=False)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def job_runs(tmp_path_factory):
    """(directory, {name: CompletedProcess}) of the fine-tuning job's runs that test_finetune.py and
    test_full_finetune.py read, started together once (test_finetune.run_the_jobs)."""
    from test_finetune import run_the_jobs

    d = tmp_path_factory.mktemp("ft")
    return d, run_the_jobs(d)
