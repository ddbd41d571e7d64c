"""One benchmark measurement, in its own process (launched by scripts/bench/bench.py; torchrun when cp > 1).

Model level: one LoRA training step (forward + backward) of a long-context Llama. Attention level:
forward + backward of the CP attention alone (optionally with the ring's communication removed).
Prints one JSON line from rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from common import MODEL_SHAPE, REACH_SHAPE, lora_llama

from hfcp.testing.memory import PeakRSS, fix_mmap_threshold


def model_step(args, device):
    import transformers
    from peft import LoraConfig, get_peft_model

    import hfcp

    shape = dict(MODEL_SHAPE, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    if args.arch == "qwen3_next":  # the same size, 3 of its 4 layers gated delta nets (Qwen3-Next's 3:1 pattern)
        cfg = transformers.Qwen3NextConfig(**shape, head_dim=32, num_experts=0, linear_num_key_heads=4,
                                           linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                                           layer_types=["linear_attention"] * 3 + ["full_attention"])
        model = transformers.Qwen3NextForCausalLM(cfg).to(device)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "out_proj"]
        model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    else:
        model = lora_llama(args.seq_len, device, REACH_SHAPE if args.arch == "reach" else MODEL_SHAPE)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 4096, (1, args.seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    if args.cp > 1 and args.strategy == "deepspeed":
        return deepspeed_model_step(model, ids, args, device)
    if args.cp > 1:
        hfcp.patch(model, strategy=args.strategy, loss_chunk=args.loss_chunk, check_inputs=False,
                   tiled_mlp=args.tiled_mlp or False)
    run = compiled(model, args.compile, args.compile_backend)

    def step():
        out = run(input_ids=ids, labels=ids)
        out.loss.backward()
        return float(out.loss)

    def step_chunked_single():  # cp = 1 with the same chunked loss: isolates what CP itself saves
        from hfcp.loss.cross_entropy import IGNORE_INDEX, chunked_ce_sum, shift_labels

        base = model.get_base_model()
        hidden = base.model(input_ids=ids, use_cache=False).last_hidden_state
        targets = shift_labels(ids)
        loss = chunked_ce_sum(hidden, targets, base.lm_head, args.loss_chunk) / (targets != IGNORE_INDEX).sum()
        loss.backward()
        return float(loss)

    return step_chunked_single if args.cp == 1 and args.chunked_loss else step


def compiled(model, how: str, backend: str):
    """The model to call: itself ("none"), torch.compile of it ("whole"), or accelerate's compile_regions of it
    ("regional": each repeated block compiled)."""
    if how == "whole":
        return torch.compile(model, backend=backend)
    if how == "regional":
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=backend)
    return model


def attention_step(args, device):
    from hfcp.attention import STRATEGIES, MaskSpec
    from hfcp.layout import Layout, build_step_batch
    from hfcp.distributed.mesh import build_mesh

    B, H, Hkv, D, L = 1, 8, 2, 32, args.seq_len
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    if args.cp == 1:
        q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))

        def step():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.sum().backward()
            return 0.0

        return step
    if args.strategy == "deepspeed":
        return deepspeed_ulysses_step(q, k, v, args, device)
    mesh = build_mesh(args.cp)
    if args.no_comm:  # the same ring schedule and tiles, with every exchange replaced by reusing local K/V
        from hfcp.distributed import collectives

        class LocalComm(collectives.RingComm):
            def exchange(self, tensors):
                self._pending = tensors

            def wait(self):
                out, self._pending = self._pending, None
                return out

        import hfcp.attention.ring as ring

        ring.RingComm = LocalComm
    layout = Layout(L, mesh.cp_size, zigzag=True)
    sb = build_step_batch(layout, mesh.cp_rank, B, None, None, device)
    idx = sb.local_index
    ql, kl, vl = (t[:, :, idx].contiguous().to(device).requires_grad_() for t in (q, k, v))

    group = mesh.cp_group
    if args.strategy == "usp":  # Ulysses over the default ulysses_size neighbours, ring across those groups
        from hfcp.attention import build_usp_groups, check_ulysses_size

        group = build_usp_groups(mesh.cp_group, check_ulysses_size(None, mesh.cp_size, H, Hkv))

    def step():
        out = STRATEGIES[args.strategy](ql, kl, vl, sb, MaskSpec(True, None), D ** -0.5, group)
        out.sum().backward()
        return 0.0

    return step


def deepspeed_attention(device):
    """A DeepSpeed Ulysses DistributedAttention over the world group, with causal SDPA as its local attention,
    taking and returning (B, L/cp, H, D). Optional dependency: on CPU it needs DS_ACCELERATOR=cpu (set here)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
    import deepspeed
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo")  # wraps the existing process group

    def local_attention(q, k, v, *args, **kwargs):  # (B, L, H/cp, D) each -> (B, L, H/cp, D)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    return DistributedAttention(local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=1)


def deepspeed_model_step(model, ids, args, device):
    """The same LoRA step with DeepSpeed Ulysses as the attention: contiguous shards of the sequence, the
    transformers model unchanged except its attention function, the loss on this rank's full logits
    (what a DeepSpeed user gets from the model's forward), summed over the group."""
    import torch.distributed as dist
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from hfcp.loss.cross_entropy import IGNORE_INDEX, ce_sum, shift_labels

    attention = deepspeed_attention(device)

    def ds_attention(module, query, key, value, attention_mask, **kwargs):  # (B, H, L/cp, D) -> (B, L/cp, H, D)
        return attention(*(t.transpose(1, 2) for t in (query, key, value)), 0), None

    AttentionInterface.register("ds_ulysses", ds_attention)
    AttentionMaskInterface.register("ds_ulysses", lambda *a, **k: None)  # causal is applied inside
    model.set_attn_implementation("ds_ulysses")
    rank, n = dist.get_rank(), args.seq_len // args.cp
    local = slice(rank * n, (rank + 1) * n)
    targets = shift_labels(ids)
    count = (targets != IGNORE_INDEX).sum()

    def step():
        logits = model(input_ids=ids[:, local], position_ids=torch.arange(args.seq_len, device=device)[None, local],
                       use_cache=False).logits
        loss = ce_sum(logits, targets[:, local]) / count
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total)

    return step


def deepspeed_ulysses_step(q, k, v, args, device):
    """DeepSpeed Ulysses on the same q/k/v, in its own layout: contiguous shards (B, L/cp, H, D)."""
    import torch.distributed as dist

    attention = deepspeed_attention(device)
    rank, n = dist.get_rank(), args.seq_len // args.cp
    ql, kl, vl = (t[:, :, rank * n : (rank + 1) * n].transpose(1, 2).contiguous().to(device).requires_grad_()
                  for t in (q, k, v))  # (B, L/cp, H, D)

    def step():
        out = attention(ql, kl, vl, 0)
        out.sum().backward()
        return 0.0

    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--level", choices=["model", "attention"], default="model")
    ap.add_argument("--arch", choices=["llama", "qwen3_next", "reach"], default="llama",
                    help="model level: the model (reach: 8 layers, intermediate 896, Llama-3-8B's ratios)")
    ap.add_argument("--checkpointing", action="store_true", help="model level: gradient checkpointing")
    ap.add_argument("--tiled-mlp", type=int, default=0, help="model level, cp > 1: hfcp's tiled_mlp (tokens a tile)")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--strategy", default="ring")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-comm", action="store_true")
    ap.add_argument("--chunked-loss", action="store_true", help="cp=1: use hfcp's chunked loss too")
    ap.add_argument("--loss-chunk", type=int, default=1024)
    ap.add_argument("--compile", choices=["none", "regional", "whole"], default="none",
                    help="model level: torch.compile the (patched) model; its first steps compile, untimed")
    ap.add_argument("--compile-backend", default="inductor")
    args = ap.parse_args()
    fix_mmap_threshold()
    torch.set_num_threads(args.threads)
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
              else torch.device("cpu"))
    if args.cp > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    step = (model_step if args.level == "model" else attention_step)(args, device)
    loss = step()  # warm-up (plans, allocator)
    if args.compile != "none":  # the first step compiled; a second one may recompile what its inputs changed
        loss = step()
    times, cpu_times, mems = [], [], []
    for _ in range(args.repeats):
        with PeakRSS(device) as mem:
            t, c = time.perf_counter(), time.process_time()
            loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            cpu_times.append(time.process_time() - c)  # this process's CPU time: steadier on a shared machine
        mems.append(mem.growth / 2**20)
    result = {"level": args.level, "arch": args.arch, "seq_len": args.seq_len, "cp": args.cp,
              "strategy": args.strategy if args.cp > 1 else "none", "no_comm": args.no_comm, "threads": args.threads,
              "chunked_cp1": bool(args.chunked_loss and args.cp == 1), "time_s": sorted(times)[len(times) // 2],
              "cpu_s": sorted(cpu_times)[len(cpu_times) // 2],
              "peak_mem_mb": max(mems), "loss": loss, "compile": args.compile,
              "checkpointing": args.checkpointing, "tiled_mlp": args.tiled_mlp}
    if args.cp > 1:
        import torch.distributed as dist

        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (result["peak_mem_mb"], result["cpu_s"]))
        result["peak_mem_mb"] = max(m for m, _ in gathered)  # the worst rank
        result["cpu_s"] = max(c for _, c in gathered)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        dist.barrier()  # (gloo can abort a rank that tears down while its peer still sends)
        dist.destroy_process_group()
    else:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
