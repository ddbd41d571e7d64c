"""Workers for bad-input and determinism tests (run on every rank of a pool)."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

import hfcp
from workers_model import make_batch, tiny_model


def _patched(**kw):
    return hfcp.patch(tiny_model("llama"), **kw)


def mismatched_batches(kind: str, check: bool = True):
    model = _patched(check_inputs=check)
    batch = make_batch(dict(B=2, L=16))
    if dist.get_rank() == 1:
        if kind == "content":
            batch["input_ids"][0, 3] += 1
        else:
            batch = make_batch(dict(B=2, L=18))
    try:
        model(**batch)
    except ValueError as e:
        return str(e)
    return None


def bad_call(kind: str):
    model = _patched()
    batch = make_batch(dict(B=2, L=16))
    if kind == "labels_shape":
        batch["labels"] = batch["labels"][:, :10]
    elif kind == "mask_4d":
        batch["attention_mask"] = torch.ones(2, 1, 16, 16)
    elif kind == "position_shape":
        batch["position_ids"] = torch.arange(15)[None]
    elif kind == "use_cache":
        batch["use_cache"] = True
    elif kind == "generate":
        try:
            model.generate(batch["input_ids"][:, :4], max_new_tokens=2, num_beams=2, pad_token_id=0)
        except ValueError as e:
            return str(e)
        return None
    try:
        model(**batch)
    except ValueError as e:
        return str(e)
    return None


def bad_patch(kind: str):
    try:
        if kind == "cp_too_big":
            _patched(cp_size=4)
        elif kind == "usp_size":
            _patched(strategy="usp", ulysses_size=3)
        elif kind == "usp_size_without_usp":
            _patched(strategy="ring", ulysses_size=2)
        elif kind == "ulysses_heads":
            hfcp.patch(tiny_model("llama", num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                                  hidden_size=24), strategy="ulysses")
    except ValueError as e:
        return str(e)
    return None


def loss_twice():
    out = []
    for _ in range(2):
        model = _patched()
        loss = model(**make_batch(dict(B=2, L=29, packed=True))).loss
        loss.backward()
        out.append((float(loss), float(next(model.parameters()).grad.abs().sum())))
    return out


def random_draws(n: int, seed: int):
    """A seeded sweep over length, batch, padding, packing, sliding window, strategy: patched == unpatched."""
    from workers_model import run_case

    rng = random.Random(seed)
    world = dist.get_world_size()
    results = []
    for _ in range(n):
        cp = rng.choice([c for c in (2, 4) if world % c == 0])
        case = dict(family=rng.choice(["llama", "mistral"]), strategy=rng.choice(["ring", "allgather", "ulysses"]),
                    cp=cp, B=rng.randint(1, 3), L=rng.randint(3, 70), packed=rng.random() < 0.4,
                    padded=rng.choice([False, "left", True]) if rng.random() < 0.4 else False,
                    config=dict(num_key_value_heads=4, sliding_window=rng.randint(2, 20)))
        if case["packed"] and case["padded"]:
            case["padded"] = False  # transformers detects packing only without an attention_mask
        if case["B"] < 2 and case["padded"]:
            case["B"] = 2
        results.append((case, run_case(case)))
    return results


def vision_attention_mask_refused():
    from hfcp.testing.tiny_vision import pixel_values as pixels, tiny_vision as build

    model = hfcp.patch(build("vit", "cls"))
    try:
        model(pixels("vit", 2, None, None), attention_mask=torch.ones(2, 17))
    except ValueError as e:
        return str(e)
    return None


def deepcopy_refused():
    import copy

    model = _patched()
    try:
        copy.deepcopy(model)
    except RuntimeError as e:
        return str(e)
    return None


def user_process_group(kind: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(d * 2, d * 2 + 2))) for d in range(world // 2)]
    strided = [dist.new_group(r) for r in ([0, 2], [1, 3], [1, 2], [0, 3])] if kind == "members_disagree" else None
    mine = groups[rank // 2]
    try:
        if kind == "timeout":
            hfcp.patch(tiny_model("llama"), process_group=mine, timeout=5)
        elif kind == "members_disagree":  # rank 0 passes {0,2}, but rank 2 passes {1,2}: refused on all four
            hfcp.patch(tiny_model("llama"), process_group=strided[rank])
        else:
            model = hfcp.patch(tiny_model("llama"), process_group=mine)
            return hfcp.data_parallel_rank_and_size(model)
    except ValueError as e:
        return str(e)
    return None


def head_restored_after_a_failed_forward():
    """A forward that raises mid-way (attention dropout refused) must not leave the output head swapped."""
    model = hfcp.patch(tiny_model("llama"), loss_chunk=4)
    attn = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    for m in attn:
        m.attention_dropout = 0.1
    batch = make_batch(dict(B=2, L=16))
    try:
        model(**batch)
        raised = False
    except ValueError:
        raised = True
    for m in attn:
        m.attention_dropout = 0.0
    logits = model(input_ids=batch["input_ids"]).logits
    as_tuple = model(**batch, return_dict=False)
    return {"raised": raised, "logits_shape": tuple(logits.shape), "tuple_second": as_tuple[1] is None,
            "tuple_loss": float(as_tuple[0])}


def average_gradients_matches_single_device():
    batch = make_batch(dict(B=2, L=20))
    ref = tiny_model("llama")
    ref(**batch, use_cache=False).loss.backward()
    model = hfcp.patch(tiny_model("llama"))
    model(**batch).loss.backward()
    hfcp.average_gradients(model)
    return max(float((p.grad - r.grad).abs().max() / r.grad.abs().max())
               for p, r in zip(model.parameters(), ref.parameters()))


def unpatch_after_a_failed_forward():
    """A chunked forward that raises before the head runs, then unpatch: the plain model must be whole again."""
    model = hfcp.patch(tiny_model("llama"), loss_chunk=4)
    attn = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    for m in attn:
        m.attention_dropout = 0.1  # refused by hfcp's attention, before the output head is reached
    batch = make_batch(dict(B=2, L=16))
    try:
        model(**batch)
    except ValueError:
        pass
    for m in attn:
        m.attention_dropout = 0.0
    hfcp.unpatch(model)
    out = model(**batch, use_cache=False)
    return {"logits_shape": tuple(out.logits.shape), "loss": float(out.loss)}
