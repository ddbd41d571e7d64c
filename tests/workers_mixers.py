"""Workers for sequence mixers other than attention under CP (issue 19): tiny hybrid models against the unpatched
model, loss and every gradient."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.verify import grad_error

_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             layer_types=["conv", "full_attention", "conv", "conv"])


def tiny_hybrid(kind: str):
    """LFM2 (kernel 3), LFM3 (kernel 7) or LFM2-MoE: conv, attention, conv, conv layers; weights perturbed."""
    import transformers as T

    if kind == "lfm2":
        model = T.Lfm2ForCausalLM(T.Lfm2Config(**_TEXT, conv_L_cache=3, attn_implementation="sdpa"))
    elif kind == "lfm3":
        model = T.Lfm3ForCausalLM(T.Lfm3Config(**_TEXT, conv_L_cache=7, attn_implementation="sdpa"))
    else:
        model = T.Lfm2MoeForCausalLM(T.Lfm2MoeConfig(**_TEXT, conv_L_cache=3, num_experts=2, num_experts_per_tok=1,
                                                    moe_intermediate_size=32, num_dense_layers=2,
                                                    attn_implementation="sdpa"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.float().train()


def batch(case: str, length: int = 40) -> dict:
    """Two rows; "padding": row 0 left-padded (6 tokens); "one_row_padding": that row alone; "packed": two
    documents per row."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 90, (2, length), generator=g)
    if case == "one_row_padding":
        ids, case = ids[:1], "padding"
    out = {"input_ids": ids, "labels": ids.clone()}
    if case == "padding":
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        out["labels"][0, :7] = -100
        out["attention_mask"] = mask
    if case == "packed":
        half = length // 2
        out["position_ids"] = torch.cat([torch.arange(half), torch.arange(length - half)])[None].repeat(2, 1)
    return out


def compare(kind: str, case: str, strategy: str = "ring", checkpointing: str = "") -> dict:
    """checkpointing: "checkpointing" (gradient checkpointing on), or "two_forwards" (on, and a second forward of
    another batch of the same length, other padding, before the first one's backward)."""
    torch.manual_seed(0)
    ref = tiny_hybrid(kind)
    torch.manual_seed(0)
    model = tiny_hybrid(kind)
    data = batch(case)
    want = ref(**data).loss
    want.backward()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hfcp.patch(model, strategy=strategy, timeout=30)
    try:
        got = model(**data).loss
        if checkpointing == "two_forwards":
            model(**batch("plain")).loss  # the first graph is still alive: refused
        got.backward()
    except ValueError as e:
        return {"refused": str(e)}
    finally:
        hfcp.unpatch(model)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    conv = {n: g for n, g in grads.items() if ".conv.conv." in n}
    return {"loss_err": abs(got.item() - want.item()) / want.item(), "grad_err": grad_error(grads, ref_grads),
            "conv_grad_err": grad_error(conv, {n: ref_grads[n] for n in conv}), "conv_params": len(conv),
            "same_keys": grads.keys() == ref_grads.keys(),
            "restored": all("forward" not in m.__dict__ and not m._forward_pre_hooks for m in model.modules())}
