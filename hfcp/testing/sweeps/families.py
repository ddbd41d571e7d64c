"""The family sweep: every model_type of transformers' causal-LM mapping, a tiny random config that keeps the
family's features (caps and biases made to matter), patched (cp 2, ring, allgather and ulysses, the default
chunked loss) against the unpatched model: loss and every gradient. Each type comes out exact, refused (with hfcp's
reason), or not built (no tiny model could be made from its config). Run on every rank of a 2-process pool."""
from __future__ import annotations

import copy
import math
import sys

import torch
import torch.distributed as dist

from hfcp.testing.tiny import tiny_model as build
from hfcp.testing.compare import grad_error

L, B = 24, 2


def batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, min(vocab, 96), (B, L), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grads_of_any_rank(model) -> dict:
    """_grads, with zeros for a parameter that has a gradient on another rank only (an MoE expert no token of this
    rank's shard was routed to), so that every rank averages the same tensors."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    seen = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int32)
    dist.all_reduce(seen)
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for (n, p), anywhere in zip(params, seen.tolist()) if anywhere}


def _averaged(grads: dict) -> dict:
    """The gradients averaged over the ranks, in one all-reduce per dtype (not one per parameter: the sweep's
    thousands of small collectives cost more than its models' backward passes)."""
    for dtype in {g.dtype for g in grads.values()}:
        same = [g for g in grads.values() if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, part in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(part.view_as(g))
    return grads


def check(model_type: str) -> dict:
    """{"type", "result": exact | refused | mismatch | error | not built | reference failed, "detail"}.

    A type without a record is tried as the families patches/verified.py registers: attention classes read from
    the model (the record is removed again afterwards)."""
    from hfcp.families.registry import REGISTRY, Patcher

    if REGISTRY.get(model_type) is not None:
        return _check(model_type)
    REGISTRY.register(Patcher(model_type=model_type, attention_classes=(), read_from_model=True))
    try:
        return _check(model_type)
    finally:
        REGISTRY._patchers.pop(model_type)


def _check(model_type: str, aux_loss: bool = True) -> dict:
    import hfcp

    out = {"type": model_type}

    built = []

    def make():  # the tiny model, built once per type and copied (the same weights as a rebuild, faster)
        if not built:
            m = build(model_type)
            if not aux_loss:
                m.config.output_router_logits = False
            built.append(m)
        return copy.deepcopy(built[0])

    try:
        ref, model = make(), make()
        data = batch(ref.config.get_text_config().vocab_size)
    except Exception as e:  # noqa: BLE001 - the sweep reports, it does not fail
        return {**out, "result": "not built", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
    try:
        ref_loss = ref(**data, use_cache=False).loss
        ref_loss.backward()
    except Exception as e:  # noqa: BLE001
        failed = {**out, "result": "reference failed", "detail": f"{type(e).__name__}: {str(e)[:150]}"}
        if aux_loss and getattr(ref.config, "output_router_logits", False):  # transformers' own aux loss may fail:
            result = _check(model_type, aux_loss=False)  # then check the rest
            if result["result"] != "reference failed":
                result["detail"] += f" (router aux loss off: the unpatched model fails with it, {type(e).__name__})"
                return result
        return failed
    want = _grads(ref)
    make.noisy = _chunked_rule(ref) is not None  # only then is there a kernel noise to measure (a copy each time)
    tolerance = _tolerance(make, data, want)
    errs = {}
    for strategy in STRATEGIES:  # the ring decides refusals; the others must agree with it
        try:
            errs[strategy] = _patched_errors(model if strategy == "ring" else make(), data, strategy,
                                             want, ref_loss.item())
        except (ValueError, RuntimeError, TypeError) as e:  # hfcp's refusals are ValueError / UnsupportedModelError
            if strategy == "ulysses" and "not both divisible" in str(e):
                continue  # the family's head counts do not split over cp: the ring and allgather cover it
            name = type(e).__name__
            ours = isinstance(e, ValueError) or (isinstance(e, RuntimeError) and "hfcp" in str(e))
            refused = ours and not isinstance(e, hfcp.CollectiveError)  # a clear error, raised on every rank
            if strategy != "ring":
                return {**out, "result": "error", "detail": f"{strategy}: {name}: {str(e)[:300]}"}
            return {**out, "result": "refused" if refused else "error", "detail": f"{name}: {str(e)[:300]}"}
    loss_err = max(e[0] for e in errs.values())
    grad_err = max(e[1] for e in errs.values())
    same_keys = all(e[2] for e in errs.values())
    exact = same_keys and loss_err < LOSS_TOL and grad_err < tolerance
    # what the support-matrix page prints is what holds on any processor: the verdict and its tolerance, never the
    # rounding digits of the CPU kernels (those differ between machines); the measured errors travel beside it
    errors = f"loss {loss_err:.1e}, grad {grad_err:.1e}" + ("" if same_keys else ", grads differ")
    within = (f"{GRAD_TOL:.0e}" if tolerance == GRAD_TOL
              else "twice the fp32 noise of the family's own recurrent kernel on one device")
    detail = f"{', '.join(errs)}: " + (f"loss within {LOSS_TOL:.0e}, every gradient within {within}" if exact
                                       else errors)
    if not exact:
        return {**out, "result": "mismatch", "detail": detail, "errors": errors, "packed": ""}
    padding, packed = _padding(make, data), _packing(make, data)
    result = "mismatch" if "mismatch" in padding + packed else "exact"
    return {**out, "result": result, "detail": f"{detail}; {padding}", "errors": errors, "packed": packed}


def _within(a: tuple, b: tuple, tolerance: float) -> bool:
    """(loss, grads) pairs agree within the sweep's tolerances."""
    return abs(a[0] - b[0]) < LOSS_TOL * abs(b[0]) and a[1].keys() == b[1].keys() and grad_error(a[1], b[1]) < tolerance


def _tolerance(make, data: dict, want: dict) -> float:
    """The gradient tolerance of a batch: GRAD_TOL, or twice the family's own kernel noise where that is larger."""
    return max(GRAD_TOL, 2 * delta_rule_noise(make(), data, want)) if make.noisy else GRAD_TOL


def _chunked_rule(model) -> str | None:
    """The name of the chunked recurrent kernel in `model`'s family module, if it has one."""
    from hfcp.patches.recurrent import RULES

    family = sys.modules[type(model).__module__]
    return next((chunked for chunked, _ in RULES if hasattr(family, chunked)), None)


def delta_rule_noise(model, data: dict, want: dict) -> float:
    """The fp32 noise of a family's own recurrent kernel (a delta rule, Mamba-2's scan) on one device (0 without): the
    worst gradient error of `model` with the kernel's chunks of 16 tokens against `want`, its default chunks (64, 256)
    (the same mathematics, another rounding). The kernel computes in fp32 whatever the model's dtype, and the decay
    parameters' gradients are sums with cancellation, so this noise can exceed GRAD_TOL on one device alone."""
    name = _chunked_rule(model)
    if name is None:
        return 0.0
    family = sys.modules[type(model).__module__]
    rule = getattr(family, name)
    setattr(family, name, lambda *args, **kwargs: rule(*args, **{**kwargs, "chunk_size": 16}))
    try:
        model(**data, use_cache=False).loss.backward()
    finally:
        setattr(family, name, rule)
    return grad_error(_grads(model), want)


def _run(model, data, patched: bool):
    """(loss, grads) of one forward / backward; patched: cp 2 ring, gradients averaged over the ranks."""
    import hfcp

    if patched:
        hfcp.patch(model, process_group=dist.group.WORLD)
    try:
        loss = model(**data, use_cache=False).loss
        loss.backward()
    finally:
        hfcp.unpatch(model)
    return loss.item(), _averaged(_grads_of_any_rank(model)) if patched else _grads(model)


def _padding(make, plain: dict) -> str:
    """Left padding in row 0 and a hole in row 1 (attention_mask) in the batch `plain`, ring against the unpatched
    model."""
    data = copy.deepcopy(plain)
    mask = torch.ones_like(data["input_ids"])
    mask[0, :5], mask[1, 9:12] = 0, 0
    data["labels"][0, :6], data["labels"][1, 9:13] = -100, -100  # no target predicted from a padding row
    data["attention_mask"] = mask
    try:
        got = _run(make(), data, patched=True)
    except ValueError as e:
        return f"padding refused ({str(e)[:120]})"
    want = _run(make(), data, False)
    return ("padding and mask holes exact" if _within(got, want, _tolerance(make, data, want[1]))
            else "padding mismatch")


def _packing(make, plain: dict) -> str:
    """Two documents per row (position_ids resets, no mask), ring against the unpatched model; where they differ,
    against each document run alone (what packing means, and what transformers' flash-attention path gives)."""
    def make_no_aux():  # the router aux loss is a mean per forward: it does not add up over documents run alone
        m = make()
        m.config.output_router_logits = False
        return m

    make_no_aux.noisy = make.noisy
    data = copy.deepcopy(plain)
    cuts = (10, 15)
    data["position_ids"] = torch.stack([torch.cat([torch.arange(c), torch.arange(L - c)]) for c in cuts])
    for row, c in enumerate(cuts):
        data["labels"][row, c] = -100  # a document's first token is no target
    try:
        got = _run(make_no_aux(), data, patched=True)
    except ValueError as e:
        return f"refused ({str(e)[:120]})"
    want = _run(make_no_aux(), data, False)
    if _within(got, want, _tolerance(make_no_aux, data, want[1])):
        return "as transformers"
    alone = make_no_aux()
    total = int((data["labels"][:, 1:] != -100).sum())
    loss = 0.0
    for row, c in enumerate(cuts):
        for a, b in ((0, c), (c, L)):
            labels = data["labels"][row:row + 1, a:b]
            part = alone(input_ids=data["input_ids"][row:row + 1, a:b], labels=labels, use_cache=False).loss
            part = part * int((labels[:, 1:] != -100).sum()) / total
            part.backward()
            loss += part.item()
    if _within(got, (loss, _grads(alone)), _tolerance(make_no_aux, data, _grads(alone))):
        return "documents apart (transformers' SDPA path attends across them)"
    return "packed mismatch"


LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # relative; gradients: the worst parameter (hfcp.commands.verify.grad_error)


STRATEGIES = ("ring", "allgather", "ulysses")


def _patched_errors(model, data, strategy: str, want: dict, ref_loss: float):
    """(loss error, worst gradient error, same gradient keys) of the patched model against the reference."""
    import hfcp

    try:
        hfcp.patch(model, strategy=strategy, process_group=dist.group.WORLD)  # one group for the whole sweep
        loss = model(**data).loss
        loss.backward()
    finally:
        hfcp.unpatch(model)
    got = _averaged(_grads_of_any_rank(model))
    grad_err = grad_error(got, want) if want else math.inf
    return abs(loss.item() - ref_loss) / abs(ref_loss), grad_err, got.keys() == want.keys()


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
    from hfcp.families.registry import REGISTRY, Patcher

    out = {}
    for name, model_type in (("sparse_indices", "deepseek_v32"), ("aux_loss_form", "doge")):
        if REGISTRY.get(model_type) is None:
            REGISTRY.register(Patcher(model_type=model_type, attention_classes=(), read_from_model=True))
        try:
            model = build(model_type)
        except Exception as e:  # noqa: BLE001
            out[name] = f"not built: {e}"
            continue
        try:
            hfcp.patch(model, process_group=dist.group.WORLD)
            model(**batch(96)).loss.backward()
            out[name] = "not refused"
        except ValueError as e:
            out[name] = str(e)
        hfcp.unpatch(model)
        if REGISTRY.get(model_type).read_from_model and model_type not in _verified():
            REGISTRY._patchers.pop(model_type)
    return out


def _verified():
    from hfcp.patches import verified

    return verified.VERIFIED


def user_record_types(results) -> list[str]:
    """The types the sweep refused, and those exact only through their record's own mixers (the hybrids of issue 19):
    a user could register a record for any of them, replacing hfcp's."""
    from hfcp.families.registry import REGISTRY

    return [r["type"] for r in results if r["result"] == "refused"
            or (r["result"] == "exact" and REGISTRY.get(r["type"]) is not None and REGISTRY.get(r["type"]).mixers)]


SKIP = False  # True: as before every record was checked (shows the hole the checks close)


def user_records(types) -> list[dict]:
    """Each type tried as a user would register it: hfcp.Patcher(model_type, attention_classes=<every module class
    whose name ends in "Attention">), cp 2 ring against the unpatched model. Every record is held to hfcp's model
    checks, so each must come out exact or refused (issue 19: such records came out silently wrong or crashed)."""
    from hfcp.families.registry import REGISTRY, Patcher

    out = []
    for t in types:
        try:
            names = tuple(sorted({type(m).__name__ for m in build(t).modules()
                                  if type(m).__name__.endswith("Attention")}))
        except Exception as e:  # noqa: BLE001
            out.append({"type": t, "result": "not built", "detail": str(e)[:100]})
            continue
        saved = REGISTRY._patchers.pop(t, None)
        REGISTRY.register(Patcher(model_type=t, attention_classes=names or ("Attention",), skip_model_checks=SKIP))
        try:
            out.append({**_check(t), "classes": names})
        except Exception as e:  # noqa: BLE001 - a raw error of the model code under CP (AssertionError, IndexError)
            out.append({"type": t, "result": "error", "detail": f"{type(e).__name__}: {str(e)[:200]}",
                        "classes": names})
        finally:
            REGISTRY._patchers.pop(t)
            if saved is not None:
                REGISTRY._patchers[t] = saved
    return out


def user_record(model_type: str, classes: tuple, skip: bool = False) -> str:
    """Patch a tiny model of `model_type` with a record naming `classes`: hfcp's refusal, or "patched"."""
    import hfcp
    from hfcp.families.registry import REGISTRY, Patcher

    saved = REGISTRY._patchers.pop(model_type, None)
    REGISTRY.register(Patcher(model_type=model_type, attention_classes=classes, skip_model_checks=skip))
    model = build(model_type)
    try:
        hfcp.patch(model, process_group=dist.group.WORLD)
        return "patched"
    except hfcp.UnsupportedModelError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
        REGISTRY._patchers.pop(model_type)
        if saved is not None:
            REGISTRY._patchers[model_type] = saved


def model_check_refusals() -> tuple[int, dict]:
    """(families checked, {model_type: reason}) for every family hfcp ships whose tiny model the checks every record
    goes through at patch time refuse (patch.patcher_for: attention through the interface, no other sequence mixer,
    no convolution over tokens outside the record's mixers). One process, no collective: seconds per family."""
    import warnings

    from hfcp.families.resolve import patcher_for
    from hfcp.families.registry import REGISTRY
    from hfcp.testing.tiny_vlm import tiny_vlm
    from hfcp.testing.tiny_vision import tiny_vision as build_vision

    checked, refused = 0, {}
    for t in sorted(REGISTRY._patchers):
        record = REGISTRY.get(t)
        if record.unsupported_reason:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = (build_vision(t, "cls") if record.embeddings_classes else
                         tiny_vlm(t) if record.language_model else build(t))
        except Exception:  # noqa: BLE001 - a text config of a VLM (no causal-LM class), a tiny config that fails
            continue
        checked += 1
        try:
            patcher_for(model)
        except ValueError as e:
            refused[t] = str(e)
    return checked, refused
