"""Packed rows: step time of hfcp's balanced layout (balance="auto") against zigzag (balance="row"), in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 scripts/bench/packed.py    # 16K tokens, 5 rounds
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 scripts/bench/packed.py --length 1024 --rounds 1

One LoRA training step (forward + backward) of the benchmark's Llama (scripts/bench/step.py) on one packed row per
workload, seeded, with the document generators of hfcp.testing.packed_rows: "long-tail" (lognormal lengths, median 1.1K
tokens) and "one-long" (a document of half the row, then short ones). Two copies of the same model are patched, one
per balance setting, and the rounds interleave them (round: every workload, each setting), so a slow spell of the
machine hits both alike. Per step the time kept is the slowest rank's; per configuration the median over rounds; the
ratio auto / row of the medians, and in brackets the median of each round's ratio.
Prints a markdown table (rank 0) with the counted attention work max / mean of each layout (hfcp.balance_report),
the step times, their ratio auto / row, and both losses; --out writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import common

from hfcp.testing.memory import fix_mmap_threshold
from hfcp.testing.packed_rows import documents, long_tail, one_long

WORKLOADS = {"long-tail": long_tail, "one-long": one_long}
BALANCES = ("auto", "row")


def packed_row(workload: str, length: int, seed: int) -> dict:
    """One row of `length` tokens: random ids, position_ids restarting at each document, labels = ids."""
    positions = documents(WORKLOADS[workload](length, seed))[None]
    vocab = common.MODEL_SHAPE["vocab_size"]
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "position_ids": positions, "labels": ids}


def timed_step(model, batch) -> tuple[float, float]:
    """(loss, slowest rank's wall time) of one forward + backward."""
    dist.barrier()
    t = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    elapsed = torch.tensor(time.perf_counter() - t)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), float(elapsed)


def measure(args) -> list[dict]:
    import hfcp

    cp = dist.get_world_size()
    models = {b: hfcp.patch(common.lora_llama(args.length, "cpu"), cp_size=cp, balance=b, check_inputs=False)
              for b in BALANCES}
    batches = {w: packed_row(w, args.length, args.seed) for w in args.workloads}
    times = {(w, b): [] for w in batches for b in BALANCES}
    losses = {}
    for w, batch in batches.items():  # warm-up: plans, allocator
        for b in BALANCES:
            timed_step(models[b], batch)
    for _ in range(args.rounds):
        for w, batch in batches.items():
            for b in BALANCES:
                losses[w, b], t = timed_step(models[b], batch)
                times[w, b].append(t)
    rows = []
    for w, batch in batches.items():
        report = hfcp.balance_report(models["auto"], input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        median = {b: _median(times[w, b]) for b in BALANCES}
        rows.append({"workload": w, "length": args.length, "cp": cp, "seed": args.seed, "layout": report["layout"],
                     "work_imbalance": {"auto": report["imbalance"], "row": report["row"]["imbalance"]},
                     "time_s": median, "times_s": {b: times[w, b] for b in BALANCES},
                     "ratio": median["auto"] / median["row"], "ratio_paired": _median(
                         [a / r for a, r in zip(times[w, "auto"], times[w, "row"])]),
                     "loss": {b: losses[w, b] for b in BALANCES}})
    return rows


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def table(rows) -> str:
    out = ["| row | work max/mean: row -> auto | step s: row | step s: auto | auto / row (per round) "
           "| loss row / auto |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        w, t, loss = r["work_imbalance"], r["time_s"], r["loss"]
        out.append(f"| {r['length']} tokens, {r['workload']} | {w['row']:.2f} -> {w['auto']:.3f} | {t['row']:.2f} | "
                   f"{t['auto']:.2f} | {r['ratio']:.2f} ({r['ratio_paired']:.2f}) | "
                   f"{loss['row']:.6f} / {loss['auto']:.6f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=16384, help="tokens of the packed row")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed steps per configuration (median kept)")
    ap.add_argument("--seed", type=int, default=0, help="the document lengths' seed")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    fix_mmap_threshold()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    own_group = not dist.is_initialized()  # a launcher's harness may have made it already
    if own_group:
        dist.init_process_group("gloo")
    rows = measure(args)
    if dist.get_rank() == 0:
        print(table(rows), flush=True)
        print("RESULT " + json.dumps(rows), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
        bad = [r["workload"] for r in rows if abs(r["loss"]["auto"] - r["loss"]["row"]) > 1e-5 * abs(r["loss"]["row"])]
        if bad:
            raise SystemExit(f"bench/packed.py: the losses of balance='auto' and 'row' differ on {bad}")
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
