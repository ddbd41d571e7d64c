"""PipelineRunner: one training or evaluation step of a causal LM over pipeline stages x CP (docs/how-to/pipeline.md).

The world is laid out (pp, dp, cp), cp innermost: rank = (stage * dp + d) * cp + c. Ranks of one stage and one data
group form a CP group (hfcp.patch's consecutive blocks); a stage's rank talks to the rank of the same (d, c) in the
stage before and after it. A microbatch's forward runs the model from the top on every stage (stage.py), so each
stage computes the microbatch's CP layout itself from the same batch; the hidden states that travel between stages
are this rank's shard, (rows, L / cp, hidden).

The loss of a step is the one-process loss of the whole batch: each microbatch's loss is its targets' summed
cross-entropy over the batch's target count (num_items_in_batch), so the microbatch losses add up to it and their
gradients to its gradient. After the last backward each stage's gradients are averaged over its dp x cp ranks
(hfcp's convention: the mean over a CP group is the one-device gradient; then over the data groups), and a weight
tied between the first and the last stage gets the sum of both stages' gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.input_checks import batch_digest
from ..distributed.collectives import all_gather_no_grad
from .schedule import actions
from .stage import StageDone


class PipelineRunner:
    """Made by `hfcp.pipeline`; see its docstring."""

    def __init__(self, model, mine: dict, layout: dict, groups: dict, schedule: str, microbatches: int, tied,
                 check_inputs: bool = True):
        self.model, self.check_inputs = model, check_inputs
        self._mine = mine  # {name: parameter} of this stage
        self.stage, self.stages = layout["stage"], layout["stages"]
        self.dp, self.cp, self.rank = layout["dp"], layout["cp"], layout["rank"]
        self._groups, self.schedule, self.microbatches, self._tied = groups, schedule, microbatches, tied
        self._stride = self.dp * self.cp  # ranks between one stage's rank and the next stage's
        self._record = None  # the microbatch whose forward runs now: what its stage received
        self._pending = []  # sends not posted yet: (tensor, peer, tag), posted with the next receive from that peer
        self._sends = []  # posted sends: (work, tensor) until they complete, the rest waited for at the step's end

    # ---- what a training loop calls ---------------------------------------------------------------------------
    def named_parameters(self):
        """(name, parameter) of this rank's stage, the names as in the model given to hfcp.pipeline."""
        return iter(self._mine.items())

    def parameters(self):
        return iter(self._mine.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._mine.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale this stage's gradients as torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) scales the
        whole model's on one process: the norm is over every stage's gradients (a tied weight counted once), summed
        across the stages. Call after `step`; returns that norm (fp32) on every rank."""
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or max_norm <= 0:
            raise ValueError(f"hfcp.pipeline: clip_grad_norm_(max_norm={max_norm!r}) needs a positive number")
        twice = self._tied is not None and self.last and not self.first  # (the first stage counts it)
        grads = [p.grad for p in self._mine.values() if p.grad is not None]
        counted = [p.grad for p in self._mine.values() if p.grad is not None and not (twice and p is self._tied)]
        device = next(iter(self._mine.values())).device
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for g in counted:
            squares += g.double().pow(2).sum()
        if self.stages > 1:
            dist.all_reduce(squares, group=self._groups["pipe"])
        norm = squares.sqrt().float()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm

    def train(self, mode: bool = True) -> "PipelineRunner":
        self.model.train(mode)
        return self

    def eval(self) -> "PipelineRunner":
        return self.train(False)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def step(self, **batch) -> torch.Tensor:
        """Forward and backward of the whole batch (every rank of a data group passes the same one) in
        n_microbatches microbatches by the schedule. Returns the batch's loss on every rank (as one process computes
        it); each of this stage's parameters then holds in .grad (added to what it held) the one-process gradient of
        that loss, averaged over the data groups.

        Raises:
            ValueError: n_microbatches not dividing the rows, no labels, a batch tensor of another row count.
        """
        micro, count = self._microbatches(batch, need_labels=True)
        kept = {p: p.grad for p in self._mine.values()}  # earlier steps' gradients: reduced already
        for p in kept:
            p.grad = None
        records, losses = {}, []
        order = actions(self.schedule, self.stage, self.stages, self.microbatches)
        for i, (kind, m) in enumerate(order):
            if kind == "F":
                records[m] = self._forward(micro[m], m, count)
                losses += [records[m]["loss"].detach()] if self.last else []
            else:
                self._backward(records.pop(m), m)
            self._post_sends(keep_for=self._first_peer(order[i + 1]) if i + 1 < len(order) else None)
        self._wait_sends()
        self._reduce_gradients()
        for p, g in kept.items():
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        return self._broadcast_loss(losses, batch["input_ids"].device)

    @torch.no_grad()
    def eval_step(self, **batch) -> torch.Tensor:
        """The batch's loss (labels given) without gradients, as `step` computes it, on every rank."""
        micro, count = self._microbatches(batch, need_labels=True)
        records = []
        for m in range(self.microbatches):
            records.append(self._forward(micro[m], m, count))
            self._post_sends(keep_for=self._first_peer(("F", m + 1)) if m + 1 < self.microbatches else None)
        self._wait_sends()
        return self._broadcast_loss([r["loss"] for r in records] if self.last else [], batch["input_ids"].device)

    # ---- one microbatch ------------------------------------------------------------------------------------
    def _forward(self, batch: dict, m: int, count: int) -> dict:
        record = self._record = {"m": m}
        kwargs = dict(batch, use_cache=False)
        if self.last:
            kwargs["num_items_in_batch"] = count
        else:
            kwargs.pop("labels", None)
        try:
            out = self.model(**kwargs)
        except StageDone as done:
            record["out"] = done.hidden
            self._send(done.hidden.detach(), self.rank + self._stride, tag=m)
        else:
            if not self.last:
                raise RuntimeError(f"hfcp.pipeline: stage {self.stage}'s forward ran past its last layer")
            record["loss"] = out.loss
        finally:
            self._record = None
        return record

    def _backward(self, record: dict, m: int) -> None:
        if self.last:
            loss = record["loss"]
            if loss.requires_grad:
                loss.backward()
        else:
            out = record["out"]
            grad = self._receive(out, self.rank + self._stride, tag=self.microbatches + m)
            if out.requires_grad:
                torch.autograd.backward(out, grad)
        received = record.get("received")
        if received is not None:
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            self._send(grad, self.rank - self._stride, tag=self.microbatches + m)

    def receive_hidden(self, like: torch.Tensor) -> torch.Tensor:
        """The previous stage's output for the microbatch whose forward runs now (stage.py's receiving layer)."""
        record = self._record
        if record is None:
            raise RuntimeError("hfcp.pipeline: a stage's layers ran outside PipelineRunner.step / eval_step")
        hidden = self._receive(like, self.rank - self._stride, tag=record["m"])
        if torch.is_grad_enabled():
            hidden.requires_grad_(True)
        record["received"] = hidden
        return hidden

    # ---- point to point ------------------------------------------------------------------------------------
    # A send waits for the action that follows: when that action starts by receiving from the same peer (1F1B's
    # steady state: an activation out, then a gradient in), both are posted together in one batch_isend_irecv,
    # which NCCL needs (its sends and receives between two ranks run in posting order on one stream: a send posted
    # before the receive the peer waits for would never start); otherwise the send is posted at once.
    def _first_peer(self, action) -> int | None:
        """The peer the action receives from first: a forward from the previous stage, a backward from the next."""
        kind, _ = action
        if kind == "F":
            return None if self.first else self.rank - self._stride
        return None if self.last else self.rank + self._stride

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._pending.append((tensor.contiguous(), peer, tag))

    def _post_sends(self, keep_for: int | None = None) -> None:
        """Post the pending sends, but those to `keep_for` (they go with the next receive from it)."""
        kept = [s for s in self._pending if s[1] == keep_for]
        unsent = []
        for work, tensor in self._sends:
            if self._sent(work):
                work.wait()  # (at once: a completed send, its tensor released; a failed one raises here)
            else:
                unsent.append((work, tensor))
        self._sends = unsent
        for tensor, peer, tag in self._pending:
            if peer != keep_for:
                self._sends.append((dist.isend(tensor, peer, tag=tag), tensor))  # (kept alive until sent)
        self._pending = kept

    @staticmethod
    def _sent(work) -> bool:
        """Whether a posted send has completed (its tensor no longer needed)."""
        return work.is_completed()

    def _receive(self, like: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        """A tensor shaped like `like` from `peer`, received together with the pending sends to that peer."""
        buffer = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        self._post_sends(keep_for=peer)
        ops = [dist.P2POp(dist.isend, t, p, tag=tag_) for t, p, tag_ in self._pending]
        works = dist.batch_isend_irecv(ops + [dist.P2POp(dist.irecv, buffer, peer, tag=tag)])
        self._sends += [(w, t) for w, (t, _, _) in zip(works, self._pending)]
        self._pending = []
        works[-1].wait()
        return buffer

    def _wait_sends(self) -> None:
        self._post_sends()
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    # ---- the step's data, loss and gradients -----------------------------------------------------------------
    def _microbatches(self, batch: dict, need_labels: bool) -> tuple[list[dict], int]:
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"hfcp.pipeline: input_ids of shape {tuple(getattr(ids, 'shape', ()))}; pass (rows, seq)")
        rows = ids.shape[0]
        if rows % self.microbatches:
            raise ValueError(f"hfcp.pipeline: {rows} rows do not divide into n_microbatches={self.microbatches}; pass "
                             f"a multiple of {self.microbatches} rows (or another n_microbatches)")
        if need_labels and batch.get("labels") is None:
            raise ValueError("hfcp.pipeline: step() and eval_step() need labels "
                             "(the loss is computed on the last stage)")
        other = sorted(k for k in ("num_items_in_batch", "ignore_index", "shift_labels") if batch.get(k) is not None)
        if other:  # the step counts the batch's targets itself: labels[:, 1:] != -100
            raise ValueError(f"hfcp.pipeline: {', '.join(other)} passed to a step: the step computes the loss over the "
                             "batch's targets (labels shifted by one, -100 ignored) itself; pass labels only")
        batch = dict(batch)
        pos = batch.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[0] == 1 and rows > 1:
            batch["position_ids"] = pos.expand(rows, -1)  # (a (1, seq) row for every row, split with them)
        for name, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] != rows:
                raise ValueError(f"hfcp.pipeline: {name} has {v.shape[0]} rows, input_ids {rows}; pass one per row")
        size = rows // self.microbatches
        micro = [{k: (v[i * size:(i + 1) * size] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v)
                  for k, v in batch.items()} for i in range(self.microbatches)]
        count = int((batch["labels"][:, 1:] != -100).sum())  # the batch's targets (labels shifted by one)
        if self.check_inputs and self.stages > 1:
            self._check_same_batch(batch)
        return micro, count

    def _check_same_batch(self, batch: dict) -> None:
        """Every stage of this (d, c) line must get the same batch (each computes the layout, the last the targets,
        from its own): one small all-gather of digests, after which every rank raises alike."""
        names = tuple(sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor)))
        device = batch["input_ids"].device if dist.get_backend(self._groups["pipe"]) == "nccl" else None
        every = all_gather_no_grad(batch_digest(batch, names, device)[None], self._groups["pipe"], dim=0).cpu()
        differs = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
        if differs:
            ranks = self._groups["pipe_ranks"]
            raise ValueError(f"hfcp.pipeline: the stages of one data group got different batches (global ranks "
                             f"{[ranks[r] for r in differs]} differ from rank {ranks[0]}): every rank of a data group "
                             "passes the same full batch; shard the data by hfcp.data_parallel_rank_and_size(model), "
                             "which gives the pipeline's data groups")

    def _broadcast_loss(self, losses: list[torch.Tensor], device) -> torch.Tensor:
        """The batch's loss (the sum of the last stage's microbatch losses) on every stage of this (d, c)."""
        loss = torch.stack(losses).double().sum() if self.last else torch.zeros((), dtype=torch.float64, device=device)
        if self.stages > 1:
            dist.broadcast(loss, self._groups["pipe_ranks"][-1], group=self._groups["pipe"])
        return loss.float()

    def _reduce_gradients(self) -> None:
        """This step's gradients: the mean over the stage's dp x cp ranks, then a tied weight's summed over its two
        stages (the first and the last). The mean is taken in fp32 a bucket of REDUCE_BUCKET elements at a time
        (slices of a larger gradient included), each written back into its gradient: beside the gradients the
        reduction holds one bucket, not an fp32 copy of them all."""
        with torch.no_grad():
            params = [p for p in self._mine.values() if p.requires_grad]
            if self._stride > 1 and params:
                for p, some in zip(params, self._gradient_somewhere(params)):
                    if not some:
                        p.grad = None  # (no rank of the stage has one: none, as without pipelining)
                    elif p.grad is None:
                        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)  # (another rank has
                        # one: this rank adds zeros)
                    elif not p.grad.is_contiguous():
                        p.grad = p.grad.contiguous()
                for bucket in _buckets([p.grad for p in params if p.grad is not None], REDUCE_BUCKET):
                    flat = torch.empty(sum(b - a for _, a, b in bucket), dtype=torch.float32,
                                       device=bucket[0][0].device)
                    pieces = flat.split([b - a for _, a, b in bucket])
                    for (g, a, b), piece in zip(bucket, pieces):
                        piece.copy_(g.view(-1)[a:b])
                    dist.all_reduce(flat, group=self._groups["stage"])
                    flat /= self._stride
                    for (g, a, b), piece in zip(bucket, pieces):
                        g.view(-1)[a:b].copy_(piece)
                    del flat, pieces
            tied = self._tied
            if tied is not None and tied.grad is not None:
                dist.all_reduce(tied.grad, group=self._groups["tied"])

    def _gradient_somewhere(self, params: list) -> list[bool]:
        """For each parameter, whether any rank of the stage has a gradient of it (a mixture's expert that no token
        of this rank chose has none here): one small all-reduce and one device-to-host read."""
        had = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        dist.all_reduce(had, group=self._groups["stage"])
        return [n > 0 for n in had.tolist()]


REDUCE_BUCKET = 2 ** 24  # fp32 elements (64 MiB) the gradient reduction holds at once beside the gradients


def _buckets(grads: list, size: int) -> list[list[tuple]]:
    """(gradient, start, stop) slices of the flattened gradients, in order, grouped into buckets of at most `size`
    elements (a gradient larger than a bucket is cut into slices)."""
    out, bucket, room = [], [], size
    for g in grads:
        start, n = 0, g.numel()
        while start < n:
            stop = min(n, start + room)
            bucket.append((g, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                out.append(bucket)
                bucket, room = [], size
    return out + ([bucket] if bucket else [])
