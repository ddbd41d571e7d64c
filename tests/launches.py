"""Script runs of the end-to-end tests, started at the same time: their processes' start-up (imports) and waits
overlap on the two cores, instead of following each other."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# accelerate launch on 2 CPU processes; --main_process_port 0: a free port each, so that launches run side by side
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


def run_together(commands: dict, tmp: Path, timeout: float = 600, **env) -> dict:
    """{name: CompletedProcess} of each command (an argument list) run from the repository root, all at once, with
    `env` added to the environment. Each process computes on one thread (OMP_NUM_THREADS=1, unless `env` says
    otherwise): several processes of two threads each on two cores spend their time waiting for each other's
    threads. Output goes to files in `tmp`: a full pipe would block a process while another is waited for."""
    started = start_together(commands, tmp, **env)
    return {name: finish(run, timeout) for name, run in started.items()}


def start_together(commands: dict, tmp: Path, **env) -> dict:
    """{name: the started run} of each command, as run_together starts them; finish(run) waits for one."""
    env = {"OMP_NUM_THREADS": "1", **env}
    started = {}
    for name, args in commands.items():
        out, err = open(tmp / f"{name}.out", "w"), open(tmp / f"{name}.err", "w")
        proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=err, text=True, env={**os.environ, **env})
        started[name] = (proc, args, out, err)
    return started


def finish(run: tuple, timeout: float = 600) -> subprocess.CompletedProcess:
    """The CompletedProcess of a run that start_together started, once it ends (killed after `timeout` seconds)."""
    proc, args, out, err = run
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        out.close()
        err.close()
    return subprocess.CompletedProcess(args, proc.returncode, Path(out.name).read_text(), Path(err.name).read_text())


def script_error(script: str, argv: list, monkeypatch) -> str:
    """The one-line error that scripts/`script`.py ("finetune_lora", "bench/reach") exits with on `argv`, run in this
    process (its folder first on sys.path, as `python scripts/...` runs it): the message of its
    SystemExit, which Python prints as a process's last line (exit status 1). For the checks a script makes before it
    builds anything, this is its command-line behaviour without a process start (seconds of imports each). Any other
    exception (a raw error from a library) escapes and fails the test, as its traceback would have shown."""
    import pytest

    path = ROOT / "scripts" / f"{script}.py"
    monkeypatch.syspath_prepend(str(path.parent))
    module = __import__(path.stem)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message.strip(), message
    return message


def in_one_process(scripts: dict, tmp: Path, tag: str) -> list:
    """The arguments (after the interpreter or launcher) of one process that runs `scripts` ({name: [script path,
    *its arguments]}) one after the other, as tests/scripts_in_one_process.py does: one process start for them all
    (seconds of imports each). Their results: scripts_results(scripts, tmp, <the process's CompletedProcess>)."""
    import json

    spec = tmp / f"{tag}.json"
    spec.write_text(json.dumps(scripts))
    return [str(ROOT / "tests" / "scripts_in_one_process.py"), str(spec), str(tmp)]


def scripts_results(scripts: dict, tmp: Path, launch: subprocess.CompletedProcess) -> dict:
    """{name: CompletedProcess} of each script that in_one_process ran: its output, every rank's (rank 0 first), and
    its exit status (the worst rank's; the launch's own where a rank did not finish it, its output then added)."""
    done = {}
    for name, argv in scripts.items():
        ranks = sorted(tmp.glob(f"{name}.rank*.out"), key=lambda p: int(p.name.split(".rank")[1].split(".")[0]))
        rcs = [p.with_suffix(".rc") for p in ranks]
        finished = bool(ranks) and all(rc.is_file() for rc in rcs)
        code = max(int(rc.read_text()) for rc in rcs) if finished else (launch.returncode or 1)
        stdout = "".join(p.read_text() for p in ranks)
        stderr = "".join(p.with_suffix(".err").read_text() for p in ranks if p.with_suffix(".err").is_file())
        done[name] = subprocess.CompletedProcess(argv, code, stdout, stderr + ("" if finished else launch.stderr))
    return done
