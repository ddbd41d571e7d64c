"""Workers for torch.compile on a patched model: compiled at cp 2 against the unpatched model, eager, in one process
(loss and every gradient, step after step), and what Dynamo made of it (graphs, graph breaks, recompiles)."""
from __future__ import annotations

import torch

import hfcp
from hfcp.testing.compare import grad_error
from workers_model import averaged_grads, make_batch, tiny_model


def _models(kind: str, layers: int | None = None):
    """Two copies of one seeded tiny model (the reference and the one to patch) and its batches: two steps of text
    rows (the second padded and packed: another layout, the same length), or a VLM's image rows. layers: a text
    model's decoder layers (2 by default)."""
    if kind in ("llama", "mistral"):
        more = {} if layers is None else dict(num_hidden_layers=layers)
        ref, model = tiny_model(kind, **more), tiny_model(kind, **more)
        return ref, model, [make_batch(dict(B=2, L=32)), make_batch(dict(B=2, L=32, seed=3, packed=True))]
    if kind == "lfm2":  # a hybrid: short convolutions (state passing between the ranks) and attention
        from workers_mixers import batch, tiny_hybrid

        torch.manual_seed(0)
        ref = tiny_hybrid(kind)
        torch.manual_seed(0)
        return ref, tiny_hybrid(kind), [batch("plain"), batch("padding")]
    from workers_vlm import tiny_vlm, vlm_batch  # a VLM: its vision tower split, the merged sequence sharded

    return tiny_vlm(kind), tiny_vlm(kind), [vlm_batch(kind, "two_images")] * 3


def _compile(model, how: str, backend: str):
    """how: "whole" (torch.compile of the model), "regional" (accelerate's compile_regions: each repeated block
    compiled, as TorchDynamoPlugin(use_regional_compilation=True) does) or "layers" (module.compile() in place on each
    decoder layer)."""
    if how == "whole":
        return torch.compile(model, backend=backend)
    if how == "regional":
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=backend)
    for m in model.modules():
        if type(m).__name__.endswith("DecoderLayer"):
            m.compile(backend=backend)
    return model


def compiled_steps(kind: str, how: str, backend: str = "aot_eager", checkpointing: bool = False,
                   options: dict | None = None, layers: int | None = None) -> dict:
    """Each step: the unpatched model eager on the whole batch, and the patched model compiled at cp 2; their losses and
    gradients (the gradient of the patched one averaged over the ranks) compared, then both stepped by SGD so the next
    step runs other weights. checkpointing: the patched model's layers recomputed in backward (non-reentrant). options:
    more of hfcp.patch's. Returns the worst errors and Dynamo's counts over the run. Inductor makes scalar C++
    kernels here: what is checked is hfcp's graphs and their gradients, not the kernels' vector code, and scalar
    kernels cut a cold compile (a fresh machine's) from 23 s to 16."""
    import torch._inductor.config

    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        return _compiled_steps(kind, how, backend, checkpointing, options, layers)


def _compiled_steps(kind, how, backend, checkpointing, options, layers) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref, model, batches = _models(kind, layers)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hfcp.patch(model, timeout=60, **(options or {}))
    run = _compile(model, how, backend)
    loss_err = grad_err = 0.0
    frames = []
    name = {p: n for n, p in model.named_parameters()}
    for batch in batches:
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        want = ref(**batch, use_cache=False).loss
        want.backward()
        got = run(**batch, use_cache=False).loss
        got.backward()
        grads = averaged_grads(model)
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        # a compiled graph gives zeros where eager leaves None (a VLM tower's unused head): the same gradient
        extra = [g for n, g in grads.items() if n not in ref_grads and bool(g.any())]
        loss_err = max(loss_err, abs(got.item() - want.item()) / abs(want.item()))
        grad_err = max(grad_err, grad_error(grads, ref_grads),
                       float(bool(extra) or not ref_grads.keys() <= grads.keys()))
        with torch.no_grad():
            for a, b in zip(ref.parameters(), model.parameters()):
                if a.grad is not None:
                    a -= 0.5 * a.grad
                    b -= 0.5 * grads[name[b]]
        frames.append(counters["stats"]["unique_graphs"])
    hfcp_breaks = sum(n for reason, n in counters["graph_break"].items() if "hfcp's" in reason)
    torch._dynamo.reset()  # (the pool's next task starts without these graphs)
    return {"loss_err": loss_err, "grad_err": grad_err, "graphs": frames, "hfcp_breaks": hfcp_breaks,
            "layers": model.config.get_text_config().num_hidden_layers}


def fullgraph_refused() -> str:
    """torch.compile(fullgraph=True) of a patched model: Dynamo's error, with hfcp's reason."""
    model = hfcp.patch(tiny_model("llama"), timeout=60)
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(**make_batch(dict(B=2, L=32)))
    except Exception as e:  # noqa: BLE001 - torch._dynamo.exc.Unsupported
        return f"{type(e).__name__}: {e}"
    finally:
        torch._dynamo.reset()
    return "compiled"
