"""The main job's --full-finetune mode: every parameter trains, sharded with FSDP2 (torch's fully_shard) over all
ranks, each sequence split over its CP group by hfcp.

accelerate enables its FSDP plugin only on accelerators (on CPU it wraps the model in DDP, which cannot hold
FSDP2's sharded parameters), so this mode drives fully_shard with its own short loop, the same on CPU (gloo) and
GPUs (NCCL). FSDP averages gradients over all ranks, which is hfcp's convention (the mean over a CP group is the
group's gradient), so no correction is needed: one process with the same batches gives the same losses.
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist


def setup_distributed() -> torch.device:
    """The process group from the launcher's environment (torchrun / accelerate launch); this rank's device."""
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(model) -> None:
    """fully_shard each decoder layer, then the rest (embeddings, norm, head), over all ranks."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def state_mb_per_rank(model) -> float:
    """MB this rank holds of parameters + gradients + AdamW's two moments (fp32): 4 copies of its shard."""
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return 4 * 4 * local / 2**20


def batches_of(rows, batch_size: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True):
    """Endless micro-batches for this DP group: each epoch a seeded shuffle (shuffle=False: the rows' order, as the
    embedded curriculum's), dp_size * batch_size rows a step, the group's slice of them (with dp_size 1: the order
    one process sees)."""
    if len(rows) < dp_size * batch_size:
        raise SystemExit(f"full_finetune: {len(rows)} rows cannot fill one step of {dp_size} DP groups x {batch_size} "
                         "rows: give more data or a smaller --batch-size")
    epoch = 0
    while True:
        order = list(range(len(rows)))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        step = dp_size * batch_size
        for s in range(0, len(order) - step + 1, step):
            picked = [rows[i] for i in order[s + dp_rank * batch_size : s + (dp_rank + 1) * batch_size]]
            yield {k: torch.stack([torch.as_tensor(r[j]) for r in picked])
                   for j, k in enumerate(("input_ids", "position_ids", "labels"))}
        epoch += 1


def mean_over_world(x: float, device) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def scheduler(opt, max_steps: int):
    """The Trainer's schedule of the main job: warm-up, cosine decay to a tenth of the peak."""
    import transformers

    return transformers.get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=max(1, min(50, max_steps // 10)),
                                      num_training_steps=max_steps, scheduler_specific_kwargs={"min_lr_rate": 0.1})


def write_record(metrics, step: int, loss: float, norm, lr: float, tokens: int, t0: float, device, helpers) -> None:
    """One line of metrics.jsonl (only the main process has the file open; every rank calls: the loss is averaged
    over the world)."""
    record = {"step": step, "loss": mean_over_world(loss, device), "grad_norm": float(norm), "lr": lr,
              "tokens_per_s": tokens / (time.perf_counter() - t0), "peak_mem_mb": helpers.peak_mem_mb(device)}
    if metrics:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()


def full_state_dict(model) -> dict:
    """Every rank calls this (a collective); the full, unsharded state dict on the CPU."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train(args, model, tok, rows, out_dir: Path, helpers) -> dict:
    """Full fine-tune; writes metrics.jsonl, the trained model (model/, a normal checkpoint) and summary.json."""
    import transformers

    import hfcp

    device = setup_distributed()
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    model.to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hfcp.patch(model, cp_size=args.cp_size, strategy=args.strategy, loss_chunk=args.loss_chunk or None,
               tiled_mlp=args.tiled_mlp or False, offload_checkpoints=args.offload_checkpoints)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shard(model)
    dp_rank, dp_size = hfcp.data_parallel_rank_and_size(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = scheduler(opt, args.max_steps)
    data = batches_of(rows, args.batch_size, dp_rank, dp_size, args.seed, shuffle=not args.curriculum)
    tokens_per_step = args.seq_len * args.batch_size * args.grad_accum * dp_size
    before = helpers.long_range_accuracy(model, tok, args, device)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"hfcp full fine-tune: {world} processes, dp={dp_size} x cp={world // dp_size}, parameters sharded over "
              f"{world} (FSDP2), {len(rows)} rows of {args.seq_len} tokens; "
              f"{state_mb_per_rank(model):.0f} MB of parameters + grads + AdamW state per rank; key accuracy before: "
              f"{before:.3f}", flush=True)
    metrics = open(out_dir / "metrics.jsonl", "w") if is_main else None
    model.train()
    for step in range(1, args.max_steps + 1):
        t0, loss_sum = time.perf_counter(), 0.0
        for _ in range(args.grad_accum):
            batch = {k: v.to(device) for k, v in next(data).items()}
            # use_cache=False: with a cache, transformers 5.24 does not read packed documents from position_ids
            loss = model(**batch, use_cache=False).loss / args.grad_accum
            loss.backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        write_record(metrics, step, loss_sum, norm, lr, tokens_per_step, t0, device, helpers)
    if metrics:
        metrics.close()
    after = helpers.long_range_accuracy(model, tok, args, device)
    state = full_state_dict(model)
    summary = {"key_accuracy_before": before, "key_accuracy_after": after,
               "state_mb_per_rank": state_mb_per_rank(model), "peak_mem_mb": helpers.peak_mem_mb(device)}
    if is_main:
        fresh = transformers.AutoModelForCausalLM.from_config(model.config)
        fresh.load_state_dict(state)
        fresh.save_pretrained(out_dir / "model")
        (out_dir / "summary.json").write_text(json.dumps(summary))
        print(f"key accuracy after: {after:.3f} (before {before:.3f}); model and metrics in {out_dir}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return summary
