"""The longest sequence per rank: peak memory of one LoRA step per rank against the sequence length, for hfcp with and
without its memory options and for DeepSpeed ALST built from DeepSpeed's own pieces, in the same run.

    python scripts/bench/reach.py --lengths 2048 4096 8192 16384          # the driver: every arm, fitted
    torchrun --standalone --nproc-per-node 2 scripts/bench/reach.py --arm hfcp --seq-len 8192   # one measurement

The model: the benchmark's Llama with Llama-3-8B's ratios scaled down (common.REACH_SHAPE: hidden 256,
intermediate 896, 8 heads / 2 KV heads, 8 layers, vocabulary 4096), LoRA r8 on the attention projections, gradient
checkpointing on, cp 2 on 2 processes. Arms:

- hfcp: hfcp.patch (ring), its chunked loss;
- hfcp_tiled: and tiled_mlp=True (tiles of hidden_size tokens);
- hfcp_tiled_offload: and offload_checkpoints=True (on CPU the host is the device: it saves nothing here);
--model moe: a Qwen3-MoE of the same widths instead (8 experts of intermediate 448, 2 a token, in every layer; LoRA
on the attention), for the hfcp arms (DeepSpeed's TiledMLP is for dense MLPs).

- alst: DeepSpeed's UlyssesSPAttentionHF (registered with transformers over sdpa), TiledMLP on every MLP (tiles of
  hidden_size tokens, as its docs do), the loss through TiledFusedLogitsLoss, transformers' checkpointing with
  offload on CUDA (save_on_cpu; on CPU transformers' offload raises for want of pinned memory, and would save
  nothing); each rank its contiguous shard of the sequence.

Each measurement prints the worst rank's peak RSS growth over a step and the loss (the sum over the ranks for
alst); the driver fits peak = a + b x S per arm (b: bytes per token per rank) and gives the longest S under --cap.

    torchrun --standalone --nproc-per-node 2 scripts/bench/reach.py --arm hfcp_tiled --seq-len 8192 --phases

--phases: where in the step rank 0's memory peaks: its RSS above the step's start read after every aten operator,
the highest per part of the step (the forward of each decoder layer's blocks, the loss after the last layer, the
backward through each layer's recompute), one line each.

    torchrun --standalone --nproc-per-node 2 scripts/bench/reach.py --arm hfcp_tiled --seq-len 4096 --saved

--saved: what each decoder layer's forward keeps for backward with checkpointing off, in hidden vectors per local
token (scripts/bench/saved_census.py).

    torchrun --standalone --nproc-per-node 2 scripts/bench/reach.py --arm hfcp_tiled --seq-len 32768 --census

--census: what is alive at rank 0's peak of a step (any arm), grouped by the operator that allocated it, in hidden
vectors per local token (scripts/bench/alloc_census.py); with --phases, after the phases.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch

from common import REACH_SHAPE, lora_llama

from hfcp.testing.memory import PeakRSS, fix_mmap_threshold
from alloc_census import peak_census
from saved_census import SavedCensus

ARMS = ("hfcp", "hfcp_tiled", "hfcp_tiled_offload", "alst")


def hfcp_step(model, ids, arm: str):
    import hfcp

    hfcp.patch(model, strategy="ring", check_inputs=False, tiled_mlp=arm != "hfcp",
               offload_checkpoints=arm == "hfcp_tiled_offload")

    def step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return float(out.loss)

    return step


def alst_step(model, ids, seq_len: int):
    """DeepSpeed ALST's pieces on the same model: Ulysses attention, tiled MLPs, the tiled fused loss."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    import torch.distributed as dist
    import transformers
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF

    deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=world, micro_batch_size=1,
                                                     seq_length=seq_len, seq_length_is_variable=False)
    hidden = model.config.hidden_size

    def tiled_mlp_forward(self, x):
        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, math.ceil(x.shape[-2] / hidden), params)

    transformers.models.llama.modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    n = seq_len // world
    local = slice(rank * n, (rank + 1) * n)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # shifted before sharding
    count = int((targets != -100).sum())
    base = model.get_base_model()
    head = base.lm_head

    def loss_fn(self, x, y):
        return torch.nn.functional.cross_entropy(self(x).float().view(-1, self.out_features), y.view(-1),
                                                 ignore_index=-100, reduction="sum")

    def step():
        out = base.model(input_ids=ids[:, local], position_ids=torch.arange(seq_len)[None, local], use_cache=False)
        y = targets[:, local]
        shards = max(1, math.ceil(n / 1024))
        loss = TiledFusedLogitsLoss.apply(loss_fn, head, out.last_hidden_state, y, None, shards, [head.weight],
                                          "sum") / count
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total)

    return step


class Phases:
    """The highest RSS above `base` after any aten operator, per part of the step (see --phases)."""

    def __init__(self, model, base: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.base, self.where, self.phase, self.peaks = base, "embedding", "forward", {}
        layers = model.get_base_model().model.layers
        for i, layer in enumerate(layers):
            for name, block in layer.named_children():
                block.register_forward_pre_hook(lambda *_, i=i, name=name: setattr(self, "where", f"layer {i} {name}"))
        model.get_base_model().model.norm.register_forward_pre_hook(
            lambda *_: setattr(self, "where", "final norm and loss"))
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                key = (outer.phase, outer.where)
                outer.peaks[key] = max(outer.peaks.get(key, 0), PeakRSS._rss() - outer.base)
                return out

        self.mode = Mode()

    def report(self) -> None:
        top = max(self.peaks.values())
        for (phase, where), peak in self.peaks.items():
            print(f"{phase:8s} {where:32s} {peak / 2**20:7.1f} MB{'  <- peak' if peak == top else ''}", flush=True)


def lora_moe(args):
    """--model moe: a Qwen3-MoE with REACH_SHAPE's widths, its MLPs mixtures of 8 experts, LoRA on the attention."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in REACH_SHAPE.items() if k != "intermediate_size"},
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=448,
                                         decoder_sparse_step=1, max_position_embeddings=args.seq_len,
                                         head_dim=REACH_SHAPE["hidden_size"] // REACH_SHAPE["num_attention_heads"])
    model = transformers.Qwen3MoeForCausalLM(config)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def measure(args) -> None:
    import torch.distributed as dist

    fix_mmap_threshold()
    torch.set_num_threads(1)
    own_group = not dist.is_initialized()  # (a launcher's harness running several scripts may have made it)
    if own_group:
        dist.init_process_group("gloo")
    model = lora_llama(args.seq_len, torch.device("cpu"), REACH_SHAPE) if args.model == "llama" else lora_moe(args)
    model.get_base_model().config._attn_implementation = "sdpa"
    # alst: transformers' checkpoint offload (save_on_cpu with pinned memory), on CUDA only: on CPU transformers 5.24
    # asks for pinned memory anyway and the forward raises (and the host is the device there: it would save nothing)
    offload = args.arm == "alst" and torch.cuda.is_available()
    if not args.saved:  # (--saved: what each layer keeps when nothing is recomputed)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=offload)
    ids = torch.randint(0, REACH_SHAPE["vocab_size"], (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    step = alst_step(model, ids, args.seq_len) if args.arm == "alst" else hfcp_step(model, ids, args.arm)
    loss = step()  # warm-up
    if args.phases or args.census:
        if args.phases:
            model.zero_grad(set_to_none=True)
            phases = Phases(model, PeakRSS._rss())
            with phases.mode:
                out = model(input_ids=ids, labels=ids, use_cache=False)
                phases.phase = "backward"
                out.loss.backward()
            if dist.get_rank() == 0:
                phases.report()
        if args.census:
            model.zero_grad(set_to_none=True)
            peak, where, rows = peak_census(step)
            unit = model.config.hidden_size * 4 * (args.seq_len // dist.get_world_size())
            if dist.get_rank() == 0:
                print(f"CENSUS peak {peak / unit:.2f} hidden vectors per local token ({peak / 2**20:.1f} MB), "
                      f"allocating in {where}", flush=True)
                for nbytes, n, op in rows:
                    print(f"CENSUS {nbytes / unit:6.2f} x{n:<4d} {op}", flush=True)
        dist.barrier()
        if own_group:
            dist.destroy_process_group()
        return
    if args.saved:
        census = SavedCensus(model.get_base_model().model.layers, list(model.parameters()))
        with census.saving():
            out = model(input_ids=ids, labels=ids, use_cache=False)
        unit = model.config.hidden_size * 4 * (args.seq_len // dist.get_world_size())
        if dist.get_rank() == 0:
            for where, nbytes in census.per_layer().items():
                print(f"SAVED {where:20s} {nbytes / unit:5.2f} hidden vectors per local token", flush=True)
        out.loss.backward()
        dist.barrier()
        if own_group:
            dist.destroy_process_group()
        return
    peaks = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        with PeakRSS(torch.device("cpu")) as mem:
            loss = step()
        peaks.append(mem.growth / 2**20)
    worst = [None] * dist.get_world_size()
    dist.all_gather_object(worst, max(peaks))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"arm": args.arm, "seq_len": args.seq_len, "peak_mb": max(worst), "loss": loss}),
              flush=True)
    dist.barrier()  # (gloo can abort a rank that tears down while its peer still sends)
    if own_group:
        dist.destroy_process_group()


def drive(args) -> None:
    rows = []
    for arm in args.arms:
        for n in args.lengths:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
                   "--arm", arm, "--seq-len", str(n), "--repeats", str(args.repeats), "--model", args.model]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
            if line is None:
                print(f"{arm} {n}: failed\n{out.stderr[-2000:]}", flush=True)
                continue
            rows.append(json.loads(line[7:]))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| arm | " + " | ".join(f"{n} tokens" for n in args.lengths) + " | b (bytes/token/rank) | longest under "
          f"{args.cap} MB |\n|---|" + "---|" * (len(args.lengths) + 2))
    for arm in args.arms:
        mine = [r for r in rows if r["arm"] == arm]
        if len(mine) < 2:
            continue
        xs, ys = [r["seq_len"] for r in mine], [r["peak_mb"] for r in mine]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        cells = " | ".join(f"{r['peak_mb']:.1f} MB ({r['loss']:.6f})" for r in mine)
        print(f"| {arm} | {cells} | {b * 2**20:.0f} | {(args.cap - a) / b:.0f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", choices=ARMS, help="one measurement (under torchrun, 2 processes)")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cap", type=float, default=1024, help="MB per rank for the longest-sequence column")
    ap.add_argument("--model", choices=["llama", "moe"], default="llama")
    ap.add_argument("--phases", action="store_true", help="with --arm hfcp*: rank 0's peak per part of the step")
    ap.add_argument("--census", action="store_true", help="with --arm: what is alive at rank 0's peak of a step")
    ap.add_argument("--saved", action="store_true",
                    help="with --arm hfcp*: what each decoder layer's forward keeps for backward, no checkpointing")
    args = ap.parse_args(argv)
    if args.model == "moe" and ("alst" in ([args.arm] if args.arm else args.arms)):
        raise SystemExit("bench/reach.py: --model moe runs the hfcp arms only (DeepSpeed's TiledMLP is for dense "
                         "MLPs): pass --arms hfcp hfcp_tiled")
    if (args.phases or args.saved) and not (args.arm or "").startswith("hfcp"):
        raise SystemExit("bench/reach.py: --phases and --saved need --arm hfcp, hfcp_tiled or hfcp_tiled_offload "
                         f"(got --arm {args.arm})")
    if args.census and not args.arm:
        raise SystemExit("bench/reach.py: --census measures one arm: pass --arm and --seq-len (under torchrun)")
    measure(args) if args.arm else drive(args)


if __name__ == "__main__":
    main()
