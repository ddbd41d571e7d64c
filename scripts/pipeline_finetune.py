"""The main job's --pp mode: LoRA over pipeline stages, each stage context-parallel (hfcp.pipeline), with its own
short loop: the pipeline runner, not the Trainer, runs the forward and backward of each step.

The world is laid out (pp, dp, cp), cp innermost. Each data group reads its own rows (full_finetune.batches_of, as
the other loops shard them), every rank of the group the same ones; a step's rows run as --microbatches
microbatches through the stages (1F1B). The runner returns the one-process loss of the step's rows and leaves the
one-process gradient on each stage's parameters; gradients are clipped by the whole model's norm (every stage's), as
one process clips them. With one process (no launcher) the same loop runs the whole model, which is the reference
the pipeline's losses equal.

Generation does not run over pipeline stages, so the key accuracy is measured before and after training on the main
process alone, on the model rebuilt whole with every stage's trained adapter.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from full_finetune import batches_of, scheduler, setup_distributed, write_record


class WholeModel:
    """One process: the runner's interface over the whole model (the reference of the pipeline's losses)."""

    def __init__(self, model):
        self.model = model

    def named_parameters(self):
        return ((n, p) for n, p in self.model.named_parameters())

    def step(self, **batch) -> torch.Tensor:
        loss = self.model(**batch, use_cache=False).loss
        loss.backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], max_norm)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


def train(args, model, tok, rows, out_dir: Path, helpers, lora) -> dict:
    """LoRA over --pp stages x CP; writes metrics.jsonl, adapter/ and summary.json (on the main process)."""
    from peft import get_peft_model

    import hfcp

    device = setup_distributed()
    world = dist.get_world_size() if dist.is_initialized() else 1
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    before = key_accuracy(args, tok, helpers, device, None) if is_main else None
    model.to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(args.seed)
    model = get_peft_model(model, lora)
    cp = args.cp_size or world // args.pp
    if world > 1:
        runner = hfcp.pipeline(model, pp_size=args.pp, cp_size=cp, schedule="1F1B", n_microbatches=args.microbatches,
                               strategy=args.strategy, loss_chunk=args.loss_chunk or None,
                               tiled_mlp=args.tiled_mlp or False, offload_checkpoints=args.offload_checkpoints)
    else:
        runner = WholeModel(model)
    dp_rank, dp_size = hfcp.data_parallel_rank_and_size(model) if world > 1 else (0, 1)
    mine = {n: p for n, p in runner.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(mine.values(), lr=args.lr, weight_decay=0.0)
    sched = scheduler(opt, args.max_steps)
    data = batches_of(rows, args.batch_size, dp_rank, dp_size, args.seed, shuffle=not args.curriculum)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        layout = (f"pp={args.pp} x dp={dp_size} x cp={cp}, 1F1B over {args.microbatches} microbatches of "
                  f"{args.batch_size // args.microbatches} rows" if world > 1 else "the whole model (the reference)")
        print(f"hfcp pipeline: {world} processes, {layout}, {len(rows)} rows of {args.seq_len} tokens; key accuracy "
              f"{before:.3f} before", flush=True)
    metrics = open(out_dir / "metrics.jsonl", "w") if is_main else None
    model.train()
    tokens_per_step = args.seq_len * args.batch_size * args.grad_accum * dp_size
    for step in range(1, args.max_steps + 1):
        t0, loss_sum = time.perf_counter(), 0.0
        for _ in range(args.grad_accum):
            loss_sum += runner.step(**{k: v.to(device) for k, v in next(data).items()}).item() / args.grad_accum
        if args.grad_accum > 1:  # the mean of the micro-steps' gradients, as the Trainer's accumulation gives
            for p in mine.values():
                if p.grad is not None:
                    p.grad.div_(args.grad_accum)
        norm = runner.clip_grad_norm_(1.0)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        runner.zero_grad()
        write_record(metrics, step, loss_sum, norm, lr, tokens_per_step, t0, device, helpers)
    if metrics:
        metrics.close()
    trained = gather_stages({n: p.detach().cpu() for n, p in mine.items()}, dp_size * cp if world > 1 else 1)
    summary = None
    if is_main:
        after = key_accuracy(args, tok, helpers, device, trained, out_dir / "adapter")
        summary = {"key_accuracy_before": before, "key_accuracy_after": after,
                   "peak_mem_mb": helpers.peak_mem_mb(device)}
        (out_dir / "summary.json").write_text(json.dumps(summary))
        print(f"key accuracy {after:.3f} after ({before:.3f} before); the adapter (every stage's, identical on the "
              f"ranks of each) and metrics in {out_dir}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return summary


def gather_stages(mine: dict, ranks_per_stage: int) -> dict:
    """Every stage's trained tensors ({name: tensor}), on every rank. Raises on every rank when the ranks of one stage
    hold different values (each stage's gradients are averaged over its ranks, so they never should)."""
    if not dist.is_initialized():
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {}
    for rank, part in enumerate(every):
        first = every[rank - rank % ranks_per_stage]  # the stage's first rank
        if part.keys() != first.keys() or not all(torch.equal(part[n], first[n]) for n in part):
            raise RuntimeError(f"pipeline_finetune: rank {rank} holds other trained weights than rank "
                               f"{rank - rank % ranks_per_stage} of its stage")
        merged |= part
    return merged


def key_accuracy(args, tok, helpers, device, trained: dict | None, save_to: Path | None = None) -> float:
    """The key accuracy (finetune_lora.long_range_accuracy) of the model rebuilt whole in this process, with the
    trained LoRA (and saved tensors) of every stage loaded when given (then saved as a PEFT adapter to save_to)."""
    from peft import get_peft_model

    model, _ = helpers.load_model_and_tokenizer(args)
    if trained is not None:
        model = get_peft_model(model, helpers.lora_config(args))
        missing = set(trained) - {n for n, _ in model.named_parameters()}
        if missing:
            raise RuntimeError(f"pipeline_finetune: trained tensors not in the rebuilt model: {sorted(missing)[:3]}")
        model.load_state_dict(trained, strict=False)
        if save_to is not None:
            model.save_pretrained(save_to)
    return helpers.long_range_accuracy(model.to(device), tok, args, device)
