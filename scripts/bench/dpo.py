"""Peak memory per rank of one DPO step on a pair of long documents: stock trl.DPOTrainer in one process vs
HfcpDPOTrainer at cp 2 (CPU).

    python scripts/bench/dpo.py                          # L = 8192 and 16384 tokens per row
    python scripts/bench/dpo.py --lengths 8192 --layers 2
    python scripts/bench/dpo.py --quick                  # L = 2048

The model is Llama-shaped and small (4 layers by default, hidden 256) with a real-size vocabulary (32,000 tokens by
default), so the output head weighs as it does in practice; fp32, full fine-tuning, TRL's default gradient
checkpointing, an explicit reference model that differs from the policy (so the loss is not log 2, and must agree
across the runs). The batch is one preference pair, chosen and rejected each `L` tokens (a prompt of L/4, a
completion of 3L/4). The step is what DPOTrainer.training_step computes: the loss (the policy's forward over both
rows, the reference's without gradient) and its backward; measured as the growth of resident memory over the models
(hfcp.testing.memory.PeakRSS), the worst rank. One process runs twice: stock DPOTrainer (TRL's fused head, whose CPU
fallback scores 4096 tokens x the vocabulary at a time) and DPOTrainer with hfcp's fused head (1024 tokens at a
time: what CP itself saves is the ratio to this one). cp 1 runs with as many threads as cp 2 has processes. Prints
a markdown table and writes runs/bench/bench_dpo.json (--json). --side-by-side starts the three measurements of a
length at the same time (a quicker check of the script: each process's memory growth is its own, but the step
times then share the cores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    V = vocab_size
    vocab = {f"w{i}": i for i in range(V - 3)} | {"<pad>": V - 3, "<eos>": V - 2, "<unk>": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _model(seq_len: int, layers: int, vocab_size: int, seed: int):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=seq_len)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def worker(args) -> None:
    """One measurement (its own process; torchrun at cp 2): prints RESULT {json} from rank 0."""
    import datasets
    import torch
    import torch.distributed as dist
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from hfcp.testing.memory import PeakRSS, fix_mmap_threshold

    fix_mmap_threshold()
    torch.set_num_threads(args.threads)
    if args.cp > 1:
        dist.init_process_group("gloo")
    L, prompt = args.seq_len, args.seq_len // 4
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, args.vocab - 3, (n,), generator=g).tolist()  # noqa: E731
    pair = {"prompt_ids": ids(prompt), "chosen_ids": ids(L - prompt), "rejected_ids": ids(L - prompt)}
    tok = _tokenizer(args.vocab)
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)([pair])  # (2, L): chosen, rejected
    data = datasets.Dataset.from_list([{"prompt": "w1 w2", "chosen": " w3", "rejected": " w4"}])  # (unused rows)
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(output_dir=out, per_device_train_batch_size=1, report_to=[], bf16=False, use_cpu=True,
                           max_length=None, gradient_checkpointing=not args.no_checkpointing, disable_tqdm=True)
        # the reference another model than the policy: the loss is not log 2, and must agree across the runs
        kw = dict(model=_model(L, args.layers, args.vocab, 0), ref_model=_model(L, args.layers, args.vocab, 1),
                  args=config, processing_class=tok,
                  train_dataset=data)
        if args.cp > 1:
            from hfcp.integrations import HfcpDPOTrainer

            trainer = HfcpDPOTrainer(**kw, cp_size=args.cp, check_inputs=False)
        else:
            trainer = DPOTrainer(**kw)
            if args.hfcp_head:  # one process with hfcp's chunked head: isolates what CP itself saves
                from hfcp.integrations.fused_head import install_cp_fused_head

                install_cp_fused_head(trainer.model)
                install_cp_fused_head(trainer.ref_model)
    model = trainer.model
    model.train()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=config.gradient_checkpointing_kwargs)

    def step() -> float:
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss)

    loss = step()  # warm-up
    mems, times = [], []
    for _ in range(args.repeats):
        with PeakRSS(torch.device("cpu")) as mem:
            t = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t)
        mems.append(mem.growth / 2**20)
    result = {"seq_len": L, "cp": args.cp, "head": "hfcp" if args.cp > 1 or args.hfcp_head else "trl",
              "layers": args.layers, "peak_mem_mb": max(mems), "time_s": min(times), "loss": loss}
    if args.cp > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result["peak_mem_mb"])
        result["peak_mem_mb"] = max(gathered)  # the worst rank
        if dist.get_rank() != 0:
            return
    print("RESULT " + json.dumps(result), flush=True)


def start(seq_len: int, cp: int, args, hfcp_head: bool, out) -> tuple[list, subprocess.Popen]:
    """(the command, its process) of one measurement, its output going to the open files out = (stdout, stderr)."""
    flags = ["--worker", "--seq-len", str(seq_len), "--cp", str(cp), "--repeats", str(args.repeats),
             "--threads", str(1 if cp > 1 else args.cp), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    flags += (["--no-checkpointing"] if args.no_checkpointing else []) + (["--hfcp-head"] if hfcp_head else [])
    cmd = [sys.executable, str(Path(__file__).resolve()), *flags]
    if cp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return cmd, subprocess.Popen(cmd, stdout=out[0], stderr=out[1], text=True, env=env)


def measure_length(seq_len: int, args):
    """Yields the three measurements of one length (stock, hfcp's head, cp), one after the other or (--side-by-side)
    started at once; output goes to temporary files (a full pipe would stall a process while another is waited for).
    A failed one (RuntimeError) stops those still running."""
    runs = ((1, False), (1, True), (args.cp, False))
    started = []
    with tempfile.TemporaryDirectory() as tmp:
        outs = [(open(Path(tmp) / f"{i}.out", "w+"), open(Path(tmp) / f"{i}.err", "w+")) for i in range(len(runs))]
        try:
            for (cp, hfcp_head), out in zip(runs, outs):
                started.append(start(seq_len, cp, args, hfcp_head, out))
                if not args.side_by_side:
                    yield finish(*started[-1], out, args.timeout)
            if args.side_by_side:
                for (cmd, proc), out in zip(started, outs):
                    yield finish(cmd, proc, out, args.timeout)
        finally:
            for _, proc in started:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for f in (f for out in outs for f in out):
                f.close()


def finish(cmd: list, proc: subprocess.Popen, out, timeout: float) -> dict:
    """The RESULT of a started measurement, once it ends; RuntimeError with its stderr if it failed."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    stdout, stderr = (f.seek(0) or f.read() for f in out)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(results: list[dict]) -> str:
    rows = ["| tokens per row (chosen, rejected) | processes | peak MB per rank | x stock | step s | loss |",
            "|---|---|---|---|---|---|"]
    base = {r["seq_len"]: r for r in results if r["cp"] == 1 and r["head"] == "trl"}
    for r in results:
        b = base.get(r["seq_len"])
        ratio = f"{r['peak_mem_mb'] / b['peak_mem_mb']:.2f}" if b else "-"
        who = {"trl": "1 (stock DPOTrainer)", "hfcp": "1 (DPOTrainer, hfcp's fused head)"}[r["head"]] if r["cp"] == 1 \
            else f"cp {r['cp']} (HfcpDPOTrainer)"
        rows.append(f"| {r['seq_len']} | {who} | {r['peak_mem_mb']:.0f} | {ratio} | {r['time_s']:.1f} "
                    f"| {r['loss']:.6f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="L = 2048 unless --lengths is given")
    ap.add_argument("--no-checkpointing", action="store_true", help="gradient_checkpointing=False")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size of the model")
    ap.add_argument("--json", default="runs/bench/bench_dpo.json", help="where to write the results")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--side-by-side", action="store_true",
                    help="start the measurements of a length at the same time (step times then share the cores)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--hfcp-head", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick and args.lengths == [8192, 16384]:
        args.lengths = [2048]
    results = []
    for L in args.lengths:
        for result in measure_length(L, args):
            results.append(result)
            print(json.dumps(result), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
