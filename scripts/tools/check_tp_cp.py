"""Tensor parallelism x CP against one process: tp 2 x cp 2 on 4 processes (NCCL on GPUs, gloo on CPU).

    torchrun --standalone --nproc-per-node 4 scripts/tools/check_tp_cp.py [--strategy ring] [--how device_mesh]

A tiny Llama (8 heads, 4 KV heads) is saved once and loaded by transformers tensor-parallel over {0,1} and {2,3}
(DistributedConfig(tp_size=2, dp_replicate_size=2): its replica dimension {0,2}, {1,3} is the CP one); hfcp runs
CP across the TP groups, from mesh["cp"] or from cp_size. Every rank compares its loss and full gradients with the
unpatched model in one process and prints one JSON line; the exit status is 1 when any is off.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def tiny_llama(heads: int = 8, kv_heads: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32 // heads,
                      max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def packed_batch(device, seed: int = 3, rows: int = 2, length: int = 30) -> dict:
    """Rows of several documents (position_ids restart), some targets ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, : length // 5] = -100
    pos = torch.stack([torch.cat([torch.arange(c), torch.arange(length - c)])
                       for c in torch.randint(4, length - 4, (rows,), generator=g).tolist()])
    return {k: v.to(device) for k, v in dict(input_ids=ids, labels=labels, position_ids=pos).items()}


def tp_x_cp_step(path: str, strategy: str, how: str, device: str = "cpu", packed: bool = True,
                 average: bool = False) -> dict:
    """One forward and backward of the tp 2 x cp 2 model; errors against one process, and what hfcp set up.
    packed False: one document per row (recurrent layers refuse packed rows). average: hfcp.average_gradients after
    the backward (the replica all-reduce averaged already: the mean of equal gradients must leave them as they are)."""
    import hfcp
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    batch = packed_batch(device)
    if not packed:
        del batch["position_ids"]
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").float().to(device)
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_size=2, dp_replicate_size=2))
    if how == "device_mesh":
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("cp", "tp"))
        hfcp.patch(model, device_mesh=mesh["cp"], strategy=strategy)
    else:
        hfcp.patch(model, cp_size=2, strategy=strategy)
    state = model._hfcp_state
    widths = []  # what one rank's attention computes: its TP share of the query heads
    hook = state.modules[0].q_proj.register_forward_hook(lambda m, a, o: widths.append(o.shape[-1]))
    out = model(**batch)
    hook.remove()
    out.loss.backward()
    if average:
        hfcp.average_gradients(model)  # DTensor gradients: their local shards over the CP group
    grad_err = 0.0
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grad_err = max(grad_err, float((g - r.grad).abs().max() / r.grad.abs().max()))
    return {"loss_err": abs(out.loss.item() - ref_loss.item()) / ref_loss.item(), "grad_err": grad_err,
            "dp": hfcp.data_parallel_rank_and_size(model), "q_width": widths[0], "chunk": state.loss_chunk,
            "cp_ranks": dist.get_process_group_ranks(state.mesh.cp_group)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses"])
    ap.add_argument("--how", default="device_mesh", choices=["device_mesh", "cp_size"])
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_world_size() != 4:
        raise SystemExit(f"tools/check_tp_cp.py runs on 4 processes (tp 2 x cp 2), not {dist.get_world_size()}")
    path = os.path.join(tempfile.gettempdir(), f"hfcp-tp-cp-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(path)
    dist.barrier()
    r = tp_x_cp_step(path, args.strategy, args.how, "cuda" if cuda else "cpu")
    ok = r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4  # NCCL and GPU kernels: looser than gloo's fp32 on CPU
    print(json.dumps({"rank": dist.get_rank(), "ok": ok, **r}), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
