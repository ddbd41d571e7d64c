"""hfcp's tile kernels on one GPU: against torch's SDPA (flash backend), and each emulated rank's tiles of a packed row.

    python scripts/tools/gpu_kernels_check.py --json runs/gpu_kernels.json  # on a GPU (part of scripts/gpu_check.sh)
    python scripts/tools/gpu_kernels_check.py --cpu-smoke                    # tiny shapes, CPU kernels (the tests)

1. Causal attention over the whole row (8K / 16K / 32K tokens, bf16, 16 heads, 4 KV heads, head dim 128), forward
   + backward: hfcp's planner and tile kernels (hfcp.attention.tiles, the kernel that `choose_kernel` picks, named
   in the table) against `torch.nn.functional.scaled_dot_product_attention` restricted to the flash backend on the
   same tensors: max |difference| of out, dq, dk, dv relative to the largest value, and the time ratio hfcp / SDPA.
2. Emulated ranks: one packed row (tests/layout/test_balance.py's long-tail and one-long workloads, 16K and 32K
tokens) at
   cp 2 and 4, laid out by hfcp's planner (balance="auto") and by zigzag (balance="row"). Each rank's tiles against
   every rank's keys (what the ring runs) run one rank after another on the one GPU, forward + backward; per-rank
   kernel time max / mean beside the counted attention work max / mean (hfcp.layout.work).

Every step has its own time limit (--step-timeout); a step that fails or runs out of time is reported and the others
still run. The self-check warnings of the CUDA kernels (a kernel that failed and what runs instead) are printed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from hfcp.testing.packed_rows import documents, long_tail, one_long

from hfcp.attention import kernels
from hfcp.attention import tiles as tiling
from hfcp.layout.balance import step_layout
from hfcp.layout import Layout, StepBatch, build_step_batch
from hfcp.layout.work import imbalance, position_work, rank_work

FULL = dict(lengths=(8192, 16384, 32768), rows=(16384, 32768), heads=16, kv_heads=4, head_dim=128, repeats=3)
SMOKE = dict(lengths=(128, 256), rows=(512,), heads=4, kv_heads=2, head_dim=16, repeats=1)
WORKLOADS = {"long-tail": lambda n: long_tail(n, 0, median=min(1100, n // 16)), "one-long": lambda n: one_long(n, 0)}
SPEC = tiling.MaskSpec(causal=True, window=None)


@contextlib.contextmanager
def time_limit(seconds: int, what: str):
    """Raise TimeoutError naming the step after `seconds` (SIGALRM: the main thread of a Unix process)."""
    def expire(*_):
        raise TimeoutError(f"{what} ran past its {seconds} s limit")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def timed(fn, device, repeats: int) -> float:
    """Median wall time of fn() after one warm-up call, synchronising the device around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def qkv(length: int, cfg: dict, device, dtype, seed: int):
    """q (1, H, L, D), k / v (1, Hkv, L, D) and dout, in transformers' (B, L, H, D) memory, as attention gets them."""
    g = torch.Generator().manual_seed(seed)
    shape = lambda h: (1, length, h, cfg["head_dim"])  # noqa: E731
    q, do = (torch.randn(shape(cfg["heads"]), generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(shape(cfg["kv_heads"]), generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    return q, k, v, do


def hfcp_attention(q, k, v, do, tiles_of, scale: float):
    """Forward then backward of q against each (k, v, tiles) of tiles_of: (out, dq, dk list, dv list)."""
    out, lse = tiling.new_accumulators(q)
    for k_i, v_i, tiles in tiles_of:
        tiling.forward_tiles(q, k_i, v_i, tiles, scale, out, lse)
    out = out.to(q.dtype)
    dq, grads = torch.zeros_like(q, dtype=torch.float32), []
    for k_i, v_i, tiles in tiles_of:
        dk, dv = torch.zeros_like(k_i, dtype=torch.float32), torch.zeros_like(v_i, dtype=torch.float32)
        tiling.backward_tiles(do, q, k_i, v_i, out, lse, tiles, scale, dq, dk, dv)
        grads.append((dk, dv))
    return out, dq, grads


def sdpa_attention(q, k, v, do, scale: float, device):
    """torch's SDPA, flash backend only on CUDA (flash or math on CPU), causal with GQA: (out, dq, dk, dv)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backends):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def whole_row(length: int, cfg: dict, device, dtype) -> dict:
    """Part 1 at one length: errors and times of hfcp's tiles against SDPA."""
    q, k, v, do = qkv(length, cfg, device, dtype, seed=length)
    scale = cfg["head_dim"] ** -0.5
    sb = build_step_batch(Layout(length, 1, zigzag=False), 0, 1, None, None, "cpu")
    tiles = tiling.plan_tiles(SPEC, sb, [(0, length)], [(0, length)], dtype, device)
    out, dq, [(dk, dv)] = hfcp_attention(q, k, v, do, [(k, v, tiles)], scale)
    ref = sdpa_attention(q, k, v, do, scale, device)
    errors = {n: rel_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref)}
    t_hfcp = timed(lambda: hfcp_attention(q, k, v, do, [(k, v, tiles)], scale), device, cfg["repeats"])
    t_sdpa = timed(lambda: sdpa_attention(q, k, v, do, scale, device), device, cfg["repeats"])
    kernel = kernels.choose_kernel(device, dtype, cfg["head_dim"], masked=False)
    return {"tokens": length, "kernel": kernel, "tiles": len(tiles), "rel_err": errors, "hfcp_s": t_hfcp,
            "sdpa_s": t_sdpa, "ratio": t_hfcp / t_sdpa}


def emulated_ranks(workload: str, length: int, cp: int, cfg: dict, device, dtype) -> dict:
    """Part 2 for one row and cp: per-rank kernel time and counted work, balance='auto' and 'row'."""
    positions = documents(WORKLOADS[workload](length))[None]
    row = Layout(length, cp, zigzag=True)
    sb_row = build_step_batch(row, 0, 1, positions, None, "cpu")
    work = position_work([(SPEC, 1)], sb_row)
    result = {"workload": workload, "tokens": length, "cp": cp}
    for balance, layout in (("auto", step_layout(sb_row, [(SPEC, 1)])), ("row", row)):
        sb = StepBatch(layout, 0, sb_row.doc_ids, sb_row.key_valid, sb_row.positions)
        times, tile_counts = [], []
        for r in range(cp):
            q, k, v, do = qkv(layout.local_len, cfg, device, dtype, seed=r)
            tiles_of = [(k, v, tiling.plan_tiles(SPEC, sb, layout.ranges(r), layout.ranges(o), dtype, device))
                        for o in range(cp)]  # the same K/V tensors stand for every owner's: only shapes matter
            tile_counts.append(sum(len(t) for _, _, t in tiles_of))
            times.append(timed(lambda: hfcp_attention(q, k, v, do, tiles_of, cfg["head_dim"] ** -0.5), device,
                               cfg["repeats"]))
        result[balance] = {"layout": "balanced" if layout.balanced else "row", "rank_s": times,
                           "time_max_mean": max(times) / statistics.mean(times), "tiles": tile_counts,
                           "work_max_mean": imbalance(rank_work(layout, work))}
    return result


def run_step(what: str, seconds: int, fn, failures: list):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with time_limit(seconds, what):
                return fn()
        except Exception as e:  # noqa: BLE001 - report the step and go on with the others
            failures.append(f"{what}: {type(e).__name__}: {e}")
            print(f"FAILED {what}: {type(e).__name__}: {e}", flush=True)
        finally:
            for w in caught:
                print(f"warning in {what}: {w.message}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU kernels (fp32)")
    p.add_argument("--step-timeout", type=int, default=90, help="seconds each step may take")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("tools/gpu_kernels_check.py: no CUDA GPU here; run it on a GPU machine, or pass --cpu-smoke")
    cfg, device = (SMOKE, torch.device("cpu")) if args.cpu_smoke else (FULL, torch.device("cuda:0"))
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    failures, whole, ranks = [], [], []
    print("| tokens | hfcp kernel | tiles | rel err out / dq / dk / dv | hfcp s | SDPA flash s | hfcp / SDPA |")
    print("|---|---|---|---|---|---|---|")
    for length in cfg["lengths"]:
        r = run_step(f"whole row {length}", args.step_timeout, lambda: whole_row(length, cfg, device, dtype), failures)
        if r:
            whole.append(r)
            errs = " / ".join(f"{e:.1e}" for e in r["rel_err"].values())
            print(f"| {length} | {r['kernel']} | {r['tiles']} | {errs} | {r['hfcp_s']:.4f} | {r['sdpa_s']:.4f} | "
                  f"{r['ratio']:.2f} |", flush=True)
    print("\n| row | cp | layout | rank kernel time max / mean | work max / mean | tiles per rank |")
    print("|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        for length in cfg["rows"]:
            for cp in (2, 4):
                what = f"emulated ranks {workload} {length} cp {cp}"
                r = run_step(what, args.step_timeout, lambda: emulated_ranks(workload, length, cp, cfg, device, dtype),
                             failures)
                if r:
                    ranks.append(r)
                    for b in ("auto", "row"):
                        s = r[b]
                        print(f"| {length} tokens, {workload} | {cp} | {b} ({s['layout']}) | {s['time_max_mean']:.2f} |"
                              f" {s['work_max_mean']:.2f} | {s['tiles']} |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(device), "dtype": str(dtype), "whole_row": whole,
                                         "emulated_ranks": ranks, "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
