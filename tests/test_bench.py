"""Smoke test of scripts/bench.py (the real benchmark is run by hand; see README "Performance")."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_runs_and_losses_agree(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert {row["cp"] for row in rows} == {1, 2}
    cp1, cp2 = (next(row for row in rows if row["cp"] == c) for c in (1, 2))
    assert abs(cp1["loss"] - cp2["loss"]) <= 1e-5 * cp1["loss"]  # same model, same data: same loss
    assert cp2["peak_mem_mb"] > 0 and (tmp_path / "memory_vs_length.png").exists()
