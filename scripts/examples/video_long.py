"""Long-video classification under CP: a tiny VideoMAE on many frames, forward + backward, per-rank peak
memory of the patched step against the unpatched one (same process, same input).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no scripts/examples/video_long.py --frames 128
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers
from accelerate import Accelerator

import hfcp

from hfcp.testing.memory import PeakRSS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=128)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses"])
    args = ap.parse_args()
    acc = Accelerator(cpu=not torch.cuda.is_available())
    cfg = transformers.VideoMAEConfig(image_size=args.image_size, patch_size=16, num_frames=args.frames, tubelet_size=2,
                                      hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=256, num_labels=10)
    torch.manual_seed(0)
    model = transformers.VideoMAEForVideoClassification(cfg).to(acc.device)
    video = torch.randn(1, args.frames, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(1))
    video, label = video.to(acc.device), torch.tensor([3], device=acc.device)
    tokens = (args.image_size // 16) ** 2 * args.frames // 2

    def step():
        t = time.perf_counter()
        with PeakRSS(acc.device) as mem:
            out = model(video, labels=label)
            out.loss.backward()
        model.zero_grad()
        return out.loss.item(), mem.growth / 2**20, time.perf_counter() - t

    step()  # warm-up
    ref_loss, ref_mem, ref_t = step()
    hfcp.patch(model, strategy=args.strategy)
    step()
    loss, mem, t = step()
    for r in range(acc.num_processes):
        if r == acc.process_index:
            print(f"rank {r}: {tokens} tokens; unpatched loss {ref_loss:.6f} peak {ref_mem:.0f} MB {ref_t:.2f}s | "
                  f"hfcp cp={acc.num_processes} loss {loss:.6f} peak {mem:.0f} MB {t:.2f}s "
                  f"(memory x{mem / max(ref_mem, 1e-9):.2f})", flush=True)
        acc.wait_for_everyone()


if __name__ == "__main__":
    main()
