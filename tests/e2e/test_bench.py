"""Smoke test of scripts/bench/bench.py (the real benchmark is run by hand; see docs/performance.md)."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """bench/bench.py --quick's process and output directory, and the full fine-tune measurements of one and two ranks
    (scripts/bench/full.py through bench.measure_full), all three started at the same time (each is a chain of
    process starts; side by side they share the cores instead of following each other)."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench

    out = tmp_path_factory.mktemp("bench")
    with ThreadPoolExecutor(3) as threads:
        quick = threads.submit(subprocess.run, [sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"), "--quick",
                                                "--out", str(out)], capture_output=True, text=True, timeout=300)
        one, two = (threads.submit(bench.measure_full, 128, 512, world) for world in (1, 2))
        return {"quick": (quick.result(), out), "full": (one.result(), two.result())}


def test_bench_quick_runs_and_losses_agree(runs):
    r, tmp_path = runs["quick"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert {row["cp"] for row in rows} == {1, 2}
    cp1, cp2 = (next(row for row in rows if row["cp"] == c) for c in (1, 2))
    assert abs(cp1["loss"] - cp2["loss"]) <= 1e-5 * cp1["loss"]  # same model, same data: same loss
    assert cp2["peak_mem_mb"] > 0 and (tmp_path / "memory_vs_length.png").exists()


def test_full_finetune_measurement_shards_the_state(runs):
    """scripts/bench/full.py (bench/bench.py --level full): parameters, gradients and AdamW moments per rank halve over
    two ranks, and the measured peak covers them."""
    one, two = runs["full"]
    assert one and two, "a measurement failed (see scripts/bench/full.py)"
    assert abs(two["state_mb"] - one["state_mb"] / 2) <= 0.01 * one["state_mb"], (one, two)
    assert one["peak_mem_mb"] > one["state_mb"] and two["peak_mem_mb"] > two["state_mb"], (one, two)


def test_frontier_search_finds_the_longest_fitting_length():
    """The search itself, against a made-up memory model: peak = 100 MB / world + L / 8 MB per rank."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import argparse

    import full as bench_full

    def run(hidden, L, world):
        return {"peak_mem_mb": 100 / world + L / 8, "state_mb": 100 / world, "params_m": 1.0}

    args = argparse.Namespace(widths=[64], cps=[1, 2, 4], mem_cap_mb=400, resolution=128)
    rows = bench_full.frontier(args, run)
    got = {r["world"]: r["longest_seq_len"] for r in rows}
    for world, L in got.items():  # within the resolution of the exact answer 8 * (400 - 100 / world)
        exact = 8 * (400 - 100 / world)
        assert exact - 128 <= L <= exact, (world, L, exact)
    assert "| 64 (1.0M) | 100, 50, 25 |" in bench_full.frontier_table(rows, 400)
