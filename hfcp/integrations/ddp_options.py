"""The DDP options a CP trainer needs that a one-process Trainer never does.

Under CP the trainers always wrap the model in DDP (its gradient average over the CP group is what makes the
gradients exact, docs/concepts/exactness.md), even at dp 1 where the user chose no DDP at all. Reentrant activation
checkpointing runs each checkpointed layer's backward as a nested backward, and of DDP's three modes only one runs
it in every case (checked with torch 2.13, LoRA and full weights, with and without gradient accumulation):
- `find_unused_parameters=True` (the Trainer's default for a PEFT model): DDP marks the weights of every checkpointed
  layer unused in the forward (run without autograd) and then ready a second time in the recompute ("Expected to
  mark a variable ready only once");
- `static_graph=True`: exact without gradient accumulation, but under the accumulation's `no_sync` the first synced
  backward fails DDP's internal assert (`expect_autograd_hooks_` in reducer.cpp), with or without hfcp;
- `find_unused_parameters=False`, `static_graph=False`: exact in every case. hfcp chooses it when the user set
  neither option; a combination set by the user that would crash is refused before the first step.
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
    kwargs = (getattr(args, "activation_checkpointing_kwargs", None)
              or getattr(args, "gradient_checkpointing_kwargs", None))
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


def ddp_options_for_reentrant_checkpointing(trainer) -> None:
    """When training checkpoints with reentrant autograd under DDP: `find_unused_parameters=False` where the user set
    neither `ddp_find_unused_parameters` nor `ddp_static_graph`, else the user's choice where DDP runs it.

    Raises:
        ValueError: a combination of the user's that DDP cannot run (named, with what to set instead).
    """
    acc = trainer.accelerator
    ddp = acc.num_processes > 1 and acc.distributed_type.value.startswith("MULTI_")  # (not DeepSpeed, FSDP)
    if not ddp or not reentrant_checkpointing(trainer.args, trainer.model):
        return
    args = trainer.args
    handler = acc.ddp_handler or DistributedDataParallelKwargs()
    static, unused = args.ddp_static_graph, args.ddp_find_unused_parameters
    accumulation = args.gradient_accumulation_steps
    fixes = ("leave ddp_static_graph and ddp_find_unused_parameters unset (hfcp then sets "
             "find_unused_parameters=False), or checkpoint with use_reentrant=False")
    if static is None and unused is None:
        if handler.find_unused_parameters or handler.static_graph:
            handler.find_unused_parameters = handler.static_graph = False
            acc.ddp_handler = handler
            log.info("hfcp: reentrant gradient checkpointing under DDP: find_unused_parameters=False "
                     "(set ddp_find_unused_parameters / ddp_static_graph to choose)")
        return
    problem = None
    if static and accumulation > 1:
        problem = (f"ddp_static_graph=True with gradient_accumulation_steps={accumulation} fails DDP's internal "
                   "assert (expect_autograd_hooks_) in the first synced backward")
    elif not static and handler.find_unused_parameters:
        problem = ("find_unused_parameters=True without ddp_static_graph fails in the first backward (DDP marks "
                   "each checkpointed layer's parameters ready twice)")
        if static is None and accumulation == 1:  # static_graph runs it: the user asked for unused parameters
            handler.static_graph, problem = True, None
            acc.ddp_handler = handler
            log.info("hfcp: reentrant gradient checkpointing under DDP with find_unused_parameters=True: "
                     "static_graph=True (set ddp_static_graph to choose)")
    if problem is not None:
        raise ValueError(f"{type(trainer).__name__}: reentrant gradient checkpointing (use_reentrant=True) under DDP "
                         f"(under CP the model is always wrapped in DDP): {problem}; {fixes}")
