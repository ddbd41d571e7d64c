"""LoRA fine-tuning on long documents, context-parallel with hfcp, on hfcp.integrations.HfcpTrainer (the stock
transformers Trainer with each sequence split over a CP group), launched with accelerate.

    accelerate launch --multi_gpu --num_processes 2 scripts/finetune_lora.py
    python scripts/finetune_lora.py            # one process: the same losses

Defaults need nothing from the network: a tiny Llama built from scripts/configs/tiny_llama.json and a
generated corpus whose documents end by repeating a key given at their start (long-range metric: the
accuracy of those key characters, generated after held-out documents).

    accelerate launch --multi_gpu --num_processes 2 scripts/finetune_lora.py --task video

--task video: a tiny Qwen2-VL (scripts/configs/tiny_qwen2_vl.json, random weights) on generated videos, one
frame of which is coloured; the question after the video asks for that colour (metric: the share of held-out
videos answered right, scripts/video_task.py).

    accelerate launch --multi_gpu --num_processes 2 scripts/finetune_lora.py --task dpo

--task dpo: DPO (hfcp.integrations.HfcpDPOTrainer) on the embedded tiny Llama with preference pairs after key
documents: the chosen answer repeats the document's key, the rejected one gives a wrong key (metric: the share of
held-out pairs whose chosen answer the policy gives the higher log-probability, scripts/dpo_task.py).

    accelerate launch --multi_gpu --num_processes 2 scripts/finetune_lora.py --task grpo

--task grpo: GRPO (hfcp.integrations.HfcpGRPOTrainer) on the embedded tiny Llama, after a short supervised warm-up:
the policy completes key documents and a rule-based reward scores the share of the key it repeats (metrics: the
mean reward and the exact-key accuracy of greedy completions after held-out prompts, scripts/grpo_task.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

import torch

from finetune_data import (
    LONG_SHARE, MIN_SEQ_LEN, ByteTokenizer, curriculum_rows, encode_document, key_document, key_span, load_texts, pack,
)

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny_llama.json"
TASK_DEFAULTS = {"text": dict(seq_len=2048, batch_size=1, lr=2e-3, max_steps=1200, eval_docs=8),
                 "video": dict(seq_len=None, batch_size=8, lr=3e-3, max_steps=300, eval_docs=64),
                 "dpo": dict(seq_len=256, batch_size=8, lr=5e-3, max_steps=250, eval_docs=64),
                 "grpo": dict(seq_len=128, batch_size=16, lr=3e-4, max_steps=100, eval_docs=64)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["text", "video", "dpo", "grpo"], default="text",
                    help="text: long documents (key copy); video: a tiny VLM answers a question about a video; "
                         "dpo: preference pairs after long documents (the right key preferred over a wrong one); "
                         "grpo: completions after long documents, rewarded for repeating the key")
    ap.add_argument("--model", help="local checkpoint directory (default: embedded tiny Llama, random weights)")
    ap.add_argument("--data", help="directory of .txt files or .jsonl with 'text' (default: embedded corpus)")
    ap.add_argument("--seq-len", type=int,
                    help="packed row length (default 2048; dpo: a pair's rows, 256; grpo: prompt and completion, 128)")
    ap.add_argument("--frames", type=int, default=16, help="--task video: frames per video (4 tokens each)")
    ap.add_argument("--batch-size", type=int,
                    help="rows per CP group per micro-step (default: text 1, video 8; dpo: 8 pairs; grpo: 16 "
                         "completions)")
    ap.add_argument("--cp-size", type=int, default=None, help="ranks per CP group (default: all processes)")
    ap.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses", "usp"])
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--beta", type=float, help="--task dpo: DPO's beta, the scale of its log-ratios (default 0.5)")
    ap.add_argument("--rpo-alpha", type=float,
                    help="--task dpo: weight of the chosen answer's NLL added to the DPO loss (RPO; default 1; 0: DPO)")
    ap.add_argument("--sft-steps", type=int,
                    help="--task grpo: supervised warm-up steps on the answers before GRPO (default 150)")
    ap.add_argument("--num-generations", type=int,
                    help="--task grpo: completions sampled per prompt, a group of GRPO (default 4)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: text 2e-3, dpo 5e-3, video 3e-3, grpo 3e-4)")
    ap.add_argument("--max-steps", type=int,
                    help="optimizer steps (default: text 1200, video 300, dpo 250, grpo 100 after the warm-up)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--loss-chunk", type=int, default=1024,
                    help="tokens per chunk of the loss: logits are never materialised whole (0: plain logits)")
    ap.add_argument("--tiled-mlp", type=int, default=0,
                    help="tokens per tile of each decoder layer's MLP in training (hfcp.patch's tiled_mlp: the MLP's "
                         "intermediates exist for one tile at a time; 0: whole)")
    ap.add_argument("--offload-checkpoints", action="store_true",
                    help="with --gradient-checkpointing: each layer's checkpoint held in host memory (hfcp.patch's "
                         "offload_checkpoints; on CPU it saves nothing)")
    ap.add_argument("--output-dir", default="runs/finetune")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps (0: only at the end)")
    ap.add_argument("--resume-from", help="a checkpoint directory written by --save-every")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-docs", type=int,
                    help="held-out documents / videos / pairs evaluated (default: text 8, video, dpo 64)")
    ap.add_argument("--pp", type=int,
                    help="pipeline stages (hfcp.pipeline, 1F1B): the decoder layers split over --pp stages of cp ranks "
                         "each (cp: --cp-size, default processes / pp); the text task's LoRA "
                         "(scripts/pipeline_finetune.py)")
    ap.add_argument("--microbatches", type=int,
                    help="--pp: microbatches of a step's rows through the stages (default: --batch-size, one row "
                         "each)")
    ap.add_argument("--full-finetune", action="store_true",
                    help="train every parameter (no LoRA), sharded with FSDP2 over all processes "
                         "(scripts/full_finetune.py)")
    args = ap.parse_args(argv)
    if args.task == "video":
        given = [flag for flag, value in (("--model", args.model), ("--data", args.data), ("--seq-len", args.seq_len),
                                          ("--full-finetune", args.full_finetune)) if value]
        if given:
            fail(f"{', '.join(given)}: the video task runs the embedded tiny VLM on generated videos, whose length "
                 f"follows --frames; {given[0]} is for --task text")
        if args.frames < 1:
            fail(f"--frames {args.frames} must be positive")
    check_dpo_options(args)
    check_grpo_options(args)
    for name, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_pipeline_options(args)
    return args


def task_options(args, task: str, options: dict) -> bool:
    """Whether `task` is the one run; options ({flag: value}, None when not given) belong to it and are refused
    with another task."""
    given = [flag for flag, value in options.items() if value is not None]
    if args.task != task and given:
        fail(f"{', '.join(given)}: options of --task {task} (the task is {args.task})")
    return args.task == task


def check_dpo_options(args) -> None:
    """--beta / --rpo-alpha belong to --task dpo (set to their defaults there); the dpo task refuses what it ignores."""
    if not task_options(args, "dpo", {"--beta": args.beta, "--rpo-alpha": args.rpo_alpha}):
        return
    args.beta = 0.5 if args.beta is None else args.beta
    args.rpo_alpha = 1.0 if args.rpo_alpha is None else args.rpo_alpha
    if args.beta <= 0 or args.rpo_alpha < 0:
        fail(f"--beta {args.beta} must be positive and --rpo-alpha {args.rpo_alpha} at least 0")
    given = [flag for flag, value in (("--model", args.model), ("--data", args.data),
                                      ("--full-finetune", args.full_finetune)) if value]
    if given:
        fail(f"{', '.join(given)}: the dpo task trains the embedded tiny Llama with LoRA on preference pairs generated "
             f"after key documents; {given[0]} is for --task text")


def check_pipeline_options(args) -> None:
    """--pp / --microbatches: the text task's LoRA mode, rows that divide into the microbatches."""
    if args.pp is None:
        if args.microbatches is not None:
            fail(f"--microbatches {args.microbatches}: an option of --pp (pipeline stages)")
        return
    given = [flag for flag, value in (("--task", args.task != "text"), ("--full-finetune", args.full_finetune),
                                      ("--save-every", args.save_every), ("--resume-from", args.resume_from)) if value]
    if given:
        fail(f"{', '.join(given)}: --pp runs the text task's LoRA fine-tune in one go (no checkpoints to resume)")
    args.microbatches = args.microbatches or args.batch_size
    if args.pp < 1 or args.microbatches < 1 or args.batch_size % args.microbatches:
        fail(f"--pp {args.pp} and --microbatches {args.microbatches} must be positive, and the microbatches must "
             f"divide --batch-size {args.batch_size}")


def check_grpo_options(args) -> None:
    """--sft-steps / --num-generations belong to --task grpo (set to their defaults there); the grpo task refuses what
    it ignores."""
    if not task_options(args, "grpo", {"--sft-steps": args.sft_steps, "--num-generations": args.num_generations}):
        return
    args.sft_steps = 150 if args.sft_steps is None else args.sft_steps
    args.num_generations = 4 if args.num_generations is None else args.num_generations
    if args.sft_steps < 1:
        fail(f"--sft-steps {args.sft_steps} must be positive (the random model repeats no key: without a warm-up every "
             f"reward is 0 and GRPO trains nothing)")
    if args.num_generations < 2:
        fail(f"--num-generations {args.num_generations} must be at least 2 (GRPO's advantages compare the completions "
             f"of one prompt)")
    batch = args.batch_size or TASK_DEFAULTS["grpo"]["batch_size"]
    if batch % args.num_generations:
        fail(f"--batch-size {batch} must be a multiple of --num-generations {args.num_generations} (a step's "
             f"completions are whole groups of one prompt each)")
    given = [flag for flag, value in (("--model", args.model), ("--data", args.data),
                                      ("--full-finetune", args.full_finetune), ("--resume-from", args.resume_from),
                                      ("--save-every", args.save_every)) if value]
    if given:
        fail(f"{', '.join(given)}: the grpo task warms up and trains the embedded tiny Llama with LoRA in one run, on "
             f"prompts generated from key documents; {given[0]} is for --task text")


def fail(msg: str):
    raise SystemExit(f"finetune_lora.py: error: {msg}")


def validate(args, world: int) -> list[str] | None:
    """One-line errors before anything starts. Returns the texts of --data (None: embedded corpus)."""
    if args.model and not (Path(args.model) / "config.json").is_file():
        fail(f"--model {args.model}: no checkpoint directory with a config.json there")
    if args.resume_from and not (Path(args.resume_from) / "trainer_state.json").is_file():
        fail(f"--resume-from {args.resume_from}: no trainer_state.json there (not a checkpoint of this script)")
    if args.full_finetune and (args.resume_from or args.save_every):
        fail("--full-finetune saves the trained model once, at the end: --save-every and --resume-from are for the "
             "LoRA mode")
    stages = args.pp or 1
    cp = args.cp_size or max(1, world // stages)
    if cp < 1 or world % cp:
        fail(f"--cp-size {args.cp_size} must divide the number of processes ({world})")
    if args.pp and world > 1 and world % (stages * cp):
        fail(f"--pp {args.pp} x cp {cp} must divide the number of processes ({world})")
    if args.offload_checkpoints and not args.gradient_checkpointing:
        fail("--offload-checkpoints holds the checkpoints of --gradient-checkpointing in host memory: add "
             "--gradient-checkpointing")
    if args.tiled_mlp < 0:
        fail(f"--tiled-mlp {args.tiled_mlp} must be a number of tokens per tile (0: off)")
    if args.grad_accum < 1 or args.max_steps < 1 or args.batch_size < 1:
        fail(f"--grad-accum {args.grad_accum}, --max-steps {args.max_steps}, --batch-size {args.batch_size} must be "
             f"positive")
    if args.task == "video":
        return None
    least, why = (128, "a key document, its question and answer") if args.task in ("dpo", "grpo") else (
        MIN_SEQ_LEN, "a row that holds one of the embedded corpus's long documents, and a held-out key document "
                     "for the long-range accuracy")
    if args.seq_len < least:
        fail(f"--seq-len {args.seq_len} must be at least {least} ({why})")
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


def video_setup(args):
    """--task video: the tiny Qwen2-VL, the generated videos (one per row and step; every rank of a CP group gets
    the same rows), their collator and the held-out answer accuracy."""
    import transformers
    import video_task

    config = video_task.load_config()
    args.seq_len = video_task.seq_len(config, args.frames)
    torch.manual_seed(args.seed)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    dataset = video_task.Videos(max(64, args.max_steps * args.batch_size * args.grad_accum), args.frames, args.seed,
                                config)
    return model, dataset, video_task.collate, (
        "answer", lambda m, device: video_task.answer_accuracy(m, args.frames, args.eval_docs, args.seed, device))


SHORT_SHARE = 0.5  # of the steps, on the embedded curriculum's short documents


def training_rows(args, tok, texts, world: int) -> list:
    """The packed rows the text task trains on, in the order it reads them (args.curriculum: keep it). --data: its
    documents, read in a seeded shuffle. The embedded corpus: a curriculum (finetune_data.curriculum_rows), the first
    SHORT_SHARE of the steps on short documents, the rest on long ones, read in order."""
    args.curriculum = texts is None
    if texts is not None:
        return pack([encode_document(tok, t) for t in texts], args.seq_len)
    cp = args.cp_size or max(1, world // (args.pp or 1))
    per_step = args.batch_size * args.grad_accum * max(1, world // ((args.pp or 1) * cp))  # (x data groups)
    short = round(args.max_steps * SHORT_SHARE) * per_step
    return curriculum_rows(tok, args.seq_len, short, args.max_steps * per_step - short, args.seed)


@torch.no_grad()
def long_range_accuracy(model, tok, args, device) -> float:
    """Accuracy of the final key of held-out documents, generated greedily after the document: the key is given
    only at the start of each document, so generating it needs attention across the whole prompt. Under CP the
    prompt is prefilled over the group and each token decoded against the KV cache spread over it (hfcp's
    generation); a wrong token stays in the prompt of the next (stricter than reading teacher-forced logits)."""
    rng = random.Random(10_000 + args.seed)
    correct = total = 0
    model.eval()
    for _ in range(args.eval_docs):
        text, key = key_document(rng, int(args.seq_len * LONG_SHARE))
        ids, start, end = key_span(tok, text, key)
        ids = torch.tensor([ids[: args.seq_len]], device=device)
        end = min(end, ids.shape[1])
        prompt = ids[:, :start]
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=end - start, min_new_tokens=end - start,
                             pad_token_id=getattr(tok, "pad_token_id", None) or 0)
        correct += int((out[0, start:end] == ids[0, start:end]).sum())
        total += end - start
    model.train()
    return correct / max(total, 1)


def peak_mem_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Rows(torch.utils.data.Dataset):
    """Packed rows as the Trainer's dataset: input_ids, position_ids (a reset starts a document), labels."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return dict(zip(("input_ids", "position_ids", "labels"), self.rows[i]))


def make_recorder(out_dir: Path, start_step: int, tokens_per_step: int, device, is_main: bool,
                  name: str = "metrics.jsonl", desc: str = "train"):
    """A TrainerCallback: `name` in out_dir (step, loss, tokens_per_s, peak_mem_mb, lr per optimizer step, the mean
    reward where GRPO logs one, cp_imbalance under CP) on the main process, and a progress bar that shows them
    instead of printing every log line."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.file = open_metrics(out_dir / name, start_step) if is_main else None
            self.bar, self.t0, self.step_s = None, None, None

        def on_train_begin(self, args, state, control, **kw):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, disable=not is_main, desc=desc)

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s = time.perf_counter() - self.t0
            self.bar.update(1)

        def on_log(self, args, state, control, logs=None, **kw):
            if "loss" not in (logs or {}):
                return
            record = {"step": state.global_step, "loss": logs["loss"], "tokens_per_s": tokens_per_step / self.step_s,
                      "peak_mem_mb": peak_mem_mb(device), "lr": logs["learning_rate"]}
            if "reward" in logs:  # GRPO: the mean reward of the step's completions
                record["reward"] = logs["reward"]
            if "cp_imbalance" in logs:  # under CP: attention work max / mean over the ranks (1.0: even)
                record["cp_imbalance"] = logs["cp_imbalance"]
            if self.file:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            imbalance = {"imbalance": f"{record['cp_imbalance']:.3f}"} if "cp_imbalance" in record else {}
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mem_mb=f"{record['peak_mem_mb']:.0f}", **imbalance)

        def on_train_end(self, args, state, control, **kw):
            self.bar.close()
            if self.file:
                self.file.close()

    return Recorder()


def main(argv=None):
    args = parse_args(argv)
    texts = validate(args, int(os.environ.get("WORLD_SIZE", "1")))
    from peft import get_peft_model
    from transformers import TrainingArguments
    from transformers.trainer_callback import ProgressCallback

    import hfcp
    from hfcp.integrations import HfcpTrainer

    if args.task == "video":
        model, dataset, collate, metric = video_setup(args)
    elif args.task in ("dpo", "grpo"):
        model, _ = load_model_and_tokenizer(args)  # its data and metric: with the trainer, below
    else:
        model, tok = load_model_and_tokenizer(args)
        rows = training_rows(args, tok, texts, int(os.environ.get("WORLD_SIZE", "1")))
        if args.full_finetune:
            import full_finetune

            full_finetune.train(args, model, tok, rows, Path(args.output_dir), sys.modules[__name__])
            if int(os.environ.get("RANK", "0")) == 0:
                plot_losses(Path(args.output_dir))
            return
        if args.pp:
            import pipeline_finetune

            pipeline_finetune.train(args, model, tok, rows, Path(args.output_dir), sys.modules[__name__],
                                    lora_config(args))
            if int(os.environ.get("RANK", "0")) == 0:
                plot_losses(Path(args.output_dir))
            return
        dataset, collate = Rows(rows), None
        metric = ("key", lambda m, device: long_range_accuracy(m, tok, args, device))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = lora_config(args)
    out_dir = Path(args.output_dir)
    training = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=max(1, min(50, args.max_steps // 10)),
        max_grad_norm=1.0, weight_decay=0.0, logging_steps=1, save_strategy="steps",
        save_steps=args.save_every or args.max_steps, seed=args.seed, data_seed=args.seed, report_to=[],
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=False, ddp_find_unused_parameters=False,
        train_sampling_strategy="sequential" if getattr(args, "curriculum", False) else "random",
    )
    given = {"cp_size": args.cp_size} if args.cp_size else {}  # else the whole world, or an accelerate layout's cp
    hfcp_options = dict(**given, strategy=args.strategy, loss_chunk=args.loss_chunk or None,
                        tiled_mlp=args.tiled_mlp or False, offload_checkpoints=args.offload_checkpoints)
    if args.task == "dpo":  # DPOTrainer makes the LoRA model itself (its reference: the adapter disabled)
        import dpo_task

        n_pairs = max(64, args.max_steps * args.batch_size * args.grad_accum)  # the same pairs for any layout
        trainer, tok = dpo_task.make_trainer(model, lora, training, args, n_pairs, **hfcp_options)
        model, dataset = trainer.model, trainer.train_dataset
        metric = ("preference", lambda m, device: dpo_task.preference_accuracy(m, tok, args.seq_len, args.eval_docs,
                                                                               args.seed, device))
    elif args.task == "grpo":  # a supervised warm-up first (under the same CP groups), then HfcpGRPOTrainer
        import grpo_task

        trainer, tok, first = grpo_task.make_trainer(model, lora, training, args, sys.modules[__name__], **hfcp_options)
        model, dataset = trainer.model, trainer.train_dataset
        metric = ("key", lambda m, device: grpo_task.key_scores(m, tok, args.seq_len, args.eval_docs, args.seed,
                                                                device))
    else:
        torch.manual_seed(args.seed)
        model = get_peft_model(model, lora)
        trainer = HfcpTrainer(model=model, args=TrainingArguments(**training), train_dataset=dataset,
                              data_collator=collate, **hfcp_options)
    acc, device = trainer.accelerator, trainer.args.device
    dp_rank, dp_size = hfcp.data_parallel_rank_and_size(model)
    start_step = json.loads((Path(args.resume_from) / "trainer_state.json").read_text())["global_step"] \
        if args.resume_from else 0
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    trainer.remove_callback(ProgressCallback)  # the recorder's bar shows loss, tokens/s and memory instead
    rows = 2 if args.task == "dpo" else 1  # a DPO pair: its chosen and its rejected row, each up to --seq-len
    trainer.add_callback(make_recorder(out_dir, start_step, rows * args.seq_len * args.batch_size * args.grad_accum
                                       * dp_size, device, acc.is_main_process))

    name, accuracy = metric
    scores = lambda value: value if isinstance(value, dict) else {f"{name}_accuracy": value}  # noqa: E731
    before = scores(accuracy(model, device))
    acc.print(f"hfcp: {acc.num_processes} processes, dp={dp_size} x cp={acc.num_processes // dp_size}, "
              f"strategy={args.strategy}, {len(dataset)} {'pairs of rows up to' if rows == 2 else 'rows of'} "
              f"{args.seq_len} tokens; {described(before)} before")
    trainer.train(resume_from_checkpoint=args.resume_from)
    if acc.is_main_process:
        model.save_pretrained(out_dir / "adapter")
    same = adapter_identical_on_all_ranks(acc, model)
    after = scores(accuracy(model, device))
    acc.print(f"{described(after)} after ({described(before)} before); adapter identical on all ranks: {same}; "
              f"adapter and metrics in {out_dir}")
    if acc.is_main_process:
        summary = {f"{k}_before": v for k, v in before.items()} | {f"{k}_after": v for k, v in after.items()}
        if args.task == "grpo":  # the random model's, before the warm-up
            summary |= {f"{k}_before_warmup": v for k, v in first.items()}
        (out_dir / "summary.json").write_text(json.dumps(summary | {"adapter_identical_on_all_ranks": same}))
        plot_losses(out_dir)
    acc.wait_for_everyone()


def lora_config(args):
    """LoRA on every linear of the decoder layers; the random-weight default's embeddings carry no meaning yet, so
    they train too (a real checkpoint: LoRA only)."""
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      modules_to_save=None if args.model else ["embed_tokens", "lm_head"])


def described(scores: dict) -> str:
    """"key accuracy 0.125, ...": each score's name in words, its value."""
    return ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in scores.items())


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
    plt.plot([r["step"] for r in recs], [r["loss"] for r in recs], label="loss")
    if "reward" in recs[0]:  # GRPO: its loss hovers about 0; the reward is what rises
        plt.plot([r["step"] for r in recs], [r["reward"] for r in recs], label="mean reward")
        plt.legend()
    plt.xlabel("optimizer step")
    plt.ylabel("loss" if "reward" not in recs[0] else "loss, mean reward")
    plt.title("fine-tune under hfcp")
    plt.tight_layout()
    plt.savefig(out_dir / "loss_curve.png", dpi=100)


if __name__ == "__main__":
    main()
