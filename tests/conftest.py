import os
import sys
from pathlib import Path

import pytest

# one compute thread per process, this one and every process the tests start (scripts, their workers): the tests
# run several processes at once on few cores, and processes of two threads each then spend much of their time
# waiting for each other's threads (a third of the suite's CPU time was system time before this)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# the tests' own helpers (launches.py; each folder's workers_*.py, which other folders' tests and the pool's workers
# import by module name): every folder of tests/ on the path, whichever tests run
TESTS = Path(__file__).resolve().parent
FOLDERS = sorted(str(d) for d in TESTS.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))
sys.path[:0] = [str(TESTS), *FOLDERS]
# the maintainer tools the tests hold the repository to (support_matrix regenerates what the sweeps check,
# check_tp_cp's functions are the TP x CP tests')
sys.path.insert(0, str(TESTS.parent / "scripts" / "tools"))

from hfcp.testing.dist_pool import DistPool, OneAfterAnother  # noqa: E402

# what a quick loop (pytest -m "not sweep and not e2e") leaves out: the sweeps over every family transformers ships
# and over configurations measured (tests/sweeps/, and the tests that read a sweep through the `sweep` fixture), and
# the end-to-end runs of the job, the scripts and the hfcp command in processes of their own (tests/e2e/, and
# tests/commands/test_verify.py, marked in its file)
SWEEP_FIXTURES = {"sweep"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = item.path.parent.name
        if folder == "sweeps" or SWEEP_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.sweep)
        if folder == "e2e":
            item.add_marker(pytest.mark.e2e)


# Work that a module would otherwise do in a fixture of its own, started as the run starts in processes of its
# own when the module's tests are selected (the module's START: a function returning an object with result() and
# close()): it runs beside the tests before it, on the cores they leave idle (a sixth of two cores outside the
# end-to-end runs and the measured sweeps), and the module's fixture takes it with `started(module)`. The modules'
# STARTs run one after another (hfcp.testing.dist_pool.OneAfterAnother): the family sweep (about 45 s of two cores),
# then the VLM sweep. (test_plan's dry runs did not gain: already on both cores, started with the run they only made
# the first tests wait.)
_background = None  # the selected modules' STARTs, by module name


def _module_name(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def pytest_collection_finish(session):
    global _background
    modules = {_module_name(item.module): item.module for item in session.items
               if item.module is not None and hasattr(item.module, "START")}
    if modules:
        _background = OneAfterAnother({name: module.START for name, module in modules.items()})


def pytest_sessionfinish(session):
    if _background is not None:
        _background.close()


def started(module, timeout: float = 900.0):
    """The result of `module`'s START: the one started with the run, or (the module not selected then) now."""
    name = _module_name(module)
    if _background is not None and name in _background:
        return _background.result(name, timeout)
    handle = module.START()
    try:
        return handle.result(timeout)
    finally:
        handle.close()


@pytest.fixture(scope="module")
def sweep(request, pool2):
    """The results of the module's sweep (its SWEEP: a sweep of hfcp.testing.sweeps) at cp 2, run once per module
    (started with the run where the module's START says so); both ranks must agree."""
    if hasattr(request.module, "START"):  # (a pool of its own)
        results = started(request.module)
    else:
        results = pool2.run(request.module.SWEEP, timeout=900)
    assert results[0] == results[1], "the ranks disagree"
    return results[0]


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
