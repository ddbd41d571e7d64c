"""TRL's cross-process calls seen once per data-parallel group: what HfcpGRPOTrainer runs its generation, rewards and
loss under.

TRL's GRPOTrainer gathers completion lengths, rewards, token counts and metrics over all processes, slices the
advantages by `accelerator.process_index` and divides by `accelerator.num_processes`. Under CP every rank of a CP
group holds the same batch, so each would count cp times and take another rank's slice. Inside
`data_parallel_view(trainer)` the trainer's accelerator is a `DataParallelAccelerator` (process_index: the DP rank,
num_processes: the DP groups, gather / reduce: one copy per DP group), and TRL's module-level `gather` /
`gather_object` (accelerate's, imported into trl's module) do the same: the run computes what one process per DP
group computes. Gradients, DDP and the optimizer never see the view (it is left before the backward).
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from ..state import cp_state


class DataParallelAccelerator:
    """An accelerate Accelerator seen with one process per DP group (the group's first rank speaks for it).

    Every rank of a CP group holds the same values, so a gather over all processes keeping the first rank of each
    DP group is the gather one process per group would make. What is not overridden is the Accelerator's own."""

    def __init__(self, accelerator, model):
        mesh = cp_state(model).mesh
        self._accelerator = accelerator
        self.process_index, self.num_processes = mesh.dp_rank, mesh.dp_size
        self._leaders = list(mesh.data_leaders)  # the first global rank of each DP group, by DP rank
        self._world = dist.get_world_size()

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def _first_of_each_group(self, gathered: torch.Tensor) -> torch.Tensor:
        # (world * n, ...) in rank order -> (dp * n, ...)
        return gathered.reshape(self._world, -1, *gathered.shape[1:])[self._leaders].reshape(-1, *gathered.shape[1:])

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._first_of_each_group(self._accelerator.gather(tensor))

    def gather_for_metrics(self, tensor: torch.Tensor, use_gather_object: bool = False):
        if use_gather_object or not isinstance(tensor, torch.Tensor):
            return self.gather_object(tensor)
        return self.gather(tensor)  # (no remainder to drop: the training loop's batches are whole)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction={reduction!r}: the data-parallel view reduces by 'sum' or 'mean'")
        every = self.gather(tensor[None])  # (dp, ...)
        out = every.sum(0) if reduction == "sum" else every.mean(0)
        return out * scale if scale != 1.0 else out

    def gather_object(self, obj) -> list:
        """accelerate's gather_object (lists joined in rank order), one list per DP group."""
        every = [None] * self._world
        dist.all_gather_object(every, obj)
        return [x for rank in self._leaders for x in every[rank]]


@contextlib.contextmanager
def data_parallel_view(trainer, trl_module_name: str):
    """trainer.accelerator and the trl module's `gather` / `gather_object` seen once per DP group (see the module
    docstring); a no-op for an unpatched model (one process, or cp_size 1). Restored on exit, also on error."""
    if cp_state(trainer.model) is None or isinstance(trainer.accelerator, DataParallelAccelerator):
        yield
        return
    module = sys.modules[trl_module_name]
    view = DataParallelAccelerator(trainer.accelerator, trainer.model)
    saved = trainer.accelerator, module.gather, module.gather_object
    trainer.accelerator, module.gather, module.gather_object = view, view.gather, view.gather_object
    try:
        yield
    finally:
        trainer.accelerator, module.gather, module.gather_object = saved


@contextlib.contextmanager
def gathers_kept_local(trl_module_name: str):
    """The trl module's `gather` returning this rank's tensor (no collective): for a call that one rank of each CP
    group makes alone (the reward functions), whose result is then shared over the group."""
    module = sys.modules[trl_module_name]
    saved = module.gather
    module.gather = lambda tensor: tensor
    try:
        yield
    finally:
        module.gather = saved
