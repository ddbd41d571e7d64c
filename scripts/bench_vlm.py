"""A many-image VLM training step (forward + backward of every parameter) under CP: per-rank peak memory and step
time, with the vision tower's work split over the CP group (hfcp's default) and with every rank encoding every image
(as peers do), against one process.

    python scripts/bench_vlm.py                          # cp 1, 2, 4; 48 images of 64 x 64 (3072 image tokens)
    python scripts/bench_vlm.py --images 96 --cps 1 2

Each measurement runs in its own processes (torchrun for cp > 1); a tiny-width LLaVA (SigLIP tower, Llama text
model, random weights) so that the vision tower is a large part of the step, as in long-video fine-tuning.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(args):
    import torch
    import transformers as T

    vision = dict(model_type="siglip_vision_model", hidden_size=args.width, intermediate_size=4 * args.width,
                  num_hidden_layers=args.layers, num_attention_heads=4, image_size=64, patch_size=8)
    text = dict(model_type="llama", vocab_size=512, hidden_size=args.width, intermediate_size=4 * args.width,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1 << 16)
    cfg = T.LlavaConfig(vision_config=vision, text_config=text, image_token_index=500,
                        vision_feature_select_strategy="full", vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.LlavaForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(1)
    per_image = 64
    ids = torch.randint(3, 400, (1, args.images * (per_image + 8)), generator=g)
    for i in range(args.images):  # 8 text tokens, then the image's 64 placeholders
        start = i * (per_image + 8) + 8
        ids[0, start:start + per_image] = 500
    labels = ids.masked_fill(ids == 500, -100)
    return model, {"input_ids": ids, "labels": labels,
                   "pixel_values": torch.randn(args.images, 3, 64, 64, generator=g)}


def measure(args) -> None:
    """One configuration, in this process (and its torchrun peers): prints RESULT {json} on rank 0."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from bench_step import PeakRSS, fix_mmap_threshold

    import hfcp
    from hfcp.registry import REGISTRY

    fix_mmap_threshold()
    torch.set_num_threads(1)
    if args.cp > 1:
        dist.init_process_group("gloo")
    model, batch = build(args)
    if args.cp > 1:
        if not args.split:  # every rank encodes every image, as peers do
            import dataclasses

            REGISTRY._patchers["llava"] = dataclasses.replace(REGISTRY.get("llava"), vision_tower="")
        hfcp.patch(model)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.item()

    loss = step()  # warm-up
    times, mems = [], []
    for _ in range(args.repeats):
        with PeakRSS(torch.device("cpu")) as mem:
            t = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t)
        mems.append(mem.growth / 2**20)
    result = {"cp": args.cp, "split": bool(args.split and args.cp > 1), "images": args.images,
              "tokens": batch["input_ids"].shape[1], "time_s": sorted(times)[len(times) // 2],
              "peak_mem_mb": max(mems), "loss": loss}
    if args.cp > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, result["peak_mem_mb"])
        result["peak_mem_mb"] = max(every)  # the worst rank
        if dist.get_rank() != 0:
            return
    print("RESULT " + json.dumps(result), flush=True)


def run(args, cp: int, split: bool) -> dict | None:
    own = [str(HERE / "bench_vlm.py"), "--one", "--cp", str(cp), "--images", str(args.images), "--width",
           str(args.width), "--layers", str(args.layers), "--repeats", str(args.repeats)] + (["--split"] if split else [])
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"] + own
           if cp > 1 else [sys.executable] + own)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return measure(args)
    rows = []
    for cp in args.cps:
        for split in ([False] if cp == 1 else [True, False]):
            r = run(args, cp, split)
            if r:
                rows.append(r)
                print(json.dumps(r), flush=True)
    base = next((r for r in rows if r["cp"] == 1), None)
    print(f"\n{rows[0]['images'] if rows else args.images} images, {rows[0]['tokens'] if rows else '?'} tokens\n")
    print("| cp | vision tower | step (s) | peak memory per rank (MB) | x one process | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tower = "one process" if r["cp"] == 1 else ("split over the ranks" if r["split"] else "whole on every rank")
        ratio = f"{r['peak_mem_mb'] / base['peak_mem_mb']:.2f}" if base else "-"
        print(f"| {r['cp']} | {tower} | {r['time_s']:.2f} | {r['peak_mem_mb']:.0f} | {ratio} | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
