"""Tiny random causal LMs of any transformers model_type: what the family sweep (hfcp/testing/sweeps/families.py) and
`hfcp verify --model MODEL_TYPE` run. The config keeps the family's features (one layer of each kind its
layer_types lists, sliding windows where the family has one, attention chunks, MoE with the router aux loss, MLA
head dims, small SSM dimensions, softcaps set low, logit scales) at a size that runs in milliseconds."""
from __future__ import annotations

import warnings

import torch

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attention_dropout=0.0, hidden_dropout=0.0,
    dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    # mixture of experts: few, small experts, the router aux loss on and weighted so that it matters
    output_router_logits=True, router_aux_loss_coef=1.0, aux_loss_coef=1.0,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_shared_experts=1,
    first_k_dense_replace=0, moe_layer_freq=1, decoder_sparse_step=1, n_group=1, topk_group=1,
    # MLA (DeepSeek-style) dimensions, small, with the value head dim (12) other than the query/key one (16);
    # RoPE over head_dim (8)
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
    # Kimi's KDA mixer: few, small heads (its default, 32 heads of 128, was 40% of the family sweep's time). The gated
    # delta rule's families (Qwen3-Next and its kin) keep their default heads: its fp32 rounding under CP depends on
    # them, and tests/commands/test_verify.py checks Qwen3-Next's at 64 tokens
    linear_num_heads=4, linear_head_dim=8,
    # caps and logit scales made to bite
    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, logits_scaling=2.0,
    use_cache=False,
)
WINDOW = 7  # for families whose config has a sliding window by default (a window the mask does not apply is
            # passed to attention by some families' code all the same: transformers' SDPA then ignores it)
CHUNK = 8
MAX_PARAMS = 3_000_000
# the head a tiny model is built with -> transformers' mapping of model_type -> class name (None: the causal LM)
HEAD_MAPPINGS = {None: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                 "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                 "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"}


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cls()
        extra = {"sliding_window": WINDOW} if getattr(default, "sliding_window", None) is not None else {}
        if getattr(default, "attention_chunk_size", None):  # chunked attention (Llama 4): chunks inside the sequence
            extra["attention_chunk_size"] = CHUNK
        if hasattr(default, "kv_lora_rank"):  # MLA: keys and values are expanded to every query head
            extra["num_key_value_heads"] = TINY["num_attention_heads"]
        extra.update(_ssm_dims(default))
        settable = {k: v for k, v in TINY.items()  # only the fields the family's config has (as a checkpoint's):
                    if _has_field(default, k) and getattr(getattr(cls, k, None), "fset", True) is not None}
        cfg = None
        kinds = _layer_kinds(default)
        if kinds and default.get_text_config() is default:
            try:  # passed in, so that the config derives what depends on them
                field = getattr(cls, "attribute_map", {}).get("layer_types", "layer_types")  # Zamba2's own name
                cfg = cls(**{**settable, **extra, "num_hidden_layers": len(kinds), field: kinds})
            except (ValueError, TypeError, AttributeError, KeyError):  # a config that derives its layers otherwise
                cfg = None  # (RecurrentGemma): as it is
        cfg = cfg or cls(**{**settable, **extra})  # (a config property without a setter keeps its own value)
    text = cfg.get_text_config()
    if text is not cfg:  # a composite config: shrink its text part the same way
        for k, v in TINY.items():
            if hasattr(text, k):
                setattr(text, k, v)
    kinds = _layer_kinds(default.get_text_config())
    if text is not cfg and kinds and getattr(getattr(type(text), "layer_types", None), "fset", True):
        text.num_hidden_layers, text.layer_types = len(kinds), kinds
    for part in {id(cfg): cfg, id(text): text}.values():  # training randomness (dropout, router jitter) off:
        for k, v in list(vars(part).items()):  # a rank draws other noise than one device, so compare without it
            if isinstance(v, float) and any(x in k for x in ("dropout", "pdrop", "jitter")):
                setattr(part, k, 0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def _has_field(config, name: str) -> bool:
    """Whether the config has the field (one that exists per layer raises on a global read: it has it)."""
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (Gemma 4's head_dim)
        return True
    return True


SSM = dict(state_size=8, mamba_d_state=8, ssm_state_size=8, mamba_d_head=8, n_groups=2)  # SSM (Mamba) dimensions


def _ssm_dims(default) -> dict:
    """Small SSM dimensions for a family whose config has them, with as many SSM heads of 8 as fill its
    hidden_size x expand (the families' configs check that the heads tile the expanded width)."""
    out = {k: v for k, v in SSM.items() if hasattr(default, k)}
    if hasattr(default, "mamba_n_heads") and hasattr(default, "mamba_expand"):
        out["mamba_n_heads"] = TINY["hidden_size"] * default.mamba_expand // SSM["mamba_d_head"]
        if hasattr(default, "mamba_d_ssm"):  # Falcon-H1: an SSM width of its own, else hidden_size x expand
            out["mamba_d_ssm"] = None
    if hasattr(default, "mamba_num_heads") and hasattr(default, "mamba_head_dim"):  # Nemotron-H: heads x head dim
        out["mamba_num_heads"] = TINY["hidden_size"] * default.expand // SSM["mamba_d_head"]  # is its SSM width
        out["mamba_head_dim"] = SSM["mamba_d_head"]
    if (hasattr(default, "num_heads") and hasattr(default, "state_size")
            and isinstance(getattr(default, "expand", None), int)):  # Mamba-2's heads
        out["num_heads"] = TINY["hidden_size"] * default.expand // TINY["head_dim"]
    return out


def _layer_kinds(default) -> list | None:
    """A family whose layers are of several kinds (`layer_types`: sliding and full attention, linear attention in a
    hybrid, ...) keeps one layer of each, in the order the default config first has them, so that the sweep runs
    every kind: the first layers of the default pattern alone can all be of one kind (Qwen3-Next: 3 linear, 1 full).
    None for a family of one kind."""
    types = getattr(default, "layer_types", None)
    kinds = list(dict.fromkeys(types)) if isinstance(types, (list, tuple)) else []
    return kinds if len(kinds) > 1 else None


def head_classes(head: str | None = None) -> dict:
    """transformers' model_type -> class name of `head` (a key of HEAD_MAPPINGS; None: the causal LM)."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, HEAD_MAPPINGS[head])


def tiny_model(model_type: str, seed: int = 0, head: str | None = None):
    """A tiny random causal LM of `model_type` (train mode), weights perturbed away from their init; with `head`
    ("sequence-classification" or "token-classification"), the family's class of that head (its
    `*ForSequenceClassification` / `*ForTokenClassification`, the config's default num_labels) of the same config.

    Raises:
        KeyError: transformers has no class of `head` for `model_type`.
        Exception: whatever the family's config or model raises for these tiny values; ValueError when the tiny
            config still makes a large model (a part of the config that ignores the tiny values).
    """
    import transformers

    cfg = tiny_config(model_type)
    cls = getattr(transformers, head_classes(head)[model_type])
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
