"""The classification heads' sweep: every supported model_type whose sequence or token classifier is transformers'
generic one, built tiny (hfcp.testing.tiny's config, with labels and a pad id), patched at cp 2 and compared with one
process on a right-padded batch: the relative loss error and the worst relative gradient error (averaged over the
group, as DDP does). Slow (a minute or more); not run by the tests:

    python -m hfcp.testing.sweeps.heads
"""
from __future__ import annotations


def _build(cls, model_type: str):
    import torch

    from hfcp.testing.tiny import tiny_config

    cfg = tiny_config(model_type)
    cfg.num_labels, cfg.output_router_logits, cfg.classifier_dropout = 3, False, 0.0
    if getattr(cfg, "pad_token_id", None) is None:
        cfg.pad_token_id = 0
    torch.manual_seed(0)
    return cls(cfg).to(torch.get_default_dtype()).train()


def compare(model_type: str, head: str) -> str:
    """On every rank: 'loss E grad E', or why the type was not built or was refused."""
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.models.auto import modeling_auto

    import hfcp

    mapping = (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if head == "sequence"
               else modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES)
    cls = getattr(transformers, mapping[model_type])
    try:
        ref = _build(cls, model_type)
    except Exception as e:  # noqa: BLE001 - a config the generic tiny one does not fit
        return f"not built: {type(e).__name__}: {str(e)[:100]}"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, ref.config.get_text_config().vocab_size, (2, 29), generator=g)
    mask = torch.ones(2, 29, dtype=torch.long)
    ids[0, 20:], mask[0, 20:] = 0, 0
    labels = torch.randint(0, 3, (2,) if head == "sequence" else (2, 29), generator=g)
    if head == "token":
        labels[0, 20:] = -100
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    want = ref(**batch).loss
    want.backward()
    model = _build(cls, model_type)
    try:
        hfcp.patch(model, cp_size=dist.get_world_size())
        got = model(**batch).loss
        got.backward()
    except Exception as e:  # noqa: BLE001 - hfcp's refusal, the same on every rank
        return f"refused: {type(e).__name__}: {str(e)[:140]}"
    finally:
        hfcp.unpatch(model)
    want_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    floor = 1e-3 * max(float(w.abs().max()) for w in want_grads.values())
    worst = 0.0
    for n, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
        worst = max(worst, float((grad - want_grads[n]).abs().max()) / max(float(want_grads[n].abs().max()), floor))
    return f"loss {abs(float(got) - float(want)) / abs(float(want)):.1e} grad {worst:.1e}"


def generic_types() -> list[tuple[str, str]]:
    """(model_type, "sequence" | "token") of every supported type whose classifier is transformers' generic one."""
    import transformers
    from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification
    from transformers.models.auto import modeling_auto

    import hfcp

    found = []
    for head, mapping, generic in (
            ("sequence", modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
             GenericForSequenceClassification),
            ("token", modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, GenericForTokenClassification)):
        for model_type in hfcp.supported_model_types():
            name = mapping.get(model_type)
            if name and getattr(transformers, name).forward is generic.forward:
                found.append((model_type, head))
    return found


if __name__ == "__main__":
    from hfcp.testing.dist_pool import DistPool

    pool = DistPool(2)
    try:
        for model_type, head in generic_types():
            print(f"{head:8} {model_type:20} {pool.run(compare, model_type, head, timeout=600)[0]}", flush=True)
    finally:
        pool.close()
