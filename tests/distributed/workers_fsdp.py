"""FSDP2 (torch fully_shard) x CP: parameters sharded over all ranks, the sequence over each CP group."""
from __future__ import annotations

import torch.distributed as dist

import hfcp
from workers_model import make_batch, tiny_model


def fsdp_step(order: str, cp_size: int, options: dict | None = None, family: str = "llama"):
    """One step, patched before or after fully_shard; every rank's full gradients against the mean over the DP
    groups' batches on one device (FSDP averages over all ranks: the mean over a CP group is its batch's gradient).
    options: more of hfcp.patch's; with offload_checkpoints the layers are checkpointed (non-reentrant). family:
    "llama", or any registered family's tiny model (hfcp.testing.tiny: an MoE with its router aux loss on)."""
    from hfcp.testing.tiny import tiny_model as any_tiny_model
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    dp_rank = dist.get_rank() // cp_size
    batches = [make_batch(dict(B=2, L=30, packed=True, seed=1 + d)) for d in range(world // cp_size)]
    build = (lambda: tiny_model("llama")) if family == "llama" else (lambda: any_tiny_model(family))
    ref = build()
    ref_losses = []
    for b in batches:
        loss = ref(**b, use_cache=False).loss / len(batches)
        loss.backward()
        ref_losses.append(loss.item() * len(batches))
    model = build()
    options = options or {}
    if options.get("offload_checkpoints"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if order == "patch_first":
        hfcp.patch(model, cp_size=cp_size, **options)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if order == "shard_first":
        hfcp.patch(model, cp_size=cp_size, **options)
    loss = model(**batches[dp_rank]).loss
    loss.backward()
    grad_err = 0.0
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor()
        grad_err = max(grad_err, float((g - r.grad).abs().max() / r.grad.abs().max()))
    return {"class": type(model).__name__, "loss_err": abs(loss.item() - ref_losses[dp_rank]) / ref_losses[dp_rank],
            "grad_err": grad_err}
