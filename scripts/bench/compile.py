"""torch.compile on a patched model: the LoRA step time (forward + backward) of the benchmark's Llama at cp 2, eager
against compiled (inductor; accelerate's regional compilation and the whole model), measured in one run.

    python scripts/bench/compile.py                      # L = 4096 and 8192, cp 2, ring
    python scripts/bench/compile.py --lengths 2048 --repeats 3

Each measurement is its own torchrun of scripts/bench/step.py (one thread per process); the compiled runs take two
untimed warm-up steps (the compile). Prints a table with each row's time over eager's and its loss (the same in
every row of a length: compiling changes no result beyond float rounding).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench

MODES = ("none", "regional", "whole")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--strategy", default="ring")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/bench/compile.json")
    args = ap.parse_args()
    rows = []
    for L in args.lengths:
        eager = None
        for mode in MODES:
            r = bench.measure("model", L, args.cp, args.strategy, 1, args.repeats, compile=mode)
            if "error" in r:
                print(f"L={L} {mode}: {r['error']}")
                continue
            eager = r if mode == "none" else eager
            r["x_eager"] = r["time_s"] / eager["time_s"] if eager else None
            rows.append(r)
            ratio = f"{r['x_eager']:.2f}" if r["x_eager"] else "-"
            print(f"L={L:6d} cp={args.cp} {mode:8s} step {r['time_s']:.3f} s (cpu {r['cpu_s']:.3f} s)  "
                  f"x eager {ratio}  loss {r['loss']:.6f}  peak {r['peak_mem_mb']:.0f} MB", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
