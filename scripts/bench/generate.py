"""Generation under CP (docs/performance.md#generation): prefill time and per-rank peak memory, decode speed and
per-rank KV cache, at cp 1 / 2 / 4, each a fresh run of scripts/examples/generate_long.py (a tiny random Llama
unless --model).

    python scripts/bench/generate.py --lengths 16384 32768 --cps 1 2 4 --width 256 --layers 4

On CPU the peak memory is each process's peak RSS (weights and the runtime included); timings here are noisy:
compare the ratios of one run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "generate_long.py"


def run(cp: int, length: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        launch = [sys.executable] if cp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node", str(cp)]
        cmd = [*launch, str(SCRIPT), "--prompt-tokens", str(length), "--max-new-tokens", str(args.new_tokens),
               "--width", str(args.width), "--layers", str(args.layers), "--json", str(out)]
        if args.model:
            cmd += ["--model", args.model]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"bench/generate.py: cp {cp}, {length} tokens failed:\n{r.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", help="a checkpoint directory instead of the tiny random Llama")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print("| prompt tokens | cp | first token (s) | x cp 1 | peak MB per rank | x cp 1 | KV cache MB per rank | "
          "decode tokens/s | same tokens as cp 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        base = None
        for cp in args.cps:
            r = {**run(cp, length, args), "cp": cp}
            rows.append(r)
            base = base or r
            peak, kv = max(r["peak_mem_mb_per_rank"]), max(r["kv_cache_mb_per_rank"])
            print(f"| {length} | {cp} | {r['time_to_first_token_s']:.2f} | "
                  f"{r['time_to_first_token_s'] / base['time_to_first_token_s']:.2f} | {peak:.0f} | "
                  f"{peak / max(base['peak_mem_mb_per_rank']):.2f} | {kv:.1f} | {r['decode_tokens_per_s']:.1f} | "
                  f"{r['tokens'] == base['tokens']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
