"""generate() on patched vision-language models (images and a video in the prompt) against the unpatched model."""
from __future__ import annotations

import copy

import torch

import hfcp
import workers_vlm as V


def vlm_generated(kind: str, case: str, new: int = 6) -> dict:
    """Greedy tokens of the patched VLM (the merged prompt prefilled over the CP group, the vision tower split) and
    the unpatched one's, with what this rank's cache holds against the whole prompt."""
    model = V.tiny_vlm(kind).eval()
    model.config.get_text_config().use_cache = model.generation_config.use_cache = True
    batch = {k: v for k, v in V.vlm_batch(kind, case).items() if k != "labels"}
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    want = copy.deepcopy(model).generate(**batch, **kw)
    hfcp.patch(model, timeout=60)
    try:
        out = model.generate(**batch, return_dict_in_generate=True, **kw)
    finally:
        hfcp.unpatch(model)
    cache = out.past_key_values
    return {"same": bool(torch.equal(out.sequences, want)), "new": out.sequences.shape[1] - batch["input_ids"].shape[1],
            "here": max(k.shape[-2] for k in cache.keys.values()), "columns": cache.get_seq_length()}


def vlm_refused(kind: str, case: str) -> str:
    model = V.tiny_vlm(kind).eval()
    model.config.get_text_config().use_cache = model.generation_config.use_cache = True
    batch = {k: v for k, v in V.vlm_batch(kind, case).items() if k != "labels"}
    hfcp.patch(model, timeout=60)
    try:
        model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=0)
        return "ran"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
