"""DeepSpeed ALST's training step (Arctic Long Sequence Training, arXiv 2506.13996), for the dry run: what hfcp's plan
holds its GPU model to (ALST's published reach) and what it sets beside hfcp's own step (`hfcp.plan(...,
step="alst")`).

The step is DeepSpeed's own code, run on the meta device as hfcp's step is (dry_run.py): its Ulysses attention
(`UlyssesSPAttentionHF`: all-to-all of Q, K and V to whole sequences of a rank's heads and back), its `TiledMLP`
and `TiledFusedLogitsLoss`, with ArcticTraining's recipe around them: MLP shards of hidden_size tokens, loss shards
of about 1 GiB of fp32 logits, each checkpointed layer's input offloaded to host memory (what the layer's checkpoint
saves, its inputs, copied to the host and back). The core attention is FlashAttention-2's by its shapes: aten's
flash kernel (out and log-sum-exp kept; GQA's K and V unrepeated), whose backward's workspace dry_run.WORKSPACES
counts.
Needs deepspeed (pip install 'hfcp[deepspeed]')."""
from __future__ import annotations

import contextlib
import importlib
import math

import torch

from ..families.introspect import decoder_layers, uses_attention_interface
from ..memory.tiled_mlp import EXPERTS_NAME

KEY = "hfcp_dry_alst"  # the attention implementation the dry run registers while ALST's step runs
LOSS_SHARD_BYTES = 2 ** 30  # ArcticTraining: loss shards of about 1 GiB of fp32 logits


def flash_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """FlashAttention-2's causal attention by its shapes (transformers' attention-interface signature; (B, S, H, D)
    out, as transformers' flash path returns it)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, True, False,
                                                             scale=scaling)[0]
    return out.transpose(1, 2), None


def _deepspeed():
    try:
        from deepspeed.runtime.sequence_parallel import ulysses_sp
    except ImportError as e:
        raise ImportError("hfcp.plan(..., step='alst') runs DeepSpeed's ALST step: pip install 'hfcp[deepspeed]' "
                          f"(deepspeed could not be imported: {e})") from e
    return ulysses_sp


def _offloaded(checkpoint):
    """`checkpoint` (a layer's gradient-checkpointing function) with the tensors it saves (the layer's inputs)
    copied to the host and back for backward."""
    def pack(t):
        return t.device, t.to("cpu")

    def unpack(packed):
        device, t = packed
        return t.to(device)

    def run(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return checkpoint(*args, **kwargs)
    return run


def _tiled(mlp, tiled_mlp_class):
    """ALST's tiled MLP forward for the module `mlp`: shards of hidden_size tokens, each recomputed in backward."""
    forward = type(mlp).forward

    def run(x):
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        return tiled_mlp_class.apply(lambda self, h: forward(self, h), mlp, x, shards, list(mlp.parameters()))
    return run


def _refuse_what_alst_does_not_run(base, text, tiled_mlp: bool) -> None:
    """ALST's step as planned here: a decoder of attention layers (its Ulysses exchanges attention only; a recurrent
    mixer would run on a rank's tokens alone), dense MLPs where tiled (DeepSpeed's TiledMLP), a causal LM's body and
    head (`model`, `lm_head`). Anything else raises ValueError naming it."""
    layers = decoder_layers(base, text.num_hidden_layers) or []
    if not layers or not hasattr(base, "model") or not hasattr(base, "lm_head"):
        raise ValueError(f"step='alst' plans a causal LM with decoder layers, a body and a head; "
                         f"{type(base).__name__} is not one")
    for i, layer in enumerate(layers):
        if not any(uses_attention_interface(m) for m in layer.modules()):
            raise ValueError(f"step='alst': decoder layer {i} ({type(layer).__name__}) has no attention that ALST's "
                             "Ulysses exchanges (a recurrent or linear-attention mixer); plan hfcp's step")
        mlp = getattr(layer, "mlp", None)
        if tiled_mlp and (mlp is None or any(n.endswith(EXPERTS_NAME) for n, _ in mlp.named_modules())):
            raise ValueError(f"step='alst' with tiled_mlp tiles dense MLPs (DeepSpeed's TiledMLP); decoder layer {i}'s "
                             f"MLP is {type(mlp).__name__}: pass tiled_mlp=False")


@contextlib.contextmanager
def prepared(model, sp: int, tiled_mlp: bool, offload_checkpoints: bool):
    """Inside: `model` (on the meta device, in a dry world of sp ranks or more) runs ALST's step; yields
    step(input_ids, position_ids) -> the loss, whose backward is the rest of the step. The registries and
    DeepSpeed's groups it set are restored on leaving."""
    import transformers
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    sp_module = _deepspeed()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    text = config.get_text_config()
    _refuse_what_alst_does_not_run(base, text, tiled_mlp)
    attention, mpu = flash_attention, None
    ds_state = previous_backend = None
    if sp > 1:
        import deepspeed.comm as ds_comm
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

        # (by their module objects: the package's attributes of these names are other things)
        ds_state, ds_torch = (importlib.import_module(f"deepspeed.comm.{m}") for m in ("comm", "torch"))

        previous_backend = ds_state.cdb
        build_shm_op, ds_torch.build_shm_op = ds_torch.build_shm_op, lambda: None
        try:  # (on a CPU DeepSpeed JIT-builds and starts its shared-memory all-reduce kernel, about 40 s of g++ in a
            # fresh environment: the fake group moves no data, and a GPU run has no such kernel)
            ds_comm.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False,
                                     verbose=False)
        finally:
            ds_torch.build_shm_op = build_shm_op
        mpu.initialize_sequence_parallel(sp)
        heads = text.num_attention_heads
        ulysses = sp_module.UlyssesSPAttentionHF(
            flash_attention, batch_size=1, attn_head_count=heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
            kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
            num_hidden_layers=text.num_hidden_layers, process_group=mpu.get_sequence_parallel_group(),
            seq_length_is_variable=True)

        def attention(module, query, key, value, attention_mask=None, *args, **kwargs):
            ulysses.batch_size = query.shape[0]
            return ulysses(module, query, key, value, None, *args, **kwargs)

    interface = transformers.AttentionInterface
    interface._global_mapping[KEY] = attention
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[KEY] = lambda *args, **kwargs: None  # (FA2 takes no mask)
    previous = config._attn_implementation
    config._attn_implementation = KEY
    layers = decoder_layers(base, text.num_hidden_layers) or []
    saved = []
    for layer in layers:
        saved.append((layer, getattr(layer, "_gradient_checkpointing_func", None), getattr(layer, "mlp", None)))
        if offload_checkpoints and getattr(layer, "_gradient_checkpointing_func", None) is not None:
            layer._gradient_checkpointing_func = _offloaded(layer._gradient_checkpointing_func)
        if tiled_mlp and getattr(layer, "mlp", None) is not None:
            layer.mlp.forward = _tiled(layer.mlp, sp_module.TiledMLP)

    class Loss(sp_module.TiledFusedLogitsLoss):
        @staticmethod
        def backward(ctx, *grads):
            # (DeepSpeed's backward scales the gradient it computed in forward unless the incoming one is 1.0,
            # which reads a device value; a loss's backward is called with 1.0)
            return (None, None, ctx.saved_tensors[0], None, None, None, None, None, None)

    def step(input_ids, position_ids):
        hidden = base.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        vocab = text.vocab_size
        shards = max(1, math.ceil(input_ids.numel() * vocab * 4 / LOSS_SHARD_BYTES))

        def loss_sum(module, h, labels):
            logits = module.lm_head(h)
            return module.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=labels)

        return Loss.apply(loss_sum, base, hidden, input_ids, None, shards, [base.lm_head.weight], "sum")

    try:
        yield step
    finally:
        config._attn_implementation = previous
        interface._global_mapping.pop(KEY, None)
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(KEY, None)
        for layer, checkpoint, mlp in saved:
            if checkpoint is not None:
                layer._gradient_checkpointing_func = checkpoint
            if mlp is not None:
                mlp.__dict__.pop("forward", None)
        if mpu is not None:
            mpu._release_sequence_parallel_groups()
        if ds_state is not None:
            ds_state.cdb = previous_backend  # (DeepSpeed's backend of the fake world goes with it)
