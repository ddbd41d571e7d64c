"""The family sweep: every model_type of transformers' causal-LM mapping, a tiny random config that keeps the
family's features (caps and biases made to matter), patched (cp 2, ring, the default chunked loss) against the
unpatched model: loss and every gradient. Each type comes out exact, refused (with hfcp's reason), or not
built (no tiny model could be made from its config). Run on every rank of a 2-process pool."""
from __future__ import annotations

import math
import sys
import warnings

import torch
import torch.distributed as dist

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attention_dropout=0.0, hidden_dropout=0.0,
    dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    # mixture of experts: few, small experts (the router aux loss is off by default)
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=0, moe_layer_freq=1,
    decoder_sparse_step=1, n_group=1, topk_group=1,
    # MLA (DeepSeek-style) dimensions, small, with the value head dim (12) other than the query/key one (16); RoPE over head_dim (8)
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
    # caps made to bite
    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
    use_cache=False,
)
WINDOW = 7  # for families whose config has a sliding window by default (a window the mask does not apply is
            # passed to attention by some families' code all the same: transformers' SDPA then ignores it)
L, B = 24, 2
MAX_PARAMS = 3_000_000


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cls()
        extra = {"sliding_window": WINDOW} if getattr(default, "sliding_window", None) is not None else {}
        if hasattr(default, "kv_lora_rank"):  # MLA: keys and values are expanded to every query head
            extra["num_key_value_heads"] = TINY["num_attention_heads"]
        cfg = cls(**{**TINY, **extra})
    text = cfg.get_text_config()
    if text is not cfg:  # a composite config: shrink its text part the same way
        for k, v in TINY.items():
            if hasattr(text, k):
                setattr(text, k, v)
    for part in {id(cfg): cfg, id(text): text}.values():  # training randomness (dropout, router jitter) off:
        for k, v in list(vars(part).items()):  # a rank draws other noise than one device, so compare without it
            if isinstance(v, float) and any(x in k for x in ("dropout", "pdrop", "jitter")):
                setattr(part, k, 0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(model_type: str, seed: int = 0):
    from transformers.models.auto import modeling_auto
    import transformers

    cfg = tiny_config(model_type)
    cls = getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):  # size it first: a config part that ignores the tiny values could be huge
        try:
            size = sum(p.numel() for p in cls(cfg).parameters())
        except ValueError as e:  # a family without SDPA support: the eager reference then
            if "scaled_dot_product_attention" not in str(e):
                raise
            cfg._attn_implementation = "eager"
            size = sum(p.numel() for p in cls(cfg).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {size / 1e6:.1f}M parameters")
    torch.manual_seed(seed)
    model = cls(cfg).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # biases and norms away from their init, so that every term matters
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.train()
    return model


def batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, min(vocab, 96), (B, L), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check(model_type: str) -> dict:
    """{"type", "result": exact | refused | mismatch | error | not built | reference failed, "detail"}.

    A type without a record is tried as the families patches/verified.py registers: attention classes read from
    the model (the record is removed again afterwards)."""
    from hfcp.registry import REGISTRY, Patcher

    if REGISTRY.get(model_type) is not None:
        return _check(model_type)
    REGISTRY.register(Patcher(model_type=model_type, attention_classes=(), read_from_model=True))
    try:
        return _check(model_type)
    finally:
        REGISTRY._patchers.pop(model_type)


def _check(model_type: str) -> dict:
    import hfcp

    out = {"type": model_type}
    try:
        ref, model = build(model_type), build(model_type)
        data = batch(ref.config.get_text_config().vocab_size)
    except Exception as e:  # noqa: BLE001 - the sweep reports, it does not fail
        return {**out, "result": "not built", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
    try:
        ref_loss = ref(**data, use_cache=False).loss
        ref_loss.backward()
    except Exception as e:  # noqa: BLE001
        return {**out, "result": "reference failed", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
    try:
        hfcp.patch(model, process_group=dist.group.WORLD)  # one group for the whole sweep
        loss = model(**data).loss
        loss.backward()
    except (ValueError, RuntimeError, TypeError) as e:  # hfcp's refusals are ValueError / UnsupportedModelError
        hfcp.unpatch(model)
        name = type(e).__name__
        ours = isinstance(e, ValueError) or (isinstance(e, RuntimeError) and "hfcp" in str(e))
        refused = ours and not isinstance(e, hfcp.CollectiveError)  # a clear error from hfcp, raised on every rank
        return {**out, "result": "refused" if refused else "error", "detail": f"{name}: {str(e)[:300]}"}
    want, got = _grads(ref), _grads(model)
    for g in got.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    floor = max(1e-3 * max(float(g.abs().max()) for g in want.values()), 1e-12)
    grad_err = max((float((got[n] - want[n]).abs().max()) / max(float(want[n].abs().max()), floor) for n in want),
                   default=math.inf)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    same_keys = got.keys() == want.keys()
    hfcp.unpatch(model)
    exact = same_keys and loss_err < 1e-5 and grad_err < 1e-4
    return {**out, "result": "exact" if exact else "mismatch",
            "detail": f"loss {loss_err:.1e}, grad {grad_err:.1e}" + ("" if same_keys else ", grads differ in keys")}


def sweep(types=None, progress: bool = False) -> list[dict]:
    from transformers.models.auto import modeling_auto

    types = types or sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results = []
    for t in types:
        if progress and dist.get_rank() == 0:
            print(f"sweep: {t}", file=sys.stderr, flush=True)
        results.append(check(t))
    return results


def refusals() -> dict:
    """Features hfcp refuses rather than drops, each on a family that has it (tried as check() tries a type)."""
    import hfcp
    from hfcp.registry import REGISTRY, Patcher

    out = {}
    for t in ("mixtral", "llama4_text", "gemma2"):
        if REGISTRY.get(t) is None:
            REGISTRY.register(Patcher(model_type=t, attention_classes=(), read_from_model=True))
    for name, model_type, override in (("mixtral_aux_loss", "mixtral", {"output_router_logits": True}),
                                       ("llama4_chunked", "llama4_text", {"attention_chunk_size": 8}),
                                       ("gemma2_softcap", "gemma2", {})):
        try:
            model = build(model_type)
        except Exception as e:  # noqa: BLE001
            out[name] = f"not built: {e}"
            continue
        for k, v in override.items():
            setattr(model.config, k, v)
        try:
            hfcp.patch(model, process_group=dist.group.WORLD)
            model(**batch(96)).loss.backward()
            out[name] = "not refused"
        except ValueError as e:
            out[name] = str(e)
        hfcp.unpatch(model)
    for t in ("llama4_text", "gemma2"):
        if REGISTRY.get(t) is not None and REGISTRY.get(t).read_from_model and t not in _verified():
            REGISTRY._patchers.pop(t)
    return out


def _verified():
    from hfcp.patches import verified

    return verified.VERIFIED
