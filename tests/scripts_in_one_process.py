"""Runs several scripts one after the other in this process (and, under a launcher, in each of its ranks), each as
`python SCRIPT ARGS...` would run it (run as __main__, its folder first on sys.path, sys.argv its own): one process
start, its imports, serves them all. Each script's output goes to its own files, per rank:
`OUT/NAME.rank{R}.out|err|rc` (rc: its exit status, 1 and the traceback in .err for an exception).

    python tests/scripts_in_one_process.py SPEC.json OUT     # SPEC: {"name": ["scripts/x.py", "--arg", ...], ...}

Used through launches.in_one_process; a later script still runs after one failed (a rank whose script failed may
leave its peer waiting in a collective: the launch then runs into its timeout, and every script reads as failed)."""
from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def run_script(argv: list[str]) -> int:
    """Exit status of argv[0] run as __main__ with sys.argv = argv."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)
    try:
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as the process would: a traceback, exit status 1
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main(spec: str, out: str) -> int:
    rank = os.environ.get("RANK", "0")
    failed = 0
    for name, argv in json.loads(Path(spec).read_text()).items():
        base = Path(out) / f"{name}.rank{rank}"
        with open(f"{base}.out", "w") as o, open(f"{base}.err", "w") as e:
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                rc = run_script(argv)
        Path(f"{base}.rc").write_text(str(rc))
        failed = failed or rc
    return failed


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
