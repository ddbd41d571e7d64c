"""What each decoder layer's forward keeps for backward: bench/reach.py --saved.

The census runs one training forward without gradient checkpointing under saved-tensor hooks. Each saved tensor is
held through a small holder that the graph owns, so a tensor whose graph was dropped before the forward ended (a
norm's own graph, once hfcp recomputes the norm in its readers) is not counted. At the end of the forward, the
storages still held are summed per decoder layer (each storage once, for the layer that saved it first; parameters
left out), in hidden vectors per local token (hidden size x element size bytes each).
"""
from __future__ import annotations

import weakref

import torch


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedCensus:
    def __init__(self, layers, params):
        self.where, self.saved = "before the layers", []
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.hooks = [layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "where", f"layer {i}"))
                      for i, layer in enumerate(layers)]
        self.hooks.append(layers[-1].register_forward_hook(lambda *_: setattr(self, "where", "after the layers")))

    def _pack(self, t):
        held = _Held(t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.saved.append((self.where, weakref.ref(held), storage.data_ptr(), storage.nbytes()))
        return held

    def saving(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def per_layer(self) -> dict[str, int]:
        """Bytes still held, per part of the forward (call before the graph is freed)."""
        seen, out = set(), {}
        for where, held, ptr, nbytes in self.saved:
            if held() is None or ptr in seen:
                continue
            seen.add(ptr)
            out[where] = out.get(where, 0) + nbytes
        return out

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
