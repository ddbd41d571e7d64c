"""Tensor parallelism x CP and CP groups given as device meshes (issue 21): 4 gloo processes."""
from __future__ import annotations


import torch.distributed as dist

import hfcp
from workers_model import make_batch, tiny_model

import check_tp_cp


def save_tiny_llama(path: str, heads: int = 4, kv_heads: int = 2) -> None:
    check_tp_cp.tiny_llama(heads, kv_heads).save_pretrained(path)


def _errors(model, ref, loss: float, ref_loss: float) -> dict:
    grad_err = 0.0
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grad_err = max(grad_err, float((g - r.grad).abs().max() / r.grad.abs().max()))
    return {"loss_err": abs(loss - ref_loss) / ref_loss, "grad_err": grad_err}


def tp_x_cp_step(path: str, strategy: str, how: str, average: bool = False):
    """tp 2 x cp 2 on 4 ranks (scripts/tools/check_tp_cp.py): transformers shards the model over TP groups {0,1} and
    {2,3} (DistributedConfig, its dp_replicate dimension {0,2}, {1,3} is the CP one), hfcp runs CP across them. One
    batch for all four (one data-parallel group); FSDP's replica all-reduce averages the gradients over each CP
    group."""
    return check_tp_cp.tp_x_cp_step(path, strategy, how, average=average)


def tp_refusals(path: str, kind: str):
    """What hfcp refuses for a tensor-parallel model: a CP group inside the TP group or mixing TP shards, a chunked
    loss over a vocabulary-sharded head, a cp_size that does not fit beside TP, a hybrid's recurrent layers (cp2)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_size=2, dp_replicate_size=2))
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # CP groups holding TP shards 0 and 1 of their heads
    try:
        if kind == "cp_inside_tp":
            hfcp.patch(model, process_group=groups[dist.get_rank() // 2])
        elif kind == "cp_mixes_tp_shards":  # ranks 0, 3 in one CP group, 1, 2 in the other: each TP group aligned
            hfcp.patch(model, process_group=crossed[dist.get_rank() in (1, 2)])
        elif kind == "chunked_head":
            hfcp.patch(model, cp_size=2, loss_chunk=8)
        elif kind == "cp_size":
            hfcp.patch(model, cp_size=4)
        elif kind == "cp2":
            hfcp.patch(model, cp_size=2)
    except ValueError as e:
        return str(e)
    return None


def mesh_groups_step(kind: str):
    """CP groups that are not hfcp's consecutive blocks, without TP: a (cp, dp) mesh's cp dimension, {0,2} and
    {1,3}; every rank's data-parallel coordinates and exactness against the mean of the two groups' batches."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    if kind == "cp_outer":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp"))
        model = hfcp.patch(tiny_model("llama"), device_mesh=mesh["cp"])
    elif kind == "dp_outer":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        model = hfcp.patch(tiny_model("llama"), device_mesh=mesh, strategy="usp", ulysses_size=1)
    else:  # process groups by hand, strided: usp's Ulysses sub-group of 2 is the strided pair
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        model = hfcp.patch(tiny_model("llama"), process_group=groups[rank % 2], strategy="usp", ulysses_size=2)
    dp_rank, dp_size = hfcp.data_parallel_rank_and_size(model)
    batches = [make_batch(dict(B=2, L=30, packed=True, seed=5 + d)) for d in range(dp_size)]
    ref = tiny_model("llama")
    ref_losses = [ref(**b, use_cache=False).loss for b in batches]
    out = model(**batches[dp_rank])
    out.loss.backward()
    hfcp.average_gradients(model)  # over the CP group: this DP group's gradient
    grad_err = 0.0
    ref_losses[dp_rank].backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        grad_err = max(grad_err, float((p.grad - r.grad).abs().max() / r.grad.abs().max()))
    return {"dp": (dp_rank, dp_size), "loss_err": abs(out.loss.item() - ref_losses[dp_rank].item()),
            "grad_err": grad_err, "leaders": model._hfcp_state.mesh.data_leaders}


def parallelism_config_mesh_step():
    """accelerate's ParallelismConfig(dp_shard_size=2, cp_size=2) as a mesh in a loop of one's own: FSDP2 over
    its dp_shard_cp dimension (all four ranks), hfcp over its cp dimension. FSDP averages over all ranks, which is
    the mean over the two DP groups of their batches' gradients (DESIGN.md "FSDP2 / ZeRO-3")."""
    from accelerate import ParallelismConfig
    from torch.distributed.fsdp import fully_shard

    pc = ParallelismConfig(dp_shard_size=2, cp_size=2)
    mesh = pc.build_device_mesh("cpu")
    model = tiny_model("llama")
    hfcp.patch(model, device_mesh=mesh["cp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    dp_rank, dp_size = hfcp.data_parallel_rank_and_size(model)
    batches = [make_batch(dict(B=2, L=30, packed=True, seed=7 + d)) for d in range(dp_size)]
    ref = tiny_model("llama")
    ref_losses = []
    for b in batches:
        loss = ref(**b, use_cache=False).loss
        (loss / len(batches)).backward()
        ref_losses.append(loss.item())
    out = model(**batches[dp_rank])
    out.loss.backward()
    return {**_errors(model, ref, out.loss.item(), ref_losses[dp_rank]), "dp": (dp_rank, dp_size),
            "mesh_dp": mesh["dp_shard"].get_local_rank(),
            "cp_ranks": dist.get_process_group_ranks(mesh["cp"].get_group())}


def trainer_refuses_tp(path: str):
    """HfcpTrainer with a tensor-parallel model: refused before accelerate is asked for TP (which it would refuse on
    CPU with a message about its ParallelismConfig, and which is unverified on GPUs)."""
    import tempfile

    from transformers import AutoModelForCausalLM, TrainingArguments
    from transformers.distributed import DistributedConfig

    from hfcp.integrations import HfcpTrainer

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_size=2, dp_replicate_size=2))
    with tempfile.TemporaryDirectory() as out:
        try:
            HfcpTrainer(model=model, args=TrainingArguments(output_dir=out, use_cpu=True, report_to=[]), cp_size=2)
        except ValueError as e:
            return str(e)
    return None


def tp_x_cp_generate(path: str):
    """Greedy generate() of the tp 2 x cp 2 model (the prompt prefilled over the CP group, each rank's cache holding
    its TP rank's KV heads of its own tokens) against the unpatched model in one process: the tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    want = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").generate(ids, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_size=2, dp_replicate_size=2))
    hfcp.patch(model, cp_size=2).eval()
    out = model.generate(ids, return_dict_in_generate=True, **kw)
    keys = out.past_key_values.keys[0]  # hfcp.inference.kv_cache.ShardedKVCache: (B, KV heads here, tokens here, D)
    return {"same": bool(torch.equal(out.sequences, want)), "kv_heads": keys.shape[1]}


def device_mesh_refusals(kind: str):
    from torch.distributed.device_mesh import init_device_mesh

    try:
        if kind == "no_cp_dimension":
            hfcp.patch(tiny_model("llama"), device_mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "sp")))
        elif kind == "not_a_mesh":
            hfcp.patch(tiny_model("llama"), device_mesh="cp")
        elif kind == "tp_not_read":  # a (cp, tp) mesh whose tp the model was not loaded over by transformers
            hfcp.patch(tiny_model("llama"), device_mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("cp", "tp")))
        elif kind == "dp_dimension":
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp"))
            hfcp.patch(tiny_model("llama"), device_mesh=mesh["dp"])
        elif kind == "both":
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
            hfcp.patch(tiny_model("llama"), device_mesh=mesh, process_group=mesh.get_group())
    except ValueError as e:
        return str(e)
    return None


def unpatched_tp_coordinates(path: str):
    """A tensor-parallel model left unchanged by patch (cp 1): the ranks of a TP group share a batch."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_size=2, dp_replicate_size=2))
    hfcp.patch(model, cp_size=1)
    return hfcp.data_parallel_rank_and_size(model)


def rank_parameter_elements(path: str) -> int:
    """The parameter elements this rank holds of the checkpoint loaded tensor-parallel (tp 2, as tp_x_cp_step
    loads it): its local shard of each DTensor, the whole of the rest."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_size=2, dp_replicate_size=2))
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
