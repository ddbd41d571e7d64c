"""Small end-to-end example: a tiny Llama, one long sequence, loss and gradients under CP equal to one device.
(The training forward uses hfcp's chunked loss, so out.logits is None: hfcp never builds the whole logits.)

    accelerate launch --multi_gpu --num_processes 2 scripts/examples/example_cp.py --seq-len 2048
    python scripts/examples/example_cp.py            # one process: runs unchanged
"""
import argparse
import time

import torch
import transformers
from accelerate import Accelerator

import hfcp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    acc = Accelerator(cpu=not torch.cuda.is_available())
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    hfcp.patch(model, strategy=args.strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, args.seq_len), generator=g).to(acc.device)
    ids[:, args.seq_len // 2 :] = ids[:, : args.seq_len - args.seq_len // 2]  # second half repeats the first
    for step in range(args.steps):
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        acc.backward(out.loss)
        opt.step()
        opt.zero_grad()
        state = hfcp.cp_state(model)  # None in one process: the model runs unchanged
        local = state.step.layout.local_len if state is not None else ids.shape[1]
        acc.print(f"step {step}: loss {out.loss.item():.5f}  local tokens {local} of {ids.shape[1]}  "
                  f"{time.perf_counter() - t:.2f}s  (processes: {acc.num_processes})")


if __name__ == "__main__":
    main()
