"""The stand-in for a model's 4D attention mask that carries the step to every attention call.

transformers passes a 4D mask through unchanged to each layer, so the step travels with the call arguments: a layer
recomputed by gradient checkpointing sees its own step even after later forwards. No L x L mask is ever built:
attention derives its block masks from global indices. The stand-in holds no mask values, so a model whose own code
computes a tensor from its mask (extends it over compressed keys, pads it, multiplies it into hidden states) would
compute it from nothing: such an operation raises ValueError naming the model's line, on every rank alike (the ranks
run the same code on shards of one length), instead of a raw shape error or a silently wrong mask.
"""
from __future__ import annotations

import os
import sys

import torch

from ..compiler import compiling, eager

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HFCP = os.path.dirname(os.path.abspath(__file__)) + os.sep
# operations that copy the mask as it is (to a device or dtype, detached): the copy stands for the same masks
_COPIES = frozenset({torch.Tensor.to, torch.Tensor.detach, torch.Tensor.contiguous, torch.Tensor.clone,
                     torch.Tensor.cpu, torch.Tensor.cuda})


class StepToken(torch.Tensor):
    """A (1, 1, 1, 1) bool tensor whose `hfcp_step` is the step of the forward it was made for."""

    hfcp_step = None

    @classmethod
    @eager  # a compiled model's operation on the mask breaks its graph here, and is checked as in eager mode
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if compiling():  # Dynamo's own look at its input (its base, its sizes), never the model's code
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            try:
                out = func(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the model's operation on the stand-in: refused with its error
                failed = f"; it failed on hfcp's stand-in: {type(e).__name__}: {str(e).rstrip('.')}"
                raise computed_mask_error(func, failed) from e
        if not isinstance(out, torch.Tensor) or any(out is a for a in args):
            return out  # the shape, dtype, device, a test such as `mask is None`, or the stand-in itself
        token = args[0] if args and isinstance(args[0], StepToken) else None
        if func in _COPIES and token is not None and out.shape == token.shape:  # mask.to(device), mask.detach()
            return step_token(token.hfcp_step, out.device)
        raise computed_mask_error(func, "")


def step_token(step, device) -> StepToken:
    """The stand-in for the 4D mask of `step` (a StepBatch or DecodeStep) on `device`."""
    token = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device).as_subclass(StepToken)
    token.hfcp_step = step
    return token


def computed_mask_error(func, failed: str) -> Exception:
    """ValueError naming the model's line that computes a tensor from the stand-in; RuntimeError when that line is
    an attention function other than hfcp's called by a patched attention module (its attn_implementation was
    changed after hfcp.patch)."""
    frame = model_frame()
    module = frame.f_locals.get("module") if frame is not None else None
    if isinstance(module, torch.nn.Module) and getattr(module, "_hfcp_state", None) is not None:
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        return RuntimeError(
            f"{type(module).__name__} ran this forward without hfcp's attention (attn_implementation is now {impl!r}), "
            "so it would attend within this rank's shard only. Do not change the attention implementation of a "
            "patched model: hfcp.unpatch(model) first")
    name = getattr(func, "__name__", None) or repr(func)
    where = (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
             if frame is not None else "the model's code")
    return ValueError(
        f"{where} computes a new tensor from its attention mask ({name}){failed}. Under hfcp the mask argument "
        "stands for the masks hfcp builds from global token indices (causal, sliding window, padding, documents) and "
        "holds no values, so a mask the model's own code computes (over keys other than its tokens', such as "
        "compressed keys, or from the sequence length a rank sees) cannot be split exactly over the ranks: this model "
        "is not supported by hfcp (see the support matrix, docs/reference/support-matrix.md)")


def model_frame():
    """The innermost frame outside torch and hfcp (the model's code), or None."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith((_TORCH, _HFCP)):
        frame = frame.f_back
    return frame
