"""hfcp under torch.compile: what runs outside the compiled graphs, and why.

hfcp's work inside a forward is Python over the step's layout (which token lives where: data-dependent) and
collectives on its process groups (hfcp's own autograd functions over gloo or NCCL). None of it can be captured in a
graph, and a graph that captured the step of its first call would replay that step on every later one. So each hfcp
entry point that runs inside a model's forward is excluded from Dynamo with `eager`: the hooks that shard the inputs
and compute the loss, the attention function (one graph break per attention call), the output-head stand-ins, the
recurrent mixers' forwards and dynamic RoPE's wrapper. The model's own code between them (embeddings, projections,
norms, MLPs, RoPE) is compiled; docs/how-to/compile.md counts the graphs.
"""
from __future__ import annotations

import inspect

import torch

_TAKES_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters  # (torch 2.8 and later)


def eager(fn):
    """`fn`, run eagerly (with everything it calls) when a compiled region calls it: a graph break there. Dynamo's
    error under `fullgraph=True` gives the reason."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    reason = (f"hfcp's {name} reads the step's layout or communicates over the CP group, so it runs eagerly between "
              "compiled graphs (a graph break); compile a patched model without fullgraph=True")
    return torch.compiler.disable(fn, recursive=True, **({"reason": reason} if _TAKES_REASON else {}))


def compiling() -> bool:
    """Whether Dynamo is tracing or compiling now (its own calls on hfcp's tensors included)."""
    return torch.compiler.is_compiling()
