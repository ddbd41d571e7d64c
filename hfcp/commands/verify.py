"""`hfcp verify`: check the patched model against the unpatched one on the user's own checkpoint and text (or a
tiny random model of a model_type) before trusting a family: loss, every gradient and the logits, per-rank memory.

Each of `cp_size` processes (gloo on CPU, NCCL on GPUs) builds the same model, runs the unpatched reference on the
whole sequence, then the patched model on its shard. Where the fp32 reference and hfcp disagree beyond tolerance,
both are compared with a float64 reference before deciding (fp32 cross-entropy over a large vocabulary is itself
off by more than hfcp's chunked loss; docs/concepts/exactness.md, "The accuracy reference").

What can be checked without the processes is checked first, in the caller (verify_arguments.py); an exception raised
in a worker comes back as a `VerifyError` whose message is its one line "Type: message".
"""
from __future__ import annotations

import inspect
import json
import os
import resource
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.collectives import all_gather_no_grad
from ..testing.compare import grad_error
from .verify_arguments import VerifyError, one_line, check_arguments
from .verify_inputs import load_model, make_batch

LOSS_TOL, GRAD_TOL, LOGIT_TOL = 1e-5, 1e-4, 1e-4


@dataclass
class Report:
    model: str
    seq_len: int
    cp_size: int
    strategy: str
    verdict: str  # "exact", "not exact" or "refused"
    loss_err: float | None = None
    grad_err: float | None = None
    logit_err: float | None = None
    fp64: dict | None = None  # errors of hfcp and of the fp32 reference against float64, when consulted
    peak_mem_mb: list | None = None  # per rank: CUDA, the patched step; CPU, the process's peak RSS (all of it)
    reason: str | None = None
    head: str | None = None  # --head: a model_type's sequence or token classifier


def _grads(model) -> dict:
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model_name, batch, dtype, head=None):
    model = load_model(model_name, dtype, head).eval()  # eval: no dropout noise; gradients all the same
    if dtype == torch.float64 and getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # torch's grouped_mm (MoE experts) has no float64 kernel
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.item(), out.logits.detach().double(), _grads(model)


def _peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_rank(model_name: str, seq_len: int, strategy: str, data: str | None, head: str | None = None) -> Report:
    """On every rank of an initialised process group (the whole world is one CP group); `head`: --head."""
    import hfcp

    cp = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    report = Report(model_name, seq_len, cp, strategy, "refused", head=head)
    model = load_model(model_name, head=head).to(device).eval()
    batch = make_batch(model, seq_len, data)
    ref_loss, ref_logits, ref_grads = _reference(model_name, batch, torch.float32, head)
    batch = {k: v.to(device) for k, v in batch.items()}
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the patched step only (the reference ran on the CPU)
    try:
        hfcp.patch(model, strategy=strategy, loss_chunk=1024)  # the chunked loss of training, in eval mode
        loss = model(**batch).loss
        loss.backward()
        with torch.no_grad():
            logits = hfcp.gather_sequence(model(**inputs).logits, model)
    except ValueError as e:  # hfcp's refusals (UnsupportedModelError is one), raised on every rank
        report.reason = str(e)
        return report
    peak = torch.tensor([[_peak_mb(device)]], dtype=torch.float64, device=device)
    report.peak_mem_mb = all_gather_no_grad(peak, dist.group.WORLD, dim=0).flatten().tolist()
    grads = {n: g.to(device) for n, g in _grads(model).items()}
    for g in grads.values():  # DDP's average over the CP group: the single-device gradient
        dist.all_reduce(g)
        g /= cp
    grads = {n: g.cpu() for n, g in grads.items()}
    report.loss_err = abs(loss.item() - ref_loss) / abs(ref_loss)
    report.grad_err = grad_error(grads, ref_grads)
    report.logit_err = float((logits.double().cpu() - ref_logits).abs().max() / ref_logits.abs().max())
    exact = report.loss_err < LOSS_TOL and report.grad_err < GRAD_TOL and report.logit_err < LOGIT_TOL
    if not exact:  # decide against float64, which both fp32 computations approximate
        loss64, logits64, grads64 = _reference(model_name, {k: v.cpu() for k, v in batch.items()}, torch.float64,
                                               head)
        report.fp64 = {
            "hfcp": {"loss": abs(loss.item() - loss64) / abs(loss64), "grad": grad_error(grads, grads64),
                     "logits": float((logits.double().cpu() - logits64).abs().max() / logits64.abs().max())},
            "fp32_reference": {"loss": abs(ref_loss - loss64) / abs(loss64), "grad": grad_error(ref_grads, grads64)},
        }
        h = report.fp64["hfcp"]
        exact = h["loss"] < LOSS_TOL and h["grad"] < GRAD_TOL and h["logits"] < LOGIT_TOL
    report.verdict = "exact" if exact else "not exact"
    return report


def _error_path(tmp: str, rank: int) -> Path:
    return Path(tmp, f"error{rank}.txt")


def _worker(rank: int, cp: int, port: int, args: tuple, tmp: str) -> None:
    """Writes rank 0's report to tmp/report.json; an exception, as one line, to tmp/error{rank}.txt (exit status 1,
    no traceback: torch's spawn would carry one to the parent)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cp),
                      LOCAL_RANK=str(rank))
    try:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= cp
        if cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=cp)
        try:
            report = run_rank(*args)
            if rank == 0:
                Path(tmp, "report.json").write_text(json.dumps(asdict(report)))
        finally:
            dist.destroy_process_group()
    except Exception as e:
        _error_path(tmp, rank).write_text(one_line(e))
        sys.exit(1)


def verify(model: str, seq_len: int, cp_size: int, strategy: str = "ring", data: str | None = None,
           head: str | None = None) -> Report:
    """Check the arguments here (`check_arguments`), start `cp_size` processes and return rank 0's report. `head`
    ("sequence-classification" or "token-classification"): a model_type's tiny random model is built with the
    family's class of that head; a checkpoint's class must be of it.

    Raises:
        VerifyError: bad arguments (exit_status 2); no tiny model of the type, or an exception in a worker, whose
            message is then that exception's "Type: message" (exit_status 1).
    """
    import tempfile

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    check_arguments(model, seq_len, data, head)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(_worker, args=(cp_size, port, (model, seq_len, strategy, data, head), tmp), nprocs=cp_size,
                       join=False)
        # when one rank fails, the others get time to fail too and say why (one blocked in a collective sees its
        # peer gone) before torch terminates them (grace_period: torch 2.5 and later)
        grace = {"grace_period": 10.0} if "grace_period" in inspect.signature(ctx.join).parameters else {}
        try:
            while not ctx.join(**grace):
                pass
        except ProcessException as e:  # the first rank to fail first, then the others (a peer's failure as seen)
            for rank in [e.error_index, *range(cp_size)]:
                if _error_path(tmp, rank).is_file():
                    raise VerifyError(_error_path(tmp, rank).read_text()) from None
            raise VerifyError(one_line(e)) from None  # killed (a signal) or exited without an exception
        return Report(**json.loads(Path(tmp, "report.json").read_text()))
