"""`hfcp verify`: check the patched model against the unpatched one on the user's own checkpoint and text (or a
tiny random model of a model_type) before trusting a family: loss, every gradient and the logits, per-rank memory.

Each of `cp_size` processes (gloo on CPU, NCCL on GPUs) builds the same model, runs the unpatched reference on the
whole sequence, then the patched model on its shard. Where the fp32 reference and hfcp disagree beyond tolerance,
both are compared with a float64 reference before deciding (fp32 cross-entropy over a large vocabulary is itself
off by more than hfcp's chunked loss; docs/concepts/exactness.md, "The accuracy reference").

What can be checked without the processes is checked first, in the caller (`check_arguments`); an exception raised in
a worker comes back as a `VerifyError` whose message is its one line "Type: message".
"""
from __future__ import annotations

import difflib
import functools
import inspect
import json
import os
import resource
import socket
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.collectives import all_gather_no_grad

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


class VerifyError(Exception):
    """`hfcp verify` gave no verdict. `exit_status`: 2 for bad arguments (found before any process starts), 1 where
    no tiny random model of the type could be built or a worker raised (the message is then "Type: message")."""

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _is_checkpoint(model: str) -> bool:
    return Path(model, "config.json").is_file()


def position_limit(model) -> tuple[int, str] | None:
    """The longest sequence `model`'s learned position table holds, and the table's name; None without one (rotary,
    ALiBi, no positions: any length runs). A table: an embedding other than the input embeddings with
    max_position_embeddings rows (up to 2 more: OPT's offset). Works on a model on the meta device. (Fixed tables held
    in buffers are not looked for: XGLM's grows with the sequence, CTRL's does not; the worker then says so.)"""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    try:
        inputs = model.get_input_embeddings()
    except NotImplementedError:
        inputs = None
    tables = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Embedding) and m is not inputs and limit <= m.num_embeddings <= limit + 2]
    return (limit, tables[0]) if tables else None


def check_arguments(model: str, seq_len: int, data: str | None = None) -> None:
    """Check in the calling process what needs no worker: `model` is a checkpoint directory (config.json of a causal
    LM) or a causal-LM model_type (whose tiny random model is built here), `data` goes with a checkpoint and gives
    tokens, and `seq_len` fits the model's position table where it has one.

    Raises:
        VerifyError: exit_status 2 for bad arguments; 1 where hfcp.testing.tiny builds no tiny random model of the type.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    if not _is_checkpoint(model) and model in VLM_TYPES():  # a tiny random VLM: checked with text and images
        _check_tiny_vlm(model, seq_len, data)
        return
    if _is_checkpoint(model):
        built = _check_checkpoint(model, seq_len, data)
        what = f"the checkpoint {model}"
    elif model in CAUSAL_LM:
        built = _check_tiny_model(model, data)
        what = f"the tiny random {model} of hfcp.testing.tiny"
    else:
        raise _unknown_model(model)
    table = position_limit(built) if built is not None else None
    if table is not None and seq_len > table[0]:
        raise VerifyError(f"--seq-len {seq_len} is more than the {table[0]} positions of {what} (its position table "
                          f"{table[1]}, max_position_embeddings={table[0]}): pass --seq-len {table[0]} or less", 2)


def _check_tiny_vlm(model: str, seq_len: int, data: str | None) -> None:
    if data is not None:
        raise VerifyError(f"--data {data} needs a checkpoint directory (its tokenizer): the tiny random {model} "
                          "has no tokenizer; leave out --data", 2)
    try:
        built = load_model(model)
        from ..testing.tiny_vlm import image_batch

        image_batch(built, seq_len)
    except Exception as e:
        raise VerifyError(f"{_one_line(e)} (hfcp.testing.tiny_vlm builds no tiny random {model} with images of "
                          f"--seq-len {seq_len}: pass a longer --seq-len or a checkpoint directory)", 1) from e


def _check_checkpoint(model: str, seq_len: int, data: str | None):
    """The checkpoint's config and data checked; its modules on the meta device when seq_len passes the positions
    its config names (to look for a position table), else None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    try:
        config = transformers.AutoConfig.from_pretrained(model)
    except Exception as e:
        raise VerifyError(f"--model {model}: its config.json does not load ({_one_line(e)})", 2) from e
    if config.model_type not in CAUSAL_LM and config.model_type not in VLM_TYPES():
        raise VerifyError(f"--model {model}: its config.json has model_type {config.model_type!r}, which has "
                          f"no causal-LM or image-text-to-text class in transformers {transformers.__version__} "
                          f"(AutoModelForCausalLM, AutoModelForImageTextToText): pass such a checkpoint", 2)
    if data is not None:
        _check_data(model, data, config.get_text_config().vocab_size)
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int) or seq_len <= limit:
        return None  # within the positions the config names, or none named: nothing to look for
    try:
        with torch.device("meta"):  # the model's modules, no weights: whether it has a position table
            return _auto_class(config.model_type, config).from_config(config)
    except Exception:
        return None  # the workers will say what fails, one line


def _check_data(model: str, data: str, vocab: int) -> None:
    import transformers

    if not Path(data).is_file():
        raise VerifyError(f"--data {data}: no such file", 2)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(model)
        ids = tok(Path(data).read_text(encoding="utf-8"))["input_ids"]
    except Exception as e:
        why = f"not tokenized with {model}'s tokenizer ({_one_line(e)})"
        raise VerifyError(f"--data {data}: {why}: save the checkpoint's tokenizer into it (save_pretrained), "
                          f"or leave out --data", 2) from e
    if not ids or max(ids) >= vocab:  # no tokenizer saved: transformers makes an empty one of the family
        got = "no tokens" if not ids else f"id {max(ids)}, beyond the model's vocab_size {vocab}"
        raise VerifyError(f"--data {data}: {model}'s tokenizer ({type(tok).__name__}, {len(tok)} entries) "
                          f"gives {got}: pass a text file with text, and save the checkpoint's own tokenizer "
                          f"into {model} (save_pretrained)", 2)


def _check_tiny_model(model: str, data: str | None):
    if data is not None:
        from ..testing.tiny import TINY

        raise VerifyError(f"--data {data} needs a checkpoint directory (its tokenizer): the tiny random {model} "
                          f"has a random vocabulary of {TINY['vocab_size']} ids and no tokenizer; leave out --data "
                          f"(seeded random ids) or pass a checkpoint directory", 2)
    try:
        return load_model(model)
    except Exception as e:
        raise VerifyError(f"{_one_line(e)} (hfcp.testing.tiny builds no tiny random model of {model}: verify a "
                          f"checkpoint directory of it instead)", 1) from e


def _unknown_model(model: str) -> VerifyError:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    where = ("a directory without config.json" if Path(model).is_dir()
             else "a file, not a directory" if Path(model).exists() else "no such directory")
    close = difflib.get_close_matches(model, CAUSAL_LM, n=3)
    hint = f" (close: {', '.join(close)})" if close else ""
    return VerifyError(f"--model {model}: {where}, and not a causal-LM or image-text-to-text model_type of "
                       f"transformers {transformers.__version__}{hint}: pass a checkpoint directory (with "
                       f"config.json, as save_pretrained writes) or one of the {len(CAUSAL_LM)} types of "
                       f"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or the {len(VLM_TYPES())} of "
                       f"MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", 2)


@functools.lru_cache(maxsize=1)
def VLM_TYPES():  # noqa: N802 - a constant of the installed transformers
    """The image-text-to-text model_types of transformers, verified as VLMs (with images): those that are not also
    causal-LM types, and those that are but whose config has a vision part (Gemma 3, Qwen3.5: a checkpoint of them
    is the VLM; verified as a text model, the tiny builder would shrink the text part only)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM

    def has_vision(model_type: str) -> bool:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return getattr(CONFIG_MAPPING[model_type](), "vision_config", None) is not None
        except Exception:  # noqa: BLE001 - a config without defaults: verified as a text model, as before
            return False

    return tuple(t for t in VLM if t not in CAUSAL_LM or has_vision(t))


def _auto_class(model_type: str, config=None):
    """The auto class of a checkpoint's config (a sequence classifier when its architectures name one: a reward
    model), else of the model_type: a vision-language model or a causal LM."""
    import transformers

    if config is not None and _is_sequence_classifier(config):
        return transformers.AutoModelForSequenceClassification
    vlm = model_type in VLM_TYPES()
    return transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM


def load_model(model: str, dtype=torch.float32):
    """A checkpoint directory, or a model_type (a tiny random model of it)."""
    if _is_checkpoint(model):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        cls = _auto_class(config.model_type, config)
        return cls.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").train()
    if model in VLM_TYPES():
        from ..testing.tiny_vlm import tiny_vlm

        return tiny_vlm(model).to(dtype)
    from ..testing.tiny import tiny_model

    return tiny_model(model).to(dtype)


def _is_vlm(model) -> bool:
    return model.config.model_type in VLM_TYPES() and not _is_sequence_classifier(model.config)


def _is_sequence_classifier(config) -> bool:
    """Whether a checkpoint's config names a sequence-classification class (a reward model, a classifier)."""
    return any(name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or ())


def sequence_labels(config) -> torch.Tensor:
    """(1, ...) labels of a sequence classifier's check, of its problem type (as transformers reads it: regression
    for one label, single-label classes otherwise, unless config.problem_type says)."""
    g = torch.Generator().manual_seed(0)
    n, problem = config.num_labels, config.problem_type
    if problem == "regression" or (problem is None and n == 1):
        return torch.randn(1, n, generator=g) if n > 1 else torch.randn(1, generator=g)
    if problem == "multi_label_classification":
        return torch.randint(0, 2, (1, n), generator=g).float()
    return torch.randint(0, n, (1,), generator=g)


def make_batch(model, seq_len: int, data: str | None) -> dict:
    """The inputs of the check: (1, seq_len) token ids (token_ids) as input_ids and labels (a sequence classifier's
    checkpoint: labels of its problem type, sequence_labels); for a vision-language
    model, two rows with an image each, built by hand (hfcp.testing.tiny_vlm.image_batch; a checkpoint's ids then come from
    the tiny vocabulary of placeholders, so a text-only check of its text with --data stays the causal-LM one)."""
    if _is_vlm(model) and data is None:
        from ..testing.tiny_vlm import image_batch

        return image_batch(model, seq_len)
    ids = token_ids(model, seq_len, data)
    if _is_sequence_classifier(model.config):  # a reward model / classifier: its score at the last token
        return {"input_ids": ids, "labels": sequence_labels(model.config)}
    return {"input_ids": ids, "labels": ids}


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


def _reference(model_name, batch, dtype):
    model = load_model(model_name, dtype).eval()  # eval: no dropout noise; gradients all the same
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    out = model(**batch, use_cache=False)
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
    batch = make_batch(model, seq_len, data)
    ref_loss, ref_logits, ref_grads = _reference(model_name, batch, torch.float32)
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
        loss64, logits64, grads64 = _reference(model_name, {k: v.cpu() for k, v in batch.items()}, torch.float64)
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
        _error_path(tmp, rank).write_text(_one_line(e))
        sys.exit(1)


def verify(model: str, seq_len: int, cp_size: int, strategy: str = "ring", data: str | None = None) -> Report:
    """Check the arguments here (`check_arguments`), start `cp_size` processes and return rank 0's report.

    Raises:
        VerifyError: bad arguments (exit_status 2); no tiny model of the type, or an exception in a worker, whose
            message is then that exception's "Type: message" (exit_status 1).
    """
    import tempfile

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    check_arguments(model, seq_len, data)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(_worker, args=(cp_size, port, (model, seq_len, strategy, data), tmp), nprocs=cp_size,
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
            raise VerifyError(_one_line(e)) from None  # killed (a signal) or exited without an exception
        return Report(**json.loads(Path(tmp, "report.json").read_text()))
