"""Workers for models built as a user builds them: from transformers' config classes with the checkpoint's fields
only (hfcp's tiny builder used to add fields such as num_attention_heads to every config, which hid reads of fields
that real configs lack)."""
from __future__ import annotations

import torch

import hfcp
from hfcp.testing.compare import grad_error
from workers_model import averaged_grads

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, use_cache=False)


def mamba_model(kind: str):
    """MambaForCausalLM, Mamba2ForCausalLM or FalconMambaForCausalLM from their config classes (no attention, no
    num_attention_heads); weights perturbed."""
    import transformers as T

    torch.manual_seed(0)
    if kind == "mamba2":  # heads of 8 tiling hidden_size x expand
        model = T.Mamba2ForCausalLM(T.Mamba2Config(**SMALL, num_heads=8, head_dim=8, n_groups=1, chunk_size=16))
    elif kind == "falcon_mamba":
        model = T.FalconMambaForCausalLM(T.FalconMambaConfig(**SMALL))
    else:
        model = T.MambaForCausalLM(T.MambaConfig(**SMALL))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.float().train()


def mamba_exact(kind: str, strategy: str) -> dict:
    """Loss and CP-mean gradients of the patched model against the unpatched one, two rows, one left-padded."""
    ref, model = mamba_model(kind), mamba_model(kind)
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    labels = ids.masked_fill(mask == 0, -100)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    hfcp.patch(model, cp_size=2, strategy=strategy, timeout=30)
    got = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    got.backward()
    grads = averaged_grads(model)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"has_heads": hasattr(model.config, "num_attention_heads"), "loss_err": abs(got.item() - want.item()),
            "grad_err": grad_error(grads, ref_grads), "same_keys": grads.keys() == ref_grads.keys()}


def output_options() -> dict:
    """output_hidden_states in a forward (local, gathered equal to the unpatched ones), in generate() and
    output_attentions: refused naming the option."""
    from hfcp.testing.tiny import tiny_model

    model = tiny_model("llama").eval()
    ids = torch.randint(3, 90, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids, output_hidden_states=True).hidden_states
        hfcp.patch(model, cp_size=2, timeout=30)
        got = model(input_ids=ids, output_hidden_states=True).hidden_states
        out = {"hidden_err": max(float((hfcp.gather_sequence(g, model) - w).abs().max()) for g, w in zip(got, want)),
               "layers": (len(got), len(want))}
        for name, call in (("attentions", lambda: model(input_ids=ids, output_attentions=True)),
                           ("generate", lambda: model.generate(ids, max_new_tokens=2, do_sample=False,
                                                               output_hidden_states=True,
                                                               return_dict_in_generate=True))):
            try:
                call()
                out[name] = "ran"
            except ValueError as e:
                out[name] = str(e)
    return out


def user_family_model(kind: str):
    """A family hfcp ships no record for, from its config class with small sizes (the fields a checkpoint has):
    ZAYA (a convolution over the projected queries and keys inside its attention module) or DeepSeek-V4 (attention
    over compressed keys with its own masks and sinks)."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                  moe_intermediate_size=32, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "zaya":
        model = T.ZayaForCausalLM(T.ZayaConfig(**common, num_key_value_heads=2, num_experts=4, router_hidden_size=16))
    else:
        model = T.DeepseekV4ForCausalLM(T.DeepseekV4Config(
            **common, num_key_value_heads=1, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, o_groups=2,
            o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8, hc_mult=2,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}))
    return model.float().train()


def user_record(kind: str, skip_model_checks: bool = False) -> dict:
    """The family patched at cp 2 (ring) under a record a user writes for it (its attention classes named, nothing
    else) and run forward and backward: {"refused": hfcp's message} or the loss and worst gradient error against the
    unpatched model. The record is removed again afterwards."""
    from hfcp.families.registry import REGISTRY

    ref, model = user_family_model(kind), user_family_model(kind)
    attention = next(type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention"))
    ids = torch.randint(3, 90, (2, 32), generator=torch.Generator().manual_seed(2))
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    hfcp.register_patcher(hfcp.Patcher(model_type=model.config.model_type, attention_classes=(attention,),
                                       skip_model_checks=skip_model_checks))
    try:
        hfcp.patch(model, cp_size=2, timeout=30)
        got = model(input_ids=ids, labels=ids).loss
        got.backward()
    except ValueError as e:  # hfcp's refusals (UnsupportedModelError is one)
        return {"refused": f"{type(e).__name__}: {e}"}
    finally:
        hfcp.unpatch(model)
        REGISTRY._patchers.pop(model.config.model_type)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"loss": (got.item(), want.item()), "grad_err": grad_error(averaged_grads(model), ref_grads)}


def extra_keys() -> str:
    """A tiny Llama whose attention gets two keys more than its queries (appended after rope, as a model that adds
    keys of its own would), patched at cp 2: hfcp's refusal."""
    from transformers.models.llama import modeling_llama

    from hfcp.testing.tiny import tiny_model

    rope = modeling_llama.apply_rotary_pos_emb

    def with_extra_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, torch.cat([k, k[:, :, :2]], dim=2)

    model = tiny_model("llama")
    ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(2))
    hfcp.patch(model, cp_size=2, timeout=30)
    modeling_llama.apply_rotary_pos_emb = with_extra_keys
    try:
        model(input_ids=ids, labels=ids)
        return "ran"
    except ValueError as e:
        return str(e)
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
        hfcp.unpatch(model)


def attention_keywords() -> dict:
    """A tiny Llama patched at cp 2 whose attention is handed keywords through the call (transformers passes a
    model's extra keyword arguments down to every attention function): {keyword: hfcp's refusal, or "ran"}."""
    from hfcp.testing.tiny import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(2))
    hfcp.patch(model, cp_size=2, timeout=30)
    out = {}
    for name, value in (("position_bias", torch.zeros(4, 16, 16)), ("s_aux", torch.zeros(3)),
                        ("s_aux_per_head", torch.zeros(4))):
        try:
            model(input_ids=ids, labels=ids, **{name.removesuffix("_per_head"): value})
            out[name] = "ran"
        except ValueError as e:
            out[name] = str(e)
    hfcp.unpatch(model)
    return out
