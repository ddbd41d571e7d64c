"""Model outputs whatever their form (ModelOutput or tuple): their local sequences made whole."""
from __future__ import annotations

import torch

from .api import gather_sequence
from .state import cp_state


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
