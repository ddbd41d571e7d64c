"""The step time of bench/reach.py's hfcp arms, measured in one run: each arm's model built in the same pair of
processes and their steps alternated, so every arm sees the same machine state (a shared machine's load changes
by tens of percent between runs; a ratio of two runs measures that).

    python scripts/bench/reach_time.py --seq-len 8192 --rounds 4                  # hfcp against hfcp_tiled
    python scripts/bench/reach_time.py --seq-len 8192 --arms hfcp hfcp_tiled hfcp_tiled_offload

The model and step are bench/reach.py's (REACH_SHAPE, LoRA r8 on the attention, gradient checkpointing, cp 2 on 2
gloo processes, one thread each). Prints each step's wall time per arm, the arms' mean against the first arm's, and
each arm's loss (equal: the same model and batch).

The process keeps glibc's own allocation policy. bench/reach.py fixes the mmap threshold at 64 KiB so that its
peak RSS tracks live memory; that makes every tensor over 64 KiB its own mapping, mapped and zeroed at each
allocation, a cost per allocation that a normal process (and CUDA's caching allocator) does not pay and that tiles,
which allocate per tile, pay many times. --fixed-mmap measures under it all the same. DeepSpeed ALST is not an arm
here: it replaces LlamaMLP.forward on the class, which would tile the other arms' MLPs in the same process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from common import REACH_SHAPE, lora_llama
from reach import hfcp_step

from hfcp.testing.memory import fix_mmap_threshold

ARMS = ("hfcp", "hfcp_tiled", "hfcp_tiled_offload")


def measure(args) -> None:
    import torch.distributed as dist

    if args.fixed_mmap:
        fix_mmap_threshold()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ids = torch.randint(0, REACH_SHAPE["vocab_size"], (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    steps, losses, times = {}, {}, {arm: [] for arm in args.arms}
    for arm in args.arms:
        model = lora_llama(args.seq_len, torch.device("cpu"), REACH_SHAPE)
        model.get_base_model().config._attn_implementation = "sdpa"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        steps[arm] = (model, hfcp_step(model, ids, arm))
        losses[arm] = steps[arm][1]()  # warm-up
    for _ in range(args.rounds):
        for arm in args.arms:
            model, step = steps[arm]
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            losses[arm] = step()
            times[arm].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        first = sum(times[args.arms[0]]) / args.rounds
        for arm in args.arms:
            mean = sum(times[arm]) / args.rounds
            print("RESULT " + json.dumps({"arm": arm, "seq_len": args.seq_len, "times_s": [round(t, 2) for t in
                                                                                           times[arm]],
                                          "mean_s": round(mean, 3), "ratio": round(mean / first, 3),
                                          "loss": losses[arm], "fixed_mmap": args.fixed_mmap}), flush=True)
    dist.barrier()  # (gloo can abort a rank that tears down while its peer still sends)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=["hfcp", "hfcp_tiled"],
                    help="the first is the one the others' ratio is to")
    ap.add_argument("--rounds", type=int, default=4, help="timed steps per arm, alternated")
    ap.add_argument("--fixed-mmap", action="store_true", help="bench/reach.py's allocation policy (see above)")
    args = ap.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        return measure(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           *(argv if argv is not None else sys.argv[1:])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not rows:
        raise SystemExit(f"bench/reach_time.py: the measurement failed\n{out.stderr[-3000:]}")
    print("| arm | step times (s) | mean (s) | against " + args.arms[0] + " | loss |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {', '.join(f'{t:.2f}' for t in r['times_s'])} | {r['mean_s']:.2f} | "
              f"{r['ratio']:.3f}x | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
