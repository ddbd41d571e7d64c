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
    env = {"OMP_NUM_THREADS": "1", **env}
    started = {}
    for name, args in commands.items():
        out, err = open(tmp / f"{name}.out", "w"), open(tmp / f"{name}.err", "w")
        proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=err, text=True, env={**os.environ, **env})
        started[name] = (proc, args, out, err)
    done = {}
    for name, (proc, args, out, err) in started.items():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            out.close()
            err.close()
        done[name] = subprocess.CompletedProcess(args, proc.returncode, (tmp / f"{name}.out").read_text(),
                                                 (tmp / f"{name}.err").read_text())
    return done


def script_error(script: str, argv: list, monkeypatch) -> str:
    """The one-line error that scripts/`script`.py exits with on `argv`, run in this process: the message of its
    SystemExit, which Python prints as a process's last line (exit status 1). For the checks a script makes before it
    builds anything, this is its command-line behaviour without a process start (seconds of imports each). Any other
    exception (a raw error from a library) escapes and fails the test, as its traceback would have shown."""
    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    module = __import__(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message.strip(), message
    return message
