"""hfcp.patch(offload_checkpoints=True): what a training forward with gradient checkpointing keeps for backward
outside the checkpointed layers (each layer's input: the residual stream, tokens x hidden per layer) held in host
memory, brought back when backward needs it.

Inside a checkpointed layer torch's checkpoint keeps nothing (its own saved-tensor hooks), so hooks around the
whole forward see exactly the checkpoints (every layer's input) and the few tensors saved outside the layers (the
final norm's input, the loss's hidden states). On CUDA each is copied into pinned host memory without blocking the
host, and back in backward; parameters stay where they are. On CPU the same path runs (a copy into host memory,
which saves nothing there). The values are the same tensors' copies: exact.

The copies run on the compute stream, not a side stream: a side stream's copy could still be reading a tensor when
the compute stream modifies it in place (saved-tensor hooks bypass autograd's version check, so nothing would
notice), and ordering the two streams by hand at every in-place operation is not possible from a hook. On the
compute stream the copy engine works while the host runs ahead, and a kernel that reuses or modifies the memory is
ordered after the copy; what is given up is the overlap of the copy with kernels queued behind it (one layer's
input per layer: tokens x hidden bytes, against the layer's compute).
"""
from __future__ import annotations

import functools

import torch
from torch import nn



class Offloader:
    """The saved-tensor hooks of one forward: pack moves a tensor to the host, unpack brings it back."""

    def __init__(self):
        self.count = self.bytes = 0

    def pack(self, tensor: torch.Tensor):
        if isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter) or \
                not tensor.is_floating_point() or tensor.layout != torch.strided:
            return tensor  # (weights stay; indices and masks are small)
        self.count += 1
        self.bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            return (tensor.device, tensor.detach().to("cpu", copy=True))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.detach(), non_blocking=True)  # (on the compute stream: see the module's docstring)
        return (tensor.device, host)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())


def offload_checkpoints(model: nn.Module, layers: list):
    """Run `model`'s training forwards under the offloading hooks (the model's forward replaced on the instance);
    returns the undo."""
    had = model.__dict__.get("forward")  # (a forward set on the instance before: put back by the undo)
    model.forward = offloading_forward(model, model.forward, layers)

    def undo():
        if had is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = had
    return undo


def offloading_forward(model: nn.Module, forward, layers: list):
    """`forward` (the model's) run under the offloading hooks in training forwards; a training forward of a model
    whose layers are not checkpointed is refused (every activation would go to the host)."""
    name = type(model).__name__

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled() or not model.training:
            return forward(*args, **kwargs)
        if not any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
            raise ValueError(f"offload_checkpoints=True: {name}'s decoder layers are not checkpointed, so there are no "
                             "checkpoints to offload (every activation would go to the host); enable gradient "
                             "checkpointing (model.gradient_checkpointing_enable(), or TrainingArguments("
                             "gradient_checkpointing=True)), or pass offload_checkpoints=False")
        offloader = Offloader()
        run.last = offloader
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            return forward(*args, **kwargs)

    run.last, run.hfcp_offload = None, True
    return run
