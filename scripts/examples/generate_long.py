"""Generate after a long prompt, the prompt and its KV cache spread over the processes (docs/how-to/generation.md).

    accelerate launch --multi_gpu --num_processes 2 scripts/examples/generate_long.py --model runs/smollm2 \
        --prompt-file doc.txt --max-new-tokens 64
    # a tiny random Llama:
    torchrun --standalone --nproc-per-node 2 scripts/examples/generate_long.py --prompt-tokens 8192
    python scripts/examples/generate_long.py                      # one process: the model runs unchanged

The output is streamed to the terminal by the first process; at the end it prints the time to the first token
(the prompt's prefill), the decode speed and each rank's KV-cache bytes. Every process must get the same prompt
(the file is read by each); sampling (--sample) uses one seed on every process.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import transformers
from accelerate import Accelerator
from transformers.generation.streamers import BaseStreamer

import hfcp
from hfcp.inference.kv_cache import ShardedKVCache


class TimedStreamer(BaseStreamer):
    """Prints each new token as it comes (decoded with the tokenizer, or as ids) and records when it came."""

    def __init__(self, tokenizer, show: bool):
        self.tokenizer, self.show = tokenizer, show
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() puts the prompt first
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        if self.show:
            ids = value.flatten().tolist()
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else " " + " ".join(map(str, ids))
            print(text, end="", flush=True)

    def end(self):
        if self.show:
            print(flush=True)


def load(args, device):
    """(model, tokenizer or None): a checkpoint directory, or a tiny random Llama."""
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError):
            tokenizer = None
    else:
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=args.width, intermediate_size=2 * args.width,
                                       num_hidden_layers=args.layers, num_attention_heads=max(4, args.width // 32),
                                       num_key_value_heads=max(2, args.width // 64), max_position_embeddings=1 << 17)
        torch.manual_seed(0)
        model, tokenizer = transformers.LlamaForCausalLM(cfg), None
    return model.to(device).eval(), tokenizer


def prompt_ids(args, tokenizer, vocab: int) -> torch.Tensor:
    if args.prompt_file:
        text = open(args.prompt_file, encoding="utf-8").read()
        if tokenizer is None:
            raise SystemExit("examples/generate_long.py: --prompt-file needs --model with a tokenizer")
        return tokenizer(text, return_tensors="pt").input_ids
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (1, args.prompt_tokens), generator=g)


def peak_mb(device) -> float:
    """This process's peak memory: CUDA's allocated peak, or on CPU the peak RSS (weights and runtime included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def every_rank(value: float) -> list[float]:
    if not torch.distributed.is_initialized():
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a checkpoint directory (default: a tiny random Llama)")
    ap.add_argument("--prompt-file", help="the prompt, a text file (needs --model with a tokenizer)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="without --prompt-file: random ids")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses", "usp"])
    ap.add_argument("--sample", action="store_true", help="sample (one seed on every process) instead of greedy")
    ap.add_argument("--check", action="store_true", help="also generate unpatched in each process and compare")
    ap.add_argument("--width", type=int, default=64, help="the tiny random Llama's hidden size (without --model)")
    ap.add_argument("--layers", type=int, default=2, help="its layers")
    ap.add_argument("--json", help="write the summary here (first process)")
    args = ap.parse_args(argv)

    acc = Accelerator(cpu=not torch.cuda.is_available())
    model, tokenizer = load(args, acc.device)
    ids = prompt_ids(args, tokenizer, model.config.vocab_size).to(acc.device)
    hfcp.patch(model, strategy=args.strategy)
    streamer = TimedStreamer(tokenizer, show=acc.is_main_process)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, streamer=streamer,
                    return_dict_in_generate=True, pad_token_id=model.config.pad_token_id or 0)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings)
    cache = out.cache
    kv = cache.bytes_held() if isinstance(cache, ShardedKVCache) else \
        sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    times = streamer.times
    summary = {"prompt_tokens": ids.shape[1], "new_tokens": len(times), "processes": acc.num_processes,
               "time_to_first_token_s": times[0] - start,
               "decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None,
               "kv_cache_mb_per_rank": every_rank(kv / 2**20), "tokens": out.sequences[0, ids.shape[1]:].tolist(),
               "peak_mem_mb_per_rank": every_rank(peak_mb(acc.device))}
    if args.check:
        hfcp.unpatch(model)
        torch.manual_seed(0)
        with torch.no_grad():
            alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   **{**settings, "streamer": None})
        summary["same_as_unpatched"] = torch.equal(alone.sequences, out.sequences)
    if acc.is_main_process:
        rate = summary["decode_tokens_per_s"]
        print(f"prompt {summary['prompt_tokens']} tokens over {acc.num_processes} process(es): first token after "
              f"{summary['time_to_first_token_s']:.2f} s, then {rate or 0:.1f} tokens/s; KV cache per rank "
              f"{max(summary['kv_cache_mb_per_rank']):.1f} MB"
              + (f"; the same tokens as unpatched: {summary['same_as_unpatched']}" if args.check else ""))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
