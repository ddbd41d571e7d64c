"""`hfcp verify`: check the patched model against the unpatched one on the user's own checkpoint and text (or a
tiny random model of a model_type) before trusting a family: loss, every gradient and the logits, per-rank memory.

Each of `cp_size` processes (gloo on CPU, NCCL on GPUs) builds the same model, runs the unpatched reference on the
whole sequence, then the patched model on its shard. Where the fp32 reference and hfcp disagree beyond tolerance,
both are compared with a float64 reference before deciding (fp32 cross-entropy over a large vocabulary is itself
off by more than hfcp's chunked loss; DESIGN.md "Accuracy reference").
"""
from __future__ import annotations

import json
import os
import resource
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .collectives import all_gather_no_grad

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


def load_model(model: str, dtype=torch.float32):
    """A checkpoint directory, or a model_type (a tiny random model of it)."""
    if Path(model, "config.json").is_file():
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=dtype, attn_implementation="sdpa")
        return m.train()
    from .tiny import tiny_model

    return tiny_model(model).to(dtype)


def token_ids(model, seq_len: int, data: str | None) -> torch.Tensor:
    """(1, seq_len) ids: the start of `data` (a text file, tokenized with the checkpoint's tokenizer), repeated to
    length, or seeded random ids."""
    vocab = model.config.get_text_config().vocab_size
    if data is None:
        return torch.randint(3, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
    ids = tok(Path(data).read_text(encoding="utf-8"))["input_ids"]
    if not ids:
        raise ValueError(f"--data {data}: no tokens")
    return torch.tensor((ids * (seq_len // len(ids) + 1))[:seq_len])[None]


def _grads(model) -> dict:
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_error(got: dict, want: dict) -> float:
    """Worst relative error over named gradients, each relative to its own max, with a floor at 1e-3 of the largest
    (a gradient that is 0 in exact arithmetic holds float noise in both computations)."""
    floor = max(1e-3 * max(float(g.abs().max()) for g in want.values()), 1e-12)
    return max(float((got[n] - want[n]).abs().max()) / max(float(want[n].abs().max()), floor) for n in want)


def _reference(model_name, ids, dtype):
    model = load_model(model_name, dtype).eval()  # eval: no dropout noise; gradients all the same
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.item(), out.logits.detach().double(), _grads(model)


def _peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_rank(model_name: str, seq_len: int, strategy: str, data: str | None) -> Report:
    """On every rank of an initialised process group (the whole world is one CP group)."""
    import hfcp

    cp = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    report = Report(model_name, seq_len, cp, strategy, "refused")
    model = load_model(model_name).to(device).eval()
    ids = token_ids(model, seq_len, data).to(device)
    ref_loss, ref_logits, ref_grads = _reference(model_name, ids.cpu(), torch.float32)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the patched step only (the reference ran on the CPU)
    try:
        hfcp.patch(model, strategy=strategy, loss_chunk=1024)  # the chunked loss of training, in eval mode
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        with torch.no_grad():
            logits = hfcp.gather_sequence(model(input_ids=ids).logits, model)
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
        loss64, logits64, grads64 = _reference(model_name, ids.cpu(), torch.float64)
        report.fp64 = {
            "hfcp": {"loss": abs(loss.item() - loss64) / abs(loss64), "grad": grad_error(grads, grads64),
                     "logits": float((logits.double().cpu() - logits64).abs().max() / logits64.abs().max())},
            "fp32_reference": {"loss": abs(ref_loss - loss64) / abs(loss64), "grad": grad_error(ref_grads, grads64)},
        }
        h = report.fp64["hfcp"]
        exact = h["loss"] < LOSS_TOL and h["grad"] < GRAD_TOL and h["logits"] < LOGIT_TOL
    report.verdict = "exact" if exact else "not exact"
    return report


def _worker(rank: int, cp: int, port: int, args: tuple, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cp),
                      LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= cp
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=cp)
    try:
        report = run_rank(*args)
        if rank == 0:
            Path(result_path).write_text(json.dumps(asdict(report)))
    finally:
        dist.destroy_process_group()


def verify(model: str, seq_len: int, cp_size: int, strategy: str = "ring", data: str | None = None) -> Report:
    """Start `cp_size` processes and return rank 0's report."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        mp.spawn(_worker, args=(cp_size, port, (model, seq_len, strategy, data), path), nprocs=cp_size, join=True)
        return Report(**json.loads(Path(path).read_text()))
