"""Workers for hfcp.pipeline (issue 43): pipeline stages x CP (x DP) against one process, on every rank of a pool.

Each rank builds the same seeded model twice: the reference, run whole in this process on every data group's batch
(its gradient: the mean over the data groups' batches, as the pipeline's), and the one the pipeline splits. Two
training steps with AdamW: the losses, this stage's gradients by name, and its parameters after the steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.compare import grad_error

ROWS, LENGTH = 4, 32
CLIP = 1e-3  # a max norm below every gradient norm here: clip_grad_norm_ scales every step's gradients


def tiny(family: str, layers: int = 4, tied: bool = False):
    """family: a tiny_model family, "gemma2" (sliding and full layers alternating) or "gemma2_split" (the first
    half sliding, the second full: each stage of two has other masks, while the packed rows' balanced layout is
    planned for the whole model on every stage)."""
    import transformers as T

    from workers_model import tiny_model

    if family.startswith("gemma2"):  # softcaps (attention and final logits), scaled embeddings, sliding and full layers
        types = ["sliding_attention"] * (layers // 2) + ["full_attention"] * (layers - layers // 2) \
            if family == "gemma2_split" else None
        cfg = T.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                             sliding_window=6, attn_implementation="eager", tie_word_embeddings=tied,
                             layer_types=types)
        torch.manual_seed(0)
        model = T.Gemma2ForCausalLM(cfg).float()
    else:
        model = tiny_model(family, num_hidden_layers=layers, tie_word_embeddings=tied)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms and biases away from their initial values, so that their gradients matter
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model.train()


def batch(seed: int, packed: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (ROWS, LENGTH), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 20:] = -100  # rows with different target counts: a mean of microbatch means would differ
    out = {"input_ids": ids, "labels": labels}
    if packed:  # documents restarting inside each row, at other places in each
        out["position_ids"] = torch.stack([torch.cat([torch.arange(13 + 3 * r), torch.arange(LENGTH - 13 - 3 * r)])
                                           for r in range(ROWS)])
    return out


def _counted(forward, calls: list):
    def run(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)
    return run


def _prepare(family, lora, checkpointing, tied):
    model = tiny(family, tied=tied)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():  # LoRA's B starts at zero: move it so that every adapter's gradient is non-zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    return model


def compare(pp: int, cp: int, schedule: str, microbatches: int = 2, family: str = "llama", lora: bool = False,
            checkpointing: bool | str = False, packed: bool = False, tied: bool = False, strategy: str = "ring",
            memory: dict | None = None, bucket: int | None = None) -> dict:
    """checkpointing: True (non-reentrant) or "reentrant". memory: tiled_mlp / offload_checkpoints for the pipeline;
    then also how many of this stage's MLPs ran in tiles ("tiled_calls": their tiled forwards' calls) and whether
    the checkpoints were offloaded ("offloaded": the model's forward the offloading one). bucket: the runner's
    gradient reduction in buckets of this many elements (gradients cut into slices across buckets)."""
    if bucket is not None:
        from hfcp.pipelining import runner as module

        kept, module.REDUCE_BUCKET = module.REDUCE_BUCKET, bucket
        try:
            return compare(pp, cp, schedule, microbatches, family, lora, checkpointing, packed, tied, strategy, memory)
        finally:
            module.REDUCE_BUCKET = kept
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // (pp * cp)
    d = (rank // cp) % dp
    ref = _prepare(family, lora, checkpointing, tied)
    model = _prepare(family, lora, checkpointing, tied)
    runner = hfcp.pipeline(model, pp_size=pp, cp_size=cp, schedule=schedule, n_microbatches=microbatches,
                           strategy=strategy, timeout=60, **(memory or {}))
    inner = hfcp.state.find_pretrained(model)
    tiled_calls = [0]
    for layer in inner.model.layers:
        if "forward" in layer.mlp.__dict__:  # the tiled forward, bound on the instance
            layer.mlp.forward = _counted(layer.mlp.forward, tiled_calls)
    assert hfcp.data_parallel_rank_and_size(model) == (d, dp)  # the data groups to shard a dataset by
    ref_params = dict(ref.named_parameters())
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for _, p in runner.named_parameters() if p.requires_grad], lr=1e-2)
    loss_err = grad_err = norm_err = 0.0
    for step in range(2):
        batches = [batch(10 * step + g, packed) for g in range(dp)]  # one per data group
        want = []
        for b in batches:
            loss = ref(**b, use_cache=False).loss
            (loss / dp).backward()
            want.append(loss.item())
        got = runner.step(**batches[d])
        loss_err = max(loss_err, abs(got.item() - want[d]) / want[d])
        norm = runner.clip_grad_norm_(CLIP)
        ref_norm = torch.nn.utils.clip_grad_norm_(opt_ref.param_groups[0]["params"], CLIP)
        assert ref_norm > CLIP, ref_norm
        norm_err = max(norm_err, abs(norm.item() - ref_norm.item()) / ref_norm.item())
        grads = {n: p.grad for n, p in runner.named_parameters() if p.grad is not None}
        ref_grads = {n: ref_params[n].grad for n in grads}
        grad_err = max(grad_err, grad_error(grads, ref_grads) if grads else 0.0)
        missing = [n for n, p in runner.named_parameters() if p.requires_grad and p.grad is None]
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        runner.zero_grad()
    param_err = max(float((p - ref_params[n]).abs().max()) for n, p in runner.named_parameters())
    runner.eval()
    ref.eval()
    eval_b = batch(99, packed)
    with torch.no_grad():
        eval_err = abs(runner.eval_step(**eval_b).item() - ref(**eval_b, use_cache=False).loss.item())
    return {"loss_err": loss_err, "grad_err": grad_err, "norm_err": norm_err, "param_err": param_err,
            "eval_err": eval_err, "tiled_calls": tiled_calls[0], "offloaded": "forward" in inner.__dict__,
            "missing": missing, "params": len(dict(runner.named_parameters())), "grads": len(grads)}


def refused(kind: str) -> str | None:
    """What hfcp.pipeline or a step raised for a bad argument or model."""
    model = tiny("llama")

    def other(kind):
        if kind == "opt":  # position embeddings: parameters the forward uses before the layers
            import transformers as T

            return T.OPTForCausalLM(T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                word_embed_proj_dim=32))
        if kind == "hybrid":  # short convolutions: their halos would have to cross stages
            from workers_mixers import tiny_hybrid

            return tiny_hybrid("lfm2")
        if kind == "vlm":
            from workers_vlm import tiny_vlm

            return tiny_vlm("llava")
        from hfcp.testing.tiny import tiny_model  # a MoE whose forward adds its router aux loss

        moe = tiny_model("mixtral")
        moe.config.output_router_logits = True
        return moe

    calls = {
        "world": lambda: hfcp.pipeline(model, pp_size=3, cp_size=1),
        "schedule": lambda: hfcp.pipeline(model, pp_size=2, schedule="zigzag"),
        "stages": lambda: hfcp.pipeline(tiny("llama", layers=1), pp_size=2),
        "rows": lambda: hfcp.pipeline(model, pp_size=2, n_microbatches=3).step(**batch(0)),
        **{k: (lambda k=k: hfcp.pipeline(other(k), pp_size=2)) for k in ("hybrid", "vlm", "moe", "opt")},
        "ignore_index": lambda: hfcp.pipeline(model, pp_size=2).step(**batch(0), ignore_index=-1),
        "patched": lambda: hfcp.pipeline(hfcp.patch(model), pp_size=2),
        "other_batches": lambda: hfcp.pipeline(model, pp_size=2).step(**batch(dist.get_rank())),
    }
    try:
        calls[kind]()
    except ValueError as e:  # (UnsupportedModelError is one)
        return f"{type(e).__name__}: {e}"
    return None
