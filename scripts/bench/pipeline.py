"""Memory per rank of one LoRA training step: pipeline stages x CP (hfcp.pipeline) against CP alone, the same model
and the same tokens, on 4 processes.

    torchrun --standalone --nproc-per-node 4 scripts/bench/pipeline.py --seq-len 8192 --rows 2

Arms (each in this launch, one after the other): cp 4 (hfcp.patch, every rank all layers, a quarter of each row),
pp 2 x cp 2 with GPipe and with 1F1B (each rank half the layers, half of each row; one row per microbatch). The
model is scripts/bench/step.py's Llama (hidden 256, 4 layers, vocabulary 4096, LoRA r8 on the attention
projections), made deeper with --layers. Reported per arm: the worst rank's peak memory growth during the step (RSS
on CPU, allocated memory on CUDA), the parameter bytes each rank holds, and the loss (the same in every arm).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from common import MODEL_SHAPE

from hfcp.testing.memory import PeakRSS, fix_mmap_threshold


def lora_model(layers: int, seq_len: int, device):
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**MODEL_SHAPE, "num_hidden_layers": layers}, max_position_embeddings=seq_len)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def held_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(arm: str, args, device) -> dict:
    import hfcp

    model = lora_model(args.layers, args.seq_len, device)
    ids = torch.randint(0, MODEL_SHAPE["vocab_size"], (args.rows, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(device)
    if arm == "cp4":
        hfcp.patch(model, cp_size=dist.get_world_size(), check_inputs=False)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return float(loss)
    else:
        runner = hfcp.pipeline(model, pp_size=2, cp_size=dist.get_world_size() // 2, schedule=arm.split()[-1],
                               n_microbatches=args.rows, check_inputs=False)

        def step():
            return float(runner.step(input_ids=ids, labels=ids))
    step()  # warm-up
    model.zero_grad(set_to_none=True)
    with PeakRSS(device) as mem:
        loss = step()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (mem.growth / 2**20, held_bytes(model) / 2**20))
    return {"arm": arm, "seq_len": args.seq_len, "rows": args.rows, "layers": args.layers, "loss": loss,
            "step_peak_mb": max(p for p, _ in peaks), "params_mb_per_rank": max(h for _, h in peaks)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    fix_mmap_threshold()
    torch.set_num_threads(1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("bench/pipeline.py: run it on 4 processes (torchrun --nproc-per-node 4)")
    for arm in ("cp4", "pp2 x cp2 GPipe", "pp2 x cp2 1F1B"):
        r = measure(arm, args, device)
        if dist.get_rank() == 0:
            print(f"{arm:16s} L={args.seq_len} rows={args.rows}: step peak {r['step_peak_mb']:.0f} MB per rank, "
                  f"parameters {r['params_mb_per_rank']:.1f} MB per rank, loss {r['loss']:.6f}")
            print("RESULT " + json.dumps(r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
