"""Workers for hfcp.patch(tiled_mlp=..., offload_checkpoints=...) (issue 44): the patched model at cp 2 with each
decoder layer's MLP run in tiles, or its checkpoints held in host memory, against the unpatched model in one process
(loss and every gradient); how many tiles each MLP ran, what was offloaded."""
from __future__ import annotations

import math

import torch

import hfcp
from hfcp.testing.compare import grad_error
from hfcp.state import find_pretrained
from hfcp.memory.tiled_mlp import mlps_to_tile
from workers_model import CONFIGS, averaged_grads, make_batch, tiny_model


def _models(kind: str, lora: bool):
    """Two copies of one seeded model (the reference and the one to patch), the batch, and the language model whose
    layers hold the MLPs."""
    if kind == "lfm2":  # a hybrid: short convolutions beside attention; its MLP is the layer's feed_forward
        from workers_mixers import batch, tiny_hybrid

        torch.manual_seed(0)
        ref = tiny_hybrid(kind)
        torch.manual_seed(0)
        models, b = (ref, tiny_hybrid(kind)), batch("plain")
    elif kind == "llava":  # a VLM: the language model's MLPs tiled, the merged sequence sharded
        from workers_vlm import tiny_vlm, vlm_batch

        models, b = (tiny_vlm(kind), tiny_vlm(kind)), vlm_batch(kind, "two_images")
    elif kind not in CONFIGS:  # any registered family's tiny config (MoE: the router aux loss on), one document a
        from hfcp.testing.tiny import tiny_model as any_tiny_model  # row (hybrids refuse packed rows)

        models, b = (any_tiny_model(kind), any_tiny_model(kind)), make_batch(dict(B=2, L=64))
    else:
        models, b = (tiny_model(kind, num_hidden_layers=3), tiny_model(kind, num_hidden_layers=3)), \
            make_batch(dict(B=2, L=64, packed=True))
    if lora:
        from peft import LoraConfig, get_peft_model

        out = []
        for m in models:
            torch.manual_seed(1)
            m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj",
                                                                                  "w1", "w2", "w3", "q_proj"]))
            with torch.no_grad():  # LoRA's B starts at zero: move it so that every adapter's gradient is non-zero
                for n, p in m.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
            out.append(m)
        models = tuple(out)
    return models[0], models[1], b


def tiled_step(kind: str, tile: int, lora: bool = False, checkpointing: bool | str = False,
               offload: bool = False) -> dict:
    """One training step: the patched model at cp 2 (tiled_mlp=tile, offload_checkpoints=offload) against the
    unpatched one in one process; the loss and gradient errors, per MLP how often its first projection ran (forward
    tiles, then each tile recomputed in backward), and the tensors offloaded. checkpointing: True (non-reentrant) or
    "reentrant"."""
    ref, model, batch = _models(kind, lora)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    tiled = mlps_to_tile(find_pretrained(model)) if tile else []
    calls, rows = [0] * len(tiled), [0] * len(tiled)
    for i, part in enumerate(tiled):  # count each call (a forward tile, or its recompute) and the rows it got
        part.forward = _counted(part.forward, calls, rows, i)
    hfcp.patch(model, timeout=60, tiled_mlp=tile or False, offload_checkpoints=offload)
    calls[:], rows[:] = [0] * len(tiled), [0] * len(tiled)  # (not the probes hfcp.patch ran)
    want = ref(**batch, use_cache=False).loss
    want.backward()
    with _NormSaves(model) as norm_saves:
        got = model(**batch, use_cache=False).loss
    got.backward()
    local = hfcp.cp_state(model).step.layout.local_len
    offloader = find_pretrained(model).__dict__["forward"].last if offload else None
    grads = averaged_grads(model)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    model.eval()
    calls_before, rows_training = list(calls), list(rows)
    with torch.no_grad():
        model(**batch, use_cache=False)  # eval: whole, one call per MLP
    whole = [b - a for a, b in zip(rows_training, rows)]
    hfcp.unpatch(model)
    left = [type(m).__name__ for m in model.modules() if hasattr(m.__dict__.get("forward"), "hfcp_tile")
            or hasattr(m.__dict__.get("forward"), "hfcp_offload")]
    return {"loss_err": abs(got.item() - want.item()) / want.item(), "grad_err": grad_error(grads, ref_grads),
            "grads": len(grads), "missing": sorted(set(ref_grads) - set(grads)), "calls": calls_before,
            "eval_calls": [b - a for a, b in zip(calls_before, calls)], "tiles": [math.ceil(n / tile) for n in whole],
            "left_after_unpatch": left, "offloaded": offloader.count if offloader else 0,
            "offloaded_bytes": offloader.bytes if offloader else 0, "norm_saves": norm_saves.count,
            "hidden_bytes": local * batch["input_ids"].shape[0] * model.config.get_text_config().hidden_size * 4}


class _NormSaves:
    """How many tensors the forward saved for backward that are outputs of a decoder layer's norm
    (hfcp.memory.norm_recompute: none where every reader of a norm's output recomputes it)."""

    def __init__(self, model):
        from hfcp.memory.norm_recompute import norms_of
        from hfcp.memory.tiled_mlp import tile_layers

        self.norms = [n for layer in tile_layers(find_pretrained(model)) for n in norms_of(layer)]
        self.outputs, self.count = [], 0  # (the outputs held: their storages are not reused while counting)

    def __enter__(self):
        self.hooks = [n.register_forward_hook(lambda m, a, out: self.outputs.append(out)) for n in self.norms]
        self.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.saving.__enter__()
        return self

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        self.count += any(o.untyped_storage().data_ptr() == ptr for o in self.outputs)
        return t

    def __exit__(self, *exc):
        self.saving.__exit__(*exc)
        for h in self.hooks:
            h.remove()
        self.outputs = []


def _counted(forward, calls: list, rows: list, i: int):
    def run(x, *args, **kwargs):
        calls[i] += 1
        rows[i] += x.shape[-2]
        return forward(x, *args, **kwargs)
    return run


def refused(kind: str, tile, offload=False) -> str | None:
    """What hfcp.patch, or a training step, raised for tiled_mlp=tile and offload_checkpoints=offload on a model of
    `kind` (its layers not checkpointed)."""
    from hfcp.testing.tiny import tiny_model as any_tiny_model  # (every registered family, MoE included)

    model = any_tiny_model(
        {"zero3": "llama", "mixtral_capacity": "mixtral", "mixtral_bound": "mixtral"}.get(kind, kind))
    if kind in ("mixtral_capacity", "mixtral_bound"):  # experts whose rows depend on how many there are (as a
        experts = model.model.layers[0].mlp.experts  # capacity limit would; "bound": only past 8 rows)
        scale = (lambda n: n) if kind == "mixtral_capacity" else (lambda n: 1.0 if n <= 8 else 0.5)
        capacity = type("CapacityExperts", (type(experts),), {
            "forward": lambda self, h, i, w: super(capacity, self).forward(h, i, w) * scale(h.shape[0])})
        for layer in model.model.layers:
            layer.mlp.experts.__class__ = capacity
    # weights gathered per sub-layer: as ZeRO-3 registers an MLP that is not a leaf (patched after it)
    if kind == "zero3":
        model.model.layers[0].mlp.up_proj.weight.ds_id = 0
    try:
        hfcp.patch(model, timeout=60, tiled_mlp=tile, offload_checkpoints=offload)
        model(**make_batch(dict(B=1, L=16)), use_cache=False)
    except ValueError as e:  # (UnsupportedModelError too)
        return str(e)
    return None
