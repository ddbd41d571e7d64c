"""LoRA fine-tuning on long documents, context-parallel with hfcp, launched with accelerate.

    accelerate launch --multi_gpu --num_processes 2 scripts/finetune_lora.py
    python scripts/finetune_lora.py            # one process: the same losses

Defaults need nothing from the network: a tiny Llama built from scripts/configs/tiny_llama.json and a
generated corpus whose documents end by repeating a key given at their start (long-range metric: the
accuracy of those key characters, teacher-forced, on held-out documents).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_data import (  # noqa: E402
    ByteTokenizer, embedded_corpus, encode_document, key_document, key_span, load_texts, pack,
)

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny_llama.json"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local checkpoint directory (default: embedded tiny Llama, random weights)")
    ap.add_argument("--data", help="directory of .txt files or .jsonl with 'text' (default: embedded corpus)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1, help="rows per CP group per micro-step")
    ap.add_argument("--cp-size", type=int, default=None, help="ranks per CP group (default: all processes)")
    ap.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses"])
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--loss-chunk", type=int, default=1024,
                    help="tokens per chunk of the loss: logits are never materialised whole (0: plain logits)")
    ap.add_argument("--output-dir", default="runs/finetune")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps (0: only at the end)")
    ap.add_argument("--resume-from", help="a checkpoint directory written by --save-every")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-docs", type=int, default=8)
    return ap.parse_args(argv)


def fail(msg: str):
    raise SystemExit(f"finetune_lora.py: error: {msg}")


def validate(args, world: int) -> list[str] | None:
    """One-line errors before anything starts. Returns the texts of --data (None: embedded corpus)."""
    if args.model and not (Path(args.model) / "config.json").is_file():
        fail(f"--model {args.model}: no checkpoint directory with a config.json there")
    if args.resume_from and not (Path(args.resume_from) / "trainer_state.json").is_file():
        fail(f"--resume-from {args.resume_from}: no trainer_state.json there (not a checkpoint of this script)")
    cp = args.cp_size or world
    if cp < 1 or world % cp:
        fail(f"--cp-size {args.cp_size} must divide the number of processes ({world})")
    if args.seq_len < 2 or args.grad_accum < 1 or args.max_steps < 1:
        fail(f"--seq-len {args.seq_len}, --grad-accum {args.grad_accum}, --max-steps {args.max_steps} must be positive")
    config = json.loads(((Path(args.model) / "config.json") if args.model else CONFIG).read_text())
    limit = config.get("max_position_embeddings")
    if limit is not None and args.seq_len > limit:
        fail(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings={limit}")
    if args.data is None:
        return None
    try:
        return load_texts(args.data)
    except ValueError as e:
        fail(str(e))


def load_model_and_tokenizer(args):
    import transformers

    if args.model:
        config = transformers.AutoConfig.from_pretrained(args.model)
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    else:
        config = transformers.LlamaConfig(**json.loads(CONFIG.read_text()))
        tok = ByteTokenizer()
        torch.manual_seed(args.seed)
        model = transformers.LlamaForCausalLM(config)
    return model, tok


def encode_docs(args, tok, texts):
    texts = texts if texts is not None else embedded_corpus(2000, int(args.seq_len * 0.9), args.seed)
    return [encode_document(tok, t) for t in texts]


def batches_for_step(rows, step, micro, n_micro, batch_size, dp_rank, dp_size):
    """Deterministic data order: optimizer step, micro-step -> the same rows on every rank of a CP group."""
    start = ((step * n_micro + micro) * dp_size + dp_rank) * batch_size
    picked = [rows[(start + i) % len(rows)] for i in range(batch_size)]
    return {k: torch.stack([r[j] for r in picked]) for j, k in enumerate(("input_ids", "position_ids", "labels"))}


@torch.no_grad()
def long_range_accuracy(model, tok, args, device) -> float:
    """Teacher-forced accuracy on the tokens of the final key of held-out documents (the key is given only
    at the start of each document, so these tokens need attention across the whole sequence)."""
    import hfcp

    rng = random.Random(10_000 + args.seed)
    correct = total = 0
    model.eval()
    for _ in range(args.eval_docs):
        text, key = key_document(rng, int(args.seq_len * 0.9))
        ids, start, end = key_span(tok, text, key)
        ids = torch.tensor([ids[: args.seq_len]], device=device)
        logits = hfcp.gather_sequence(model(input_ids=ids).logits, model)
        pred = logits[0, start - 1 : end - 1].argmax(-1)
        correct += int((pred == ids[0, start:end]).sum())
        total += end - start
    model.train()
    return correct / max(total, 1)


def peak_mem_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None):
    args = parse_args(argv)
    texts = validate(args, int(os.environ.get("WORLD_SIZE", "1")))
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm

    import hfcp

    acc = Accelerator(cpu=not torch.cuda.is_available())
    model, tok = load_model_and_tokenizer(args)
    docs = encode_docs(args, tok, texts)
    rows = pack(docs, args.seq_len)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # random-weight default: its embeddings carry no meaning yet, so they train too (a real checkpoint: LoRA only)
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      modules_to_save=None if args.model else ["embed_tokens", "lm_head"])
    torch.manual_seed(args.seed)
    model = get_peft_model(model, lora)
    hfcp.patch(model, cp_size=args.cp_size, strategy=args.strategy, loss_chunk=args.loss_chunk or None)
    dp_rank, dp_size = hfcp.data_parallel_rank_and_size(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    warmup = max(1, min(50, args.max_steps // 10))  # linear warm-up, then cosine decay to 10%
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.55 + 0.45 * math.cos(math.pi * min(s, args.max_steps) / args.max_steps)))
    start_step = 0
    out_dir = Path(args.output_dir)
    if args.resume_from:
        start_step = load_checkpoint(Path(args.resume_from), model, opt, sched)
    # the scheduler stays unprepared: accelerate would step it once per process, but every rank of a CP
    # group sees the same batch, so one optimizer step is one scheduler step
    model, opt = acc.prepare(model, opt)

    before = long_range_accuracy(model, tok, args, acc.device)
    acc.print(f"hfcp: {acc.num_processes} processes, dp={dp_size} x cp={acc.num_processes // dp_size}, "
              f"strategy={args.strategy}, {len(rows)} rows of {args.seq_len} tokens; key accuracy before: {before:.3f}")
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    metrics = open_metrics(out_dir / "metrics.jsonl", start_step) if acc.is_main_process else None
    bar = tqdm(range(start_step, args.max_steps), disable=not acc.is_main_process, desc="train")
    for step in bar:
        t0 = time.perf_counter()
        loss_sum = 0.0
        for m in range(args.grad_accum):
            batch = {k: v.to(acc.device) for k, v in
                     batches_for_step(rows, step, m, args.grad_accum, args.batch_size, dp_rank, dp_size).items()}
            sync = m == args.grad_accum - 1  # DDP all-reduces once, on the last micro-step
            with contextlib.nullcontext() if sync else acc.no_sync(model):
                out = model(**batch)
                acc.backward(out.loss / args.grad_accum)
            loss_sum += out.loss.item() / args.grad_accum
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        tokens = args.seq_len * args.batch_size * args.grad_accum * dp_size
        record = {"step": step + 1, "loss": loss_sum, "tokens_per_s": tokens / dt, "peak_mem_mb": peak_mem_mb(acc.device),
                  "lr": sched.get_last_lr()[0]}
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        bar.set_postfix(loss=f"{loss_sum:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", mem_mb=f"{record['peak_mem_mb']:.0f}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.max_steps:
            save_checkpoint(out_dir / f"checkpoint-{step + 1}", acc, model, opt, sched, step + 1)
    save_checkpoint(out_dir / f"checkpoint-{args.max_steps}", acc, model, opt, sched, args.max_steps)
    if acc.is_main_process:
        acc.unwrap_model(model).save_pretrained(out_dir / "adapter")
    same = adapter_identical_on_all_ranks(acc, model)
    after = long_range_accuracy(model, tok, args, acc.device)
    acc.print(f"key accuracy after: {after:.3f} (before {before:.3f}); adapter identical on all ranks: {same}; "
              f"adapter and metrics in {out_dir}")
    if acc.is_main_process:
        (out_dir / "summary.json").write_text(json.dumps(
            {"key_accuracy_before": before, "key_accuracy_after": after, "adapter_identical_on_all_ranks": same}))
        plot_losses(out_dir)
    acc.wait_for_everyone()


def adapter_identical_on_all_ranks(acc, model) -> bool:
    """The main process saves the adapter; check that every rank holds bit-identical trained weights."""
    from accelerate.utils import gather_object
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(acc.unwrap_model(model))
    digest = hashlib.sha256(b"".join(t.detach().cpu().contiguous().numpy().tobytes() for _, t in sorted(state.items())))
    digests = gather_object([digest.hexdigest()])
    return len(set(digests)) == 1


def open_metrics(path: Path, start_step: int):
    """A fresh run starts the file anew; a resumed run keeps the records up to its start step."""
    kept = []
    if start_step and path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
    f = open(path, "w")
    f.writelines(line + "\n" for line in kept)
    return f


def save_checkpoint(path: Path, acc, model, opt, sched, step: int):
    """Adapter, optimizer, scheduler, step and RNG states (main process writes; all ranks hold the same)."""
    acc.wait_for_everyone()
    if acc.is_main_process:
        path.mkdir(parents=True, exist_ok=True)
        acc.unwrap_model(model).save_pretrained(path / "adapter")
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "rng": torch.get_rng_state(), "py_rng": random.getstate()}, path / "state.pt")
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    acc.wait_for_everyone()


def load_checkpoint(path: Path, model, opt, sched) -> int:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(path / "adapter" / "adapter_model.safetensors"))
    state = torch.load(path / "state.pt", weights_only=False)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    random.setstate(state["py_rng"])
    return json.loads((path / "trainer_state.json").read_text())["step"]


def plot_losses(out_dir: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping loss_curve.png (pip install matplotlib)")
        return
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    plt.figure(figsize=(6, 3.5))
    plt.plot([r["step"] for r in recs], [r["loss"] for r in recs])
    plt.xlabel("optimizer step")
    plt.ylabel("loss")
    plt.title("LoRA fine-tune under hfcp")
    plt.tight_layout()
    plt.savefig(out_dir / "loss_curve.png", dpi=100)


if __name__ == "__main__":
    main()
