"""hfcp's own autograd-aware collectives, all in one place.

`torch.distributed.nn.functional` is deprecated and its all_gather backward was measured wrong on gloo, so every
collective that carries gradients is an explicit `torch.autograd.Function` here. Convention
(docs/concepts/exactness.md, "Gradients"): every rank of the CP group computes the same loss, so the adjoint of an
all-reduce-sum is an all-reduce-sum, and the mean of the parameter grads over the group is exact.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (now deprecated) to *_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective of hfcp failed or timed out: a peer rank raised, died or took another code path."""


@contextlib.contextmanager
def guarded(what: str, group):
    """Re-raise backend errors (timeouts, closed connections) with what hfcp was doing and what to check."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group)
        raise CollectiveError(
            f"hfcp {what} on the CP group (global ranks {ranks}) failed on rank {dist.get_rank()}: {e}. "
            "A peer rank probably raised, died or skipped this step; see the other ranks' output "
            "(hfcp.patch(timeout=...) bounds how long a rank waits)"
        ) from e


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def reduce_scatter_sum(full: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum `full` over the group and return this rank's equal slice along `dim`."""
    size, rank = group_size(group), group_rank(group)
    with guarded("reduce-scatter", group):
        if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter: all-reduce, then take the slice
            full = full.contiguous().clone()
            dist.all_reduce(full, group=group)
            return full.chunk(size, dim=dim)[rank].contiguous()
        moved = full.movedim(dim, 0).contiguous()  # (size * n, ...)
        out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=full.dtype, device=full.device)
        _reduce_scatter_single(out, moved, group=group)
        return out.movedim(0, dim).contiguous()


def all_gather_no_grad(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on all ranks) along `dim`, in group-rank order."""
    size = group_size(group)
    x = x.contiguous()
    with guarded("all-gather", group):
        if dim == 0:
            out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            _all_gather_single(out, x, group=group)
            return out
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)


def all_reduce_no_grad(x: torch.Tensor, group) -> torch.Tensor:
    """A copy of `x` summed over the group (no autograd)."""
    x = x.detach().clone()
    with guarded("all-reduce", group):
        dist.all_reduce(x, group=group)
    return x


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        with guarded("loss all-reduce", group):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        with guarded("loss all-reduce (backward)", ctx.group):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_no_grad(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sum(grad, ctx.group, ctx.dim), None, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce-sum with an all-reduce-sum backward (every rank then holds the same value)."""
    return _AllReduceSum.apply(x, group)


def pick_global_rows(x: torch.Tensor, index: torch.Tensor, step, group) -> torch.Tensor:
    """(B, L/cp, D) local sequence, (B,) global token indices -> (B, D): row b's token index[b], whole on every rank
    (the rank that holds it gives it, the others zeros; summed over the group)."""
    local = step.layout.local_index(step.rank, x.device)  # (L/cp,) global index of each local token
    hit = local[None, :] == index[:, None]  # (B, L/cp): at most one True per row, on one rank
    rows = x[torch.arange(x.shape[0], device=x.device), hit.to(torch.int32).argmax(1)]  # (B, D)
    rows = torch.where(hit.any(1)[:, None], rows, torch.zeros_like(rows))  # (no NaN from another rank's rows)
    return all_reduce_sum(rows, group)


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate the group's tensors along `dim`; backward sums the grads and returns this rank's slice."""
    return _AllGather.apply(x, group, dim)


def _all_to_all_packed(pieces: list[torch.Tensor], group) -> list[torch.Tensor]:
    """pieces[i] (size, *shape_i): slice j of every piece goes to rank j, in ONE collective; returns the
    received (size, *shape_i) tensors, whose slice j came from rank j."""
    size = group_size(group)
    flat = torch.cat([p.reshape(size, -1) for p in pieces], dim=1)  # (size, sum of numels / size)
    received = torch.empty_like(flat)
    with guarded("all-to-all", group):
        dist.all_to_all_single(received, flat, group=group)
    widths = [p[0].numel() for p in pieces]
    return [r.reshape(p.shape) for r, p in zip(received.split(widths, dim=1), pieces)]


def all_to_all_heads(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Each (B, H_i, Lc, D) -> (B, H_i/size, size*Lc, D) over (B, L, H, D) memory: head group j goes to rank j,
    and the received sequence slices are concatenated in rank order. One collective for all (no autograd)."""
    size = group_size(group)
    pieces = [t.reshape(t.shape[0], size, t.shape[1] // size, *t.shape[2:]).transpose(0, 1) for t in tensors]
    out = _all_to_all_packed(pieces, group)  # each (size, B, H/size, Lc, D), slice j from rank j
    return [o.permute(1, 0, 3, 2, 4).reshape(o.shape[1], -1, o.shape[2], o.shape[4]).transpose(1, 2) for o in out]


def all_to_all_sequence(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """The inverse of all_to_all_heads: each (B, H_i/size, size*Lc, D) -> (B, H_i, Lc, D) over (B, L, H, D) memory."""
    size = group_size(group)
    pieces = [t.reshape(t.shape[0], t.shape[1], size, -1, t.shape[3]).permute(2, 0, 1, 3, 4) for t in tensors]
    out = _all_to_all_packed(pieces, group)  # each (size, B, H/size, Lc, D), slice j = rank j's head group
    return [o.permute(1, 3, 0, 2, 4).reshape(o.shape[1], o.shape[3], -1, o.shape[4]).transpose(1, 2) for o in out]


def wire_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a contiguous tensor over t's memory to send, whether it is t.transpose(1, 2)): (B, L, H, D) memory
    viewed as (B, H, L, D) travels as it lies and the receiver transposes back; other layouts are copied."""
    if not t.is_contiguous() and t.dim() == 4 and t.transpose(1, 2).is_contiguous():
        return t.transpose(1, 2), True
    return t.contiguous(), False


class RingComm:
    """Point-to-point exchange with the neighbours of a ring: send to rank+1, receive from rank-1.

    `exchange(tensors)` starts sending `tensors` and receiving same-shaped ones; `wait()` returns them.
    One exchange may be in flight at a time per instance.
    """

    def __init__(self, group, tag: int = 0):
        self.group, self.tag = group, tag
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        self.send_to = ranks[(me + 1) % len(ranks)]
        self.recv_from = ranks[(me - 1) % len(ranks)]
        self._pending = None

    def exchange(self, tensors: list[torch.Tensor]) -> None:
        """Start sending `tensors` to the next rank and receiving same-shaped ones from the previous rank."""
        if self._pending is not None:
            raise RuntimeError("RingComm.exchange called while a previous exchange is in flight; call wait() first")
        sends, transposed = zip(*(wire_view(t) for t in tensors))  # no copy of (B, L, H, D) memory
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group, self.tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.recv_from, self.group, self.tag) for t in recvs]
        with guarded("ring exchange", self.group):
            self._pending = (dist.batch_isend_irecv(ops), recvs, sends, transposed)

    def wait(self) -> list[torch.Tensor]:
        """Finish the exchange in flight; returns the received tensors. Raises CollectiveError on failure."""
        if self._pending is None:
            raise RuntimeError("RingComm.wait called with no exchange in flight")
        works, recvs, _, transposed = self._pending
        self._pending = None
        with guarded(f"ring exchange (send to rank {self.send_to}, receive from rank {self.recv_from})", self.group):
            for w in works:
                w.wait()
        return [r.transpose(1, 2) if flip else r for r, flip in zip(recvs, transposed)]
