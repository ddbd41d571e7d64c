"""A patched model's local sequence outputs made whole: one tensor (gather_sequence) or a model's outputs whatever
their form (gather_outputs: ModelOutput or tuple)."""
from __future__ import annotations

import torch

from ..distributed.collectives import all_gather
from ..state import cp_state


def gather_outputs(outputs, model):
    """The output of the patched model's latest forward with every local sequence tensor made whole.

    For evaluation loops of one's own: what HfcpTrainer's evaluate / predict return. Gathered are the tensors hfcp
    stamped as sequence outputs and, in the fields it recorded as local, those of the local length (DeepSpeed
    ZeRO-3's forward hooks hand back new tensor objects without the stamp); MoE router logits come back whole in
    the original token order. Gather before the next forward, as for `gather_sequence`.

    Args:
        outputs: a ModelOutput (changed in place and returned) or a tuple, from the latest forward of `model`.
        model: the patched model (PEFT / DDP wrappers are looked through).
    Returns:
        The outputs with whole sequences (original order and length) on every rank of the CP group; on a model
        that is not patched (or runs unchanged: one process, cp_size 1), `outputs` unchanged, as `gather_sequence`.
    Raises:
        RuntimeError: the patched model has run no forward yet.
        ValueError: as `gather_sequence` (an output of an earlier forward).
    """
    state = cp_state(model)
    if state is None:
        return outputs
    if state.step is None:
        raise RuntimeError("gather_outputs needs the outputs of a forward of the patched model, and this model has "
                           "run none since hfcp.patch: call the model first, then gather its outputs")
    local_len = state.step.layout.local_len

    def whole(v, named):
        if isinstance(v, tuple):
            return tuple(whole(x, named) for x in v)
        if isinstance(v, torch.Tensor) and (getattr(v, "hfcp_step", None) is not None
                                            or (named and v.dim() >= 2 and v.shape[1] == local_len)):
            return gather_sequence(v, model)
        return v

    if isinstance(outputs, tuple):
        return whole(outputs, False)
    for key in list(outputs.keys()):
        if key == "router_logits":  # (tokens, experts) rows per MoE layer: whole, in the original token order
            outputs[key] = tuple(gather_sequence(t.reshape(-1, local_len, t.shape[-1]), model).flatten(0, 1)
                                 for t in outputs[key])
        else:
            outputs[key] = whole(outputs[key], key in state.fwd.local_output_names)
    return outputs


def gather_sequence(tensor: torch.Tensor, model, dim: int = 1) -> torch.Tensor:
    """The full sequence (original order and length) of a local sequence output such as logits.

    Applies to outputs of the model's latest forward (the layout is per step); gather before the next forward.
    The model's own outputs carry their step: one from an earlier forward, or a dim other than their sequence
    dimension, is refused (ValueError).

    Differentiable: the backward sums over the CP group and returns each rank its slice (consistent with the
    loss convention, so mean-over-group grads stay exact). Unpatched models: returns `tensor` unchanged.
    """
    state = cp_state(model)
    if state is None or getattr(tensor, "hfcp_whole", False):  # (logits_to_keep's logits: the same on every rank)
        return tensor
    if state.step is None:
        raise RuntimeError("gather_sequence needs the output of a forward of the patched model")
    layout = state.step.layout
    stamp = getattr(tensor, "hfcp_step", None)  # set on the model's own sequence outputs
    if stamp is not None and stamp is not state.step:
        raise ValueError("gather_sequence got an output of an earlier forward; the layout is per step, so gather "
                         "each output before the next forward of the model")
    if stamp is not None and dim % tensor.dim() != 1:
        raise ValueError(f"gather_sequence(dim={dim}) of a model output of shape {tuple(tensor.shape)}: its sequence "
                         "dimension is 1 (batch, seq, ...); pass dim=1")
    if tensor.shape[dim] != layout.local_len:
        raise ValueError(f"tensor has {tensor.shape[dim]} tokens along dim {dim}; "
                         f"the local slice has {layout.local_len}")
    full = all_gather(tensor, state.mesh.cp_group, dim)
    return full.index_select(dim, layout.gathered_inverse(full.device))
