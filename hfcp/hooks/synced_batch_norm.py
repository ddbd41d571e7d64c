"""Batch norm in an encoder whose clips are split over the CP group (Granite Speech's Conformer): statistics over the
group's clips, as one device computes them over all of its clips.

In training, batch norm normalises each channel by the mean and variance over every element of the call but the
channel (the clips and their frames), and moves its running statistics towards them. Split, each rank would see its
own share only. Bound for the time the model is patched, each batch norm of the tower here sums over the CP group
(hfcp's autograd all-reduce, gloo and NCCL alike): the count and sum of its elements, then, around the mean, the sum
of squares (two passes, as one device's variance; SyncBatchNorm's one-pass merge differs in its last bits). The
stand-in clips that pad a rank's share count for nothing. Every rank then normalises with the same mean and biased
variance and updates its running statistics alike, with the unbiased variance as torch does. In evaluation
(running statistics) the module's own forward runs.
"""
from __future__ import annotations

import types

import torch

from ..compiler import eager
from ..distributed.collectives import all_reduce_sum


def bind_batch_norms(tower: torch.nn.Module, valid_rows, group) -> list[torch.nn.Module]:
    """Give every batch norm of `tower` the group's statistics in training. valid_rows(): (k,) bool, which rows of
    this rank's share of the current call are clips of the batch (False: the copies that pad the share). Returns
    the modules, for `unbind_batch_norms`. (A batch norm with a forward of its own is refused at patch time:
    hfcp/families/resolve.py.)"""
    norms = [m for m in tower.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.forward = types.MethodType(eager(_synced_forward(valid_rows, group)), m)
    return norms


def unbind_batch_norms(norms: list[torch.nn.Module]) -> None:
    for m in norms:
        del m.forward  # back to the class's forward


def _synced_forward(valid_rows, group):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training or self.running_mean is None):  # running statistics: the same on every rank
            return type(self).forward(self, x)
        self._check_input_dim(x)
        return synced_batch_norm(self, x, valid_rows().to(x.device), group)
    return forward


def synced_batch_norm(bn, x: torch.Tensor, valid: torch.Tensor, group) -> torch.Tensor:
    """Batch norm of x (k, C, *) with the mean and variance over the valid rows of every rank of `group`; updates
    bn's running statistics as torch's batch norm does (momentum, or the cumulative average when it is None)."""
    if valid.shape != x.shape[:1]:
        raise RuntimeError(f"hfcp: {type(bn).__name__} got {x.shape[0]} rows, but this rank's share of the encoder's "
                           f"call holds {valid.shape[0]}: a batch norm over other rows than the encoder's clips")
    dtype, x = x.dtype, x.float()  # (statistics in fp32, as torch's batch norm keeps them for bf16 / fp16 inputs)
    shape = (1, -1) + (1,) * (x.dim() - 2)  # a channel's values broadcast over (rows, channel, frames...)
    dims = [0, *range(2, x.dim())]
    weight = valid.to(x.dtype).view(-1, *(1,) * (x.dim() - 1))
    count = (valid.sum() * x[0, 0].numel()).to(x.dtype).reshape(1)
    sums = all_reduce_sum(torch.cat([(x * weight).sum(dims), count]), group)  # (C + 1,): the group's sums, its count
    n = sums[-1].detach()
    mean = sums[:-1] / n
    centred = x - mean.view(shape)
    var = all_reduce_sum((centred.square() * weight).sum(dims), group) / n  # biased, as normalisation uses
    out = centred * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        out = out * bn.weight.float().view(shape) + bn.bias.float().view(shape)
    if bn.training and bn.track_running_stats:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            factor = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.mul_(1 - factor).add_(mean.detach().to(bn.running_mean.dtype), alpha=factor)
            unbiased = var.detach() * n / (n - 1).clamp(min=1)
            bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
    return out.to(dtype)
