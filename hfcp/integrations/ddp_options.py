"""The DDP options a CP trainer needs that a one-process Trainer never does.

Under CP the trainers always wrap the model in DDP (its gradient average over the CP group is what makes the
gradients exact, docs/concepts/exactness.md), even at dp 1 where the user chose no DDP at all. Reentrant activation
checkpointing under DDP needs `static_graph=True` (or `find_unused_parameters=False`): with the Trainer's default for a
PEFT model (`find_unused_parameters=True`), DDP marks the adapters of every checkpointed layer unused in the forward
(run without autograd) and then ready a second time in the recompute ("Expected to mark a variable ready only once").
"""
from __future__ import annotations

import functools
import logging

from accelerate.utils import DistributedDataParallelKwargs

from ..state import find_pretrained

log = logging.getLogger("hfcp")


def reentrant_checkpointing(args, model) -> bool:
    """Whether training checkpoints with reentrant autograd: asked for by the TrainingArguments (the Trainer enables
    it in train()), or enabled on the model already (torch's default when use_reentrant is not given: True)."""
    on = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None)
    if on and isinstance(kwargs, dict) and kwargs.get("use_reentrant"):
        return True
    if model is None:
        return False
    for module in find_pretrained(model).modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and isinstance(fn, functools.partial) \
                and fn.keywords.get("use_reentrant", True) is not False:
            return True
    return False


def static_graph_for_reentrant_checkpointing(trainer) -> None:
    """Give the trainer's DDP `static_graph=True` when training checkpoints with reentrant autograd and the user set
    no `ddp_static_graph`.

    Raises:
        ValueError: ddp_static_graph=False with find_unused_parameters on: DDP would crash in the first backward.
    """
    acc = trainer.accelerator
    ddp = acc.num_processes > 1 and acc.distributed_type.value.startswith("MULTI_")  # (not DeepSpeed, FSDP)
    if not ddp or not reentrant_checkpointing(trainer.args, trainer.model):
        return
    handler = acc.ddp_handler or DistributedDataParallelKwargs()
    static = trainer.args.ddp_static_graph
    if static is False and handler.find_unused_parameters:
        raise ValueError(
            f"{type(trainer).__name__}: reentrant gradient checkpointing (use_reentrant=True) under DDP with "
            "ddp_static_graph=False and find_unused_parameters=True fails in the first backward (DDP marks each "
            "checkpointed layer's parameters ready twice); under CP the model is always wrapped in DDP: leave "
            "ddp_static_graph unset (hfcp then sets it), set ddp_find_unused_parameters=False, or checkpoint with "
            "use_reentrant=False")
    if static is None and not handler.static_graph:
        handler.static_graph = True
        acc.ddp_handler = handler
        log.info("hfcp: reentrant gradient checkpointing under DDP: static_graph=True (set ddp_static_graph to choose)")
