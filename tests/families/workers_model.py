"""Model-level equivalence, run on every rank of a DistPool: patched vs unpatched tiny seeded models."""
from __future__ import annotations


import torch
import torch.distributed as dist
import transformers

import hfcp

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}


def tiny_model(family: str, base: bool = False, seed: int = 0, **overrides):
    cfg_name, cls_name, extra = CONFIGS[family]
    kwargs = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    cfg = getattr(transformers, cfg_name)(**{**kwargs, **extra, **overrides})
    torch.manual_seed(seed)
    cls = getattr(transformers, cls_name.replace("ForCausalLM", "Model") if base else cls_name)
    return cls(cfg).float()


def make_batch(case: dict):
    g = torch.Generator().manual_seed(case.get("seed", 1))
    B, L = case["B"], case["L"]
    ids = torch.randint(0, 64, (B, L), generator=g)
    batch = {"input_ids": ids}
    labels = ids.clone()
    labels[:, : L // 5] = -100  # some ignored targets
    if case.get("packed"):
        rows = []
        for _ in range(B):
            pos = []
            while len(pos) < L:
                pos += list(range(int(torch.randint(2, max(3, L // 2), (1,), generator=g))))
            rows.append(pos[:L])
        batch["position_ids"] = torch.tensor(rows)
    if case.get("documents"):  # one list of document lengths per row
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in case["documents"]])
    if case.get("padded"):
        mask = torch.ones(B, L, dtype=torch.long)
        if case["padded"] == "left":  # valid tokens would see the padding if its mask were dropped
            mask[0, : L // 3] = 0
        else:
            mask[0, L - L // 3 :] = 0
        labels[mask == 0] = -100
        batch["attention_mask"] = mask
    if case.get("labels", True):
        batch["labels"] = labels
    return batch


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _build(case, patch_first=False):
    model = tiny_model(case["family"], base=case.get("base", False), **case.get("config", {}))
    if patch_first:  # patch the bare model, then wrap it with PEFT
        hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"], loss_chunk=None)
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        for n, p in model.named_parameters():  # non-zero B so that every LoRA grad is exercised
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(n)))
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(case.get("train", True))
    return model


def _loss(out, batch, weights):
    if "labels" in batch:
        return out.loss
    return (out[0].float() * weights).sum()


def run_case(case: dict):
    """Reference: the unpatched model on each batch of the global batch (one per dp group), fp32.
    Patched: this rank's CP group runs its dp group's batch; grads are averaged over the world, as DDP does."""
    cp = case["cp"]
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_size = world // cp if case.get("dp_batches") else 1
    dp_rank = rank // cp if case.get("dp_batches") else 0
    batches = [make_batch({**case, "seed": 1 + d}) for d in range(dp_size)]
    steps = case.get("steps", 1)  # >1: several forwards (different batches) before one backward
    # later steps: other lengths and packing, so a stale layout or K/V would be visible
    step_batches = [make_batch({**case, "seed": 11 + s, "L": case["L"] + 6 * (s + 1), "packed": True})
                    for s in range(steps - 1)]
    weights = None

    ref_model = _build({**case, "dtype": None})
    ref_grads, ref_losses, ref_seqs = {}, [], []
    for batch in batches:
        ref_model.zero_grad()
        # use_cache=False: transformers detects packed documents only without a cache, as in training
        outs = [ref_model(**b, use_cache=False) for b in [batch, *step_batches]]
        if weights is None:
            weights = torch.randn(outs[0][0].shape, generator=torch.Generator().manual_seed(7))
        total = sum(_loss(o, b, weights) for o, b in zip(outs, [batch, *step_batches]))
        total.backward()
        for n, g in _grads(ref_model).items():
            ref_grads[n] = ref_grads.get(n, 0) + g / dp_size
        ref_losses.append(_loss(outs[0], batch, weights))
        ref_seqs.append(outs[0].logits if hasattr(outs[0], "logits") else outs[0].last_hidden_state)
    ref_loss, ref_seq, batch = ref_losses[dp_rank], ref_seqs[dp_rank], batches[dp_rank]

    model = _build(case, patch_first=case.get("patch_first", False))
    if case.get("dtype") == "bf16":
        model = model.to(torch.bfloat16)
    if case.get("ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    hfcp.patch(model, cp_size=cp, strategy=case["strategy"], loss_chunk=None, **case.get("patch", {}))  # logits too
    losses, gathered = [], []
    for b in [batch, *step_batches]:  # gather_sequence applies to the latest forward's outputs
        out = model(**b)
        gathered.append(hfcp.gather_sequence(out[1] if "labels" in b else out[0], model))
        losses.append(out.loss if "labels" in b else (gathered[-1].float() * weights).sum())
    sum(losses).backward()
    loss, full = losses[0], gathered[0]
    errs = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)), "loss_value": float(loss)}
    valid = (batch["attention_mask"].bool()[..., None] if "attention_mask" in batch
             else torch.ones_like(full[..., :1], dtype=torch.bool))
    errs["seq"] = _rel(full.detach().float() * valid, ref_seq.detach() * valid)
    grads = _grads(model.module if case.get("ddp") else model)
    grads = {n.removeprefix("module."): g for n, g in grads.items()}
    assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
    worst = 0.0
    for name, g in grads.items():
        g = g.float()
        if not case.get("ddp"):  # what DDP does: average over the world
            dist.all_reduce(g)
            g /= world
        worst = max(worst, _rel(g, ref_grads[name]))
    errs["grad"] = worst
    errs["n_grads"] = len(grads)
    errs["balanced"] = hfcp.cp_state(model).step.layout.balanced
    hfcp.unpatch(model)
    return errs


def averaged_grads(model) -> dict:
    """{name: grad} of `model`'s parameters, averaged over the ranks (hfcp's gradient convention: the mean over the
    CP group is the one-device gradient)."""
    import torch.distributed as dist

    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads
