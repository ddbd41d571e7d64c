import os
import sys
from pathlib import Path

import pytest

# one compute thread per process, this one and every process the tests start (scripts, their workers): the tests
# run several processes at once on few cores, and processes of two threads each then spend much of their time
# waiting for each other's threads (a third of the suite's CPU time was system time before this)
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hfcp.testing.dist_pool import DistPool  # noqa: E402

# what a quick loop (pytest -m "not sweep and not e2e") leaves out: the sweeps over every family transformers ships,
# and the end-to-end runs of the job, the scripts and the hfcp command in processes of their own
SWEEP_FIXTURES = {"sweep"}  # test_families.py, test_audio.py, test_vlm_sweep.py: one pool run over every type
SWEEP_FILES = {"test_families.py", "test_vlm_sweep.py"}
E2E_FILES = {"test_scripts.py", "test_finetune.py", "test_full_finetune.py", "test_bench.py", "test_pipeline_job.py",
             "test_real_model.py", "test_verify.py", "test_packaging.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in SWEEP_FILES or SWEEP_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.sweep)
        if name in E2E_FILES:
            item.add_marker(pytest.mark.e2e)


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
