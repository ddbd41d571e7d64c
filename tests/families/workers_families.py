"""Workers for family features hfcp implements beyond plain attention: the MoE router aux loss from whole-sequence
statistics, the model's logit scale / softcap in the chunked loss, chunked attention. Each runs the same tiny model
patched (every rank) and unpatched (the reference) and returns the errors."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.tiny import tiny_model
from hfcp.testing.compare import grad_error

L, B = 30, 2


def batch(padding: bool, packed: bool = False):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (B, L), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    out = {"input_ids": ids, "labels": labels}
    if padding:
        mask = torch.ones(B, L, dtype=torch.long)
        mask[1, :7] = 0  # left padding in one row, right padding in the other
        mask[0, -5:] = 0
        labels[mask == 0] = -100
        labels[1, 7] = -100  # predicted from a padding row, whose attention output is the backend's choice (eager:
        # uniform over every key, SDPA and hfcp: 0); Gemma 2's reference is eager
        out["attention_mask"] = mask
    if packed:
        out["position_ids"] = torch.cat([torch.arange(11), torch.arange(L - 11)])[None].expand(B, -1)
    return out


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _mean_over_group(grads):
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def compare(model_type: str, config: dict, strategy: str = "ring", padding: bool = False, packed: bool = False,
            loss_chunk="auto", call: dict | None = None) -> dict:
    """Patched vs unpatched: {"loss", "grad", "aux", "chunked", "transform"} errors and facts."""
    from hfcp.families.registry import REGISTRY, Patcher

    if REGISTRY.get(model_type) is None:  # not in the generated list yet: the record patches/verified.py would give
        REGISTRY.register(Patcher(model_type=model_type, attention_classes=(), read_from_model=True))
    models = []
    for _ in range(2):
        m = tiny_model(model_type)
        for k, v in config.items():
            setattr(m.config, k, v)
            if hasattr(m, k):
                setattr(m, k, v)
        models.append(m)
    ref, model = models
    data = {**batch(padding, packed), **(call or {})}
    want = ref(**data, use_cache=False)
    want.loss.backward()
    hfcp.patch(model, strategy=strategy, loss_chunk=loss_chunk)
    state = hfcp.cp_state(model)
    got = model(**data)
    got.loss.backward()
    out = {"loss": abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()),
           "grad": grad_error(_mean_over_group(_grads(model)), _grads(ref)),
           "chunked": state.loss_chunk is not None, "transform": state.logit_transform}
    if getattr(want, "aux_loss", None) is not None:
        out["aux"] = abs(float(got.aux_loss) - float(want.aux_loss)) / abs(float(want.aux_loss))
        out["aux_value"] = float(want.aux_loss)
        out["router_logits_local"] = got.router_logits[0].shape[0] == B * state.step.layout.local_len
        from hfcp import gather_outputs  # HfcpTrainer's predictions: whole, in token order

        whole = gather_outputs(got, model)["router_logits"]
        out["router_logits_gathered"] = max(float((w - r).abs().max()) for w, r in zip(whole, want.router_logits))
    hfcp.unpatch(model)
    return out


def refused(model_type: str, config: dict, call: dict | None = None) -> str:
    from hfcp.families.registry import REGISTRY, Patcher

    if REGISTRY.get(model_type) is None:
        REGISTRY.register(Patcher(model_type=model_type, attention_classes=(), read_from_model=True))
    model = tiny_model(model_type)
    for k, v in config.items():
        setattr(model.config, k, v)
    hfcp.patch(model)
    try:
        model(**batch(False), **(call or {}))
        return "not refused"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)



def bidirectional_window(model_type: str = "gemma3_text") -> str:
    """A model built with use_bidirectional_attention=True (EmbeddingGemma style: non-causal sliding layers): the
    error every rank raises (its window is |q - k| < W, hfcp's one-sided; 2.07 / 1.33 gradient error before)."""
    import transformers
    from transformers.models.auto import modeling_auto

    from hfcp.testing.tiny import tiny_config

    cfg = tiny_config(model_type)
    cfg.use_bidirectional_attention = True
    model = getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(cfg).train()
    hfcp.patch(model)
    try:
        model(**batch(False)).loss.backward()
        return "not refused"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
