"""Full fine-tune memory frontier: FSDP2 over all ranks x CP over the same ranks (hfcp), per-rank memory cap.

    python scripts/bench/bench.py --level full --mem-cap-mb 700 --widths 256 512 768 --cps 1 2 4

One measurement (this file under torchrun, or alone for world 1): a Llama of the given width built on the meta
device, patched (cp = world), fully_shard over every rank, materialised shard by shard, then two AdamW steps
(forward + backward + step) on one sequence. Peak RSS growth per rank from before the model exists, so
parameters, gradients, AdamW moments (falling as 1/world) and activations (falling as 1/cp) all count.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from hfcp.testing.memory import PeakRSS, fix_mmap_threshold


def _the_job():
    """scripts/full_finetune.py, the job's --full-finetune mode, whose sharding (shard, state_mb_per_rank) this
    benchmark measures: loaded from its file, the job's folder being above this one."""
    path = Path(__file__).resolve().parents[1] / "full_finetune.py"
    spec = importlib.util.spec_from_file_location("full_finetune", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_JOB = _the_job()
shard, state_mb_per_rank = _JOB.shard, _JOB.state_mb_per_rank


def tiny_llama_config(hidden: int, seq_len: int):
    import transformers

    return transformers.LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                                    num_hidden_layers=2, num_attention_heads=hidden // 64, num_key_value_heads=2,
                                    max_position_embeddings=seq_len)


def build(hidden: int, seq_len: int, world: int, device):
    """The model, patched and sharded over `world` ranks (world 1: plain), with materialised random weights."""
    import transformers

    import hfcp

    cfg = tiny_llama_config(hidden, seq_len)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    if world > 1:
        hfcp.patch(model, strategy="ring", check_inputs=False)
        shard(model)
    model.to_empty(device=device)  # each rank allocates only its shards
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02, generator=g)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)  # its buffers were on meta
    return model


def measure(args):
    import torch.distributed as dist

    fix_mmap_threshold()
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("gloo")
    ids = torch.randint(0, 4096, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    with PeakRSS(device) as mem:
        model = build(args.hidden, args.seq_len, world, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):  # the first step allocates AdamW's moments; the second is timed
            t = time.perf_counter()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - t
    result = {"hidden": args.hidden, "seq_len": args.seq_len, "world": world, "time_s": step_s,
              "state_mb": state_mb_per_rank(model), "peak_mem_mb": mem.growth / 2**20,
              "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    if world > 1:
        got = [None] * world
        dist.all_gather_object(got, result["peak_mem_mb"])
        result["peak_mem_mb"] = max(got)  # the worst rank
        dist.barrier()  # (gloo can abort a rank that tears down while its peer still sends, as bench/step.py)
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


def frontier(args, run) -> list[dict]:
    """Per (width, world): the longest sequence (doubling from 512, then bisecting to args.resolution tokens)
    whose full fine-tune step stays under args.mem_cap_mb per rank. `run(cmd)` -> RESULT dict or None."""
    rows = []
    for hidden in args.widths:
        for world in args.cps:
            def fits(L):
                r = run(hidden, L, world)
                if r is None:  # a crash is not a measurement: stop rather than report a wrong frontier
                    raise SystemExit(f"bench: the full fine-tune step failed at width {hidden}, world {world}, "
                                     f"L={L} (see runs/bench_failure.log)")
                return r["peak_mem_mb"] <= args.mem_cap_mb

            lo, hi = 0, 512
            while fits(hi):
                lo, hi = hi, hi * 2
            while lo and hi - lo > args.resolution:
                mid = (lo + hi) // 2 // 128 * 128
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            state = run(hidden, 256, world)
            rows.append({"hidden": hidden, "world": world, "longest_seq_len": lo,
                         "state_mb_per_rank": state["state_mb"] if state else None,
                         "params_m": state["params_m"] if state else None})
            print(f"width {hidden}, world {world}: longest sequence under {args.mem_cap_mb} MB per rank: {lo}",
                  flush=True)
    return rows


def frontier_table(rows, cap) -> str:
    worlds = sorted({r["world"] for r in rows})
    out = [f"| width (params) | state MB per rank at world {', '.join(map(str, worlds))} | "
           + " | ".join(f"longest L, world {w}" for w in worlds) + " |",
           "|---|---|" + "---|" * len(worlds)]
    for hidden in sorted({r["hidden"] for r in rows}):
        rs = {r["world"]: r for r in rows if r["hidden"] == hidden}
        states = ", ".join(f"{rs[w]['state_mb_per_rank']:.0f}" for w in worlds)
        out.append(f"| {hidden} ({rs[worlds[0]]['params_m']:.1f}M) | {states} | "
                   + " | ".join(str(rs[w]["longest_seq_len"] or f"does not fit in {cap} MB") for w in worlds) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    measure(ap.parse_args())
