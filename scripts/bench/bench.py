"""Benchmark suite: memory and time of hfcp against one process, per strategy and sequence length.

    python scripts/bench/bench.py                       # model level, L = 2k..16k, cp 1/2/4, all strategies
    python scripts/bench/bench.py --quick               # a smoke run (seconds)
    python scripts/bench/bench.py --level attention --lengths 8192 16384 --no-comm
    python scripts/bench/bench.py --arch qwen3_next --lengths 4096 8192 --strategies ring   # a gated delta net hybrid
    python scripts/bench/bench.py --level full --mem-cap-mb 700 --widths 256 512 768   # full fine-tune frontier

--level full: the longest sequence whose full fine-tune step (FSDP2 over all ranks x CP, AdamW) fits a per-rank
memory cap, per model width and world size (scripts/bench/full.py).

cp = 1 is the unpatched model in one process with as many threads as the cp run has processes; cp > 1
runs under torchrun with one thread per process. Each measurement is its own process (scripts/bench/step.py).
Writes runs/bench/bench.json, memory/time PNGs, and prints a table with ratios to cp = 1. Each result also
records cpu_s, the step's process CPU time (largest rank): steadier than wall time on a shared machine, for
A/B comparisons of the same configuration (it excludes time spent waiting on peers).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import full as bench_full

HERE = Path(__file__).resolve().parent


def measure(level, seq_len, cp, strategy, threads, repeats, no_comm=False, timeout=1800, chunked_cp1=False,
            loss_chunk=1024, arch="llama", compile="none"):
    cmd = [str(HERE / "step.py"), "--level", level, "--arch", arch, "--seq-len", str(seq_len), "--cp", str(cp),
           "--strategy", strategy, "--threads", str(threads), "--repeats", str(repeats),
           "--loss-chunk", str(loss_chunk), "--compile", compile]
    if chunked_cp1:
        cmd.append("--chunked-loss")
    if no_comm:
        cmd.append("--no-comm")
    if cp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), *cmd]
    else:
        cmd = [sys.executable, *cmd]
    for attempt in range(2):  # one retry: a torchrun start-up can fail when the machine is busy
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode == 0 and lines:
            break
        Path("runs").mkdir(exist_ok=True)
        Path("runs/bench_failure.log").write_text(r.stdout + "\n" + r.stderr)
    if "not both divisible by cp_size" in r.stderr or "must be at least the sequence parallel" in r.stderr:
        # a documented limit of hfcp's and DeepSpeed's Ulysses, not a failure
        return {"level": level, "seq_len": seq_len, "cp": cp, "strategy": strategy, "no_comm": no_comm,
                "skipped": "KV heads do not split over cp"}
    if r.returncode != 0 or not lines:
        return {"level": level, "seq_len": seq_len, "cp": cp, "strategy": strategy, "no_comm": no_comm,
                "error": next((ln for ln in r.stderr.splitlines() if "Error" in ln), "?")[:300]}
    return json.loads(lines[-1][len("RESULT "):])


def measure_full(hidden: int, seq_len: int, world: int, timeout=1800) -> dict | None:
    """One full fine-tune step measurement (scripts/bench/full.py); None when it failed twice (the output of the
    last try is in runs/bench_failure.log)."""
    cmd = [str(HERE / "full.py"), "--hidden", str(hidden), "--seq-len", str(seq_len)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *cmd] \
        if world > 1 else [sys.executable, *cmd]
    for attempt in range(2):  # one retry: a torchrun start-up can fail when the machine is busy
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode == 0 and lines:
            return json.loads(lines[-1][len("RESULT "):])
    Path("runs").mkdir(exist_ok=True)
    Path("runs/bench_failure.log").write_text(r.stdout + "\n" + r.stderr)
    return None


def sweep(args):
    """One pass over every (L, cp, strategy) configuration."""
    results = []
    for L in args.lengths:
        for cp in args.cps:
            strategies = ["none"] if cp == 1 else args.strategies
            for s in strategies:
                threads = max(c for c in args.cps) if cp == 1 and args.match_threads else 1
                threads = min(threads, args.max_threads)
                results.append(measure(args.level, L, cp, s, threads, args.repeats, chunked_cp1=args.chunked_cp1,
                                       loss_chunk=args.loss_chunk, arch=args.arch))
                print(fmt(results[-1]), flush=True)
                if args.no_comm and cp > 1 and s == "ring":
                    results.append(measure(args.level, L, cp, s, 1, args.repeats, no_comm=True))
                    print(fmt(results[-1]), flush=True)
    return results


def run(args):
    """--rounds passes, interleaved so that a slow spell of a shared machine hits every configuration alike;
    per configuration the fastest time and the largest memory are kept."""
    rounds = [sweep(args) for _ in range(args.rounds)]
    results = []
    for runs in zip(*rounds):
        ok = [r for r in runs if "error" not in r and "skipped" not in r]
        if len(ok) < len(runs):
            results.append(next(r for r in runs if "error" in r or "skipped" in r))
            continue
        best = dict(min(ok, key=lambda r: r["time_s"]))
        best["peak_mem_mb"] = max(r["peak_mem_mb"] for r in ok)
        best["rounds"] = len(ok)
        results.append(best)
    return results


def longest_under_cap(args):
    """Per cp, the longest L (doubling from 1024, then bisecting to --resolution tokens) whose step's peak memory
    growth per rank stays under --mem-cap-mb."""
    found = {}
    for cp in args.cps:
        strategy = "none" if cp == 1 else args.strategies[0]
        threads = min(max(args.cps), args.max_threads) if cp == 1 else 1

        def fits(L):
            r = measure("model", L, cp, strategy, threads, 1, chunked_cp1=args.chunked_cp1, loss_chunk=args.loss_chunk)
            return "error" not in r and r["peak_mem_mb"] <= args.mem_cap_mb

        lo, hi = 0, 1024
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > args.resolution:
            mid = (lo + hi) // 2 // 128 * 128
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        found[cp] = lo
        print(f"cp={cp} {strategy}: longest sequence under {args.mem_cap_mb} MB per rank: {lo}", flush=True)
    base = found.get(1) or 1
    print("| cp | longest L | x cp=1 |\n|---|---|---|\n"
          + "\n".join(f"| {cp} | {L} | {L / base:.2f} |" for cp, L in found.items()))
    return found


def fmt(r):
    if "skipped" in r:
        return f"L={r['seq_len']:>6} cp={r['cp']} {r['strategy']:<9} skipped: {r['skipped']}"
    if "error" in r:
        return f"L={r['seq_len']:>6} cp={r['cp']} {r['strategy']:<9} ERROR {r['error']}"
    tag = " (no comm)" if r.get("no_comm") else ""
    return (f"L={r['seq_len']:>6} cp={r['cp']} {r['strategy']:<9}{tag:<10} time {r['time_s']:8.3f} s  "
            f"cpu {r.get('cpu_s', 0.0):8.3f} s  peak {r['peak_mem_mb']:9.1f} MB  loss {r['loss']:.6f}")


def table(results):
    base = {r["seq_len"]: r for r in results if r["cp"] == 1 and "error" not in r and "skipped" not in r}
    rows = ["| L | cp | strategy | time s | x cp=1 | peak MB/rank | x cp=1 | loss |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            rows.append(f"| {r['seq_len']} | {r['cp']} | {r['strategy']} | n/a | | | | {r['skipped']} |")
            continue
        if "error" in r:
            rows.append(f"| {r['seq_len']} | {r['cp']} | {r['strategy']} | error | | | | {r['error'][:60]} |")
            continue
        b = base.get(r["seq_len"])
        tr = f"{r['time_s'] / b['time_s']:.2f}" if b else "-"
        mr = f"{r['peak_mem_mb'] / b['peak_mem_mb']:.2f}" if b and b["peak_mem_mb"] > 0 else "-"
        name = r["strategy"] + (" (no comm)" if r.get("no_comm") else "")
        rows.append(f"| {r['seq_len']} | {r['cp']} | {name} | {r['time_s']:.3f} | {tr} | "
                    f"{r['peak_mem_mb']:.1f} | {mr} | {r['loss']:.6f} |")
    return "\n".join(rows)


def plot(results, out: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    for key, label, fname in (("peak_mem_mb", "peak memory per rank (MB)", "memory_vs_length.png"),
                              ("time_s", "step time (s)", "time_vs_length.png")):
        plt.figure(figsize=(6, 4))
        ok = [r for r in results if "error" not in r and "skipped" not in r]
        series = sorted({(r["cp"], r["strategy"], r.get("no_comm", False)) for r in ok})
        for cp, s, nc in series:
            pts = sorted((r["seq_len"], r[key]) for r in ok
                         if (r["cp"], r["strategy"], r.get("no_comm", False)) == (cp, s, nc))
            plt.plot(*zip(*pts), marker="o", label=f"cp={cp} {s}{' no-comm' if nc else ''}")
        plt.xscale("log", base=2)
        plt.xlabel("sequence length")
        plt.ylabel(label)
        plt.legend(fontsize=7)
        plt.tight_layout()
        plt.savefig(out / fname, dpi=100)
        plt.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", choices=["model", "attention", "full"], default="model")
    ap.add_argument("--arch", choices=["llama", "qwen3_next"], default="llama",
                    help="model level: a Llama, or a Qwen3-Next hybrid of the same size "
                         "(3 of 4 layers gated delta nets)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--strategies", nargs="+", default=["ring", "allgather", "ulysses"],
                    help="hfcp strategies, and 'deepspeed' for DeepSpeed Ulysses (needs the deepspeed package)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per measurement (median kept)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over all configurations, interleaved (fastest kept)")
    ap.add_argument("--no-comm", action="store_true", help="also time the ring with communication removed")
    ap.add_argument("--chunked-cp1", action="store_true",
                    help="cp=1 baseline uses hfcp's chunked loss too (isolates what context parallelism saves)")
    ap.add_argument("--match-threads", action=argparse.BooleanOptionalAction, default=True,
                    help="cp=1 gets as many threads as the largest cp run has processes (capped by --max-threads)")
    ap.add_argument("--max-threads", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=1024, help="hfcp's loss_chunk (and the chunked cp=1 baseline's)")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--quick", action="store_true", help="smoke run: L=1024, cp 1/2, ring, 1 repeat")
    ap.add_argument("--mem-cap-mb", type=float, help="instead: find the longest sequence under this per-rank cap")
    ap.add_argument("--resolution", type=int, default=256, help="--mem-cap-mb: bisect until within this many tokens")
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 512, 768], help="--level full: model widths")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.cps, args.strategies, args.repeats = [1024], [1, 2], ["ring"], 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.level == "full":
        if not args.mem_cap_mb:
            raise SystemExit("bench/bench.py: --level full needs --mem-cap-mb (it searches the frontier under that "
                             "cap)")
        rows = bench_full.frontier(args, measure_full)
        (out / "full_finetune_frontier.json").write_text(json.dumps(rows, indent=1))
        print(bench_full.frontier_table(rows, args.mem_cap_mb))
        return
    if args.mem_cap_mb:
        (out / "longest_under_cap.json").write_text(json.dumps(longest_under_cap(args)))
        return
    results = run(args)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    plot(results, out)
    errors = [r for r in results if "error" in r]
    if errors:
        raise SystemExit(f"bench/bench.py: {len(errors)} measurement(s) failed (see the table)")


if __name__ == "__main__":
    main()
