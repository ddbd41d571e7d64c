"""The plan under tensor parallelism, as hfcp runs it (docs/how-to/scaling-out.md): transformers' tp_plan shards the
model over tp_size ranks, each computing its share of every attention layer's heads and of every MLP's width for the
same tokens, the residual stream whole; the CP group runs across TP groups. The output head, sharded over the
vocabulary, gathers its logits, so hfcp computes the loss from them (not in chunks: hfcp/families/resolve.py).

A TP rank's step is then the step of the same model with 1/tp_size of the heads and of the MLP width: the dry run
traces that narrowed config (narrowed()), hfcp's attention on the heads a TP rank has. What a rank holds of each
parameter is read from the model's own tp_plan (rank_numel()), and the narrowed model must hold exactly that of
every decoder layer's parameter, or the plan is refused naming the parameter (a family whose layers are sharded in
a way these config fields do not express). The embedding and the head are traced whole (their outputs are whole
after the all-reduce and the gather) and their weights counted as the plan shards them.

Not traced: the TP collectives' buffers (one hidden-state tensor a collective) and DTensor's own bookkeeping.
"""
from __future__ import annotations

import copy
import re

# transformers' tensor-parallel styles (transformers.integrations.tensor_parallel.ParallelInterface): those whose
# parameters a rank holds a 1/tp_size share of, and those it holds whole
SHARDING = {"colwise", "rowwise", "colwise_rep", "rowwise_rep", "rowwise_split_input", "colwise_gather_output",
            "packed_colwise", "packed_rowwise", "embedding_rowwise", "embedding_colwise", "moe_tp_experts",
            "grouped_gemm"}
REPLICATING = {"replicated_with_grad_allreduce", "replicate", "sequence_parallel", "all_reduce",
               "moe_identity_expert"}
ROW_STYLES = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise"}  # (their bias is whole on a rank)
# the config fields a TP rank's layers have 1/tp_size of (heads, the MLP's width, a mixture's experts' width)
NARROWED = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
            "shared_expert_intermediate_size")


def model_tp_plan(model) -> dict:
    """{parameter-name pattern: style} of a model as transformers builds it (its `tp_plan`, the base model's plan
    with the class's own, the head's)."""
    return dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})


def style_of(name: str, tp_plan: dict) -> str | None:
    """The style of the longest tp_plan key that names the parameter `name` or a module holding it."""
    best = None
    for key, style in tp_plan.items():
        pattern = re.escape(key).replace(r"\*", r"\d+")
        if re.fullmatch(pattern + r"(\..+)?", name) and (best is None or len(key) > len(best[0])):
            best = (key, style)
    return best[1] if best else None


def rank_numel(name: str, numel: int, tp_plan: dict, tp: int) -> float:
    """The elements of parameter `name` (of `numel` elements) one rank of a TP group of `tp` holds.

    Raises:
        ValueError: a style this plan does not know.
    """
    style = style_of(name, tp_plan)
    if style is None or style in REPLICATING or (style in ROW_STYLES and name.endswith(".bias")):
        return numel
    if style in SHARDING:
        return numel / tp
    raise ValueError(f"{name}: transformers' tp_plan shards it as {style!r}, which hfcp's plan does not count; "
                     "plan tp_size=1")


def head_is_sharded(model) -> bool:
    """Whether the output head's weight is sharded over the vocabulary (then hfcp computes the loss from its gathered
    logits)."""
    head = model.get_output_embeddings()
    if head is None:
        return False
    name = next((n for n, p in model.named_parameters() if p is head.weight), None)
    return name is not None and rank_numel(name, 2, model_tp_plan(model), 2) != 2


def narrowed(config, tp: int):
    """`config` as one rank of a TP group of `tp` computes its layers: NARROWED fields divided by tp, head_dim kept.

    Raises:
        ValueError: a field that does not divide by tp, or a config without the heads this narrows.
    """
    out = copy.deepcopy(config)
    text = out.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"{config.model_type}: no num_attention_heads to split over tp_size={tp}; plan tp_size=1")
    if getattr(text, "head_dim", None) is None:
        text.head_dim = text.hidden_size // heads
    if getattr(text, "num_key_value_heads", None) is None:
        text.num_key_value_heads = heads
    for field in NARROWED:
        value = getattr(text, field, None)
        if isinstance(value, int) and value:
            if value % tp:
                raise ValueError(f"{field}={value} does not divide over tp_size={tp}: transformers' tensor "
                                 "parallelism gives each rank an equal share; plan a tp_size that divides it")
            setattr(text, field, value // tp)
    return out


def check_narrowed(full, narrow, tp: int, layer_prefix: str) -> None:
    """Every parameter under `layer_prefix` (the decoder layers) of the narrowed model `narrow` holds what a TP rank
    holds of it in `full` (both built on the meta device from the full and the narrowed config).

    Raises:
        ValueError: naming the first parameter that differs.
    """
    tp_plan = model_tp_plan(full)
    mine = dict(narrow.named_parameters())
    for name, p in full.named_parameters():
        if not name.startswith(layer_prefix):
            continue
        want = rank_numel(name, p.numel(), tp_plan, tp)
        got = mine[name].numel() if name in mine else None
        if got != want:
            gives = f"{got:,}" if got is not None else "no such parameter"
            raise ValueError(f"{name}: a tensor-parallel rank holds {want:,.0f} of its {p.numel():,} elements under "
                             f"transformers' tp_plan ({style_of(name, tp_plan)!r}), but the config narrowed by "
                             f"hfcp's plan ({', '.join(NARROWED)} / {tp}) gives {gives}: hfcp's plan cannot trace this "
                             "family's TP step; plan tp_size=1")
