"""hfcp's dry run: the real patched training step of one rank, at real sizes, without their memory or their compute.

The model's parameters and every activation live on the meta device (shapes and dtypes, no storage); what the
step computes on the host from the batch (input ids, labels, positions: the layout, the masks, the loss's chunks)
stays real, so every layout computation, index and branch is the one a real run takes. The process group is a fake
one of the full world size (torch's FakeProcessGroup, registered for the meta device): every collective is called
with the shapes a real run sends, and returns without moving data. One process plays one rank.

What the step allocates is counted as it happens (`Ledger`): the live bytes of every storage on the device
(meta), the peak, what is alive at the peak by where it was made, and what went to host memory (the offloaded
checkpoints). Parameters made before the step are not counted: `step_bytes` is what the step adds.

The rules of the dispatch mode (`_DryMode`):
- an operation that mixes meta tensors with real ones takes the real ones to meta (the device's side of a step);
- a copy of an integer or boolean tensor to the device stays on the host (ids, labels, positions: what hfcp reads
  to lay out the step); a floating tensor copied to the host stays meta and is counted as host memory;
- reading a value of a meta tensor on the host (`.item()`, `bool(t)`) cannot be done: DryRunError names the code
  that reads it;
- an operator that makes fresh tensors runs once for each kind of input (shapes, strides, dtypes, other arguments);
  its outputs are then remade from that record (`_MADE`: the meta kernels are mostly Python, and slow).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..memory.tiled_mlp import MLP_NAMES

BACKEND = "hfcp_dry"
META = torch.device("meta")
_aten = torch.ops.aten


# what an operator allocates inside itself and frees before it returns, which its meta kernel (outputs only) does not
# show: ATen's logsumexp subtracts the maximum into an input-sized temporary (logsumexp_out_impl, CPU and CUDA)
_BOTH = {
    _aten.logsumexp.default: lambda x, *_, **__: x.numel() * x.element_size(),
}


def _flash_backward(dout, q, k, *_, **__) -> int:
    """FlashAttention-2's backward (CUDA; aten's copy of it and the flash-attn package alike): an fp32 accumulator
    of dQ, and with fewer K/V heads than query heads, dK and dV at the query's head count before they are summed
    into the K/V heads (flash_api.cpp, mha_bwd). The dry run's meta stand-in for it: the CPU flash kernel's op."""
    expanded = 2 * q.numel() * q.element_size() if k.shape[1] != q.shape[1] else 0
    return q.numel() * 4 + expanded


# CUDA's kernels (a GPU plan)
WORKSPACES = {
    **_BOTH,
    _aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_backward,
}
# the CPU's kernels: torch._grouped_mm (transformers' mixtures of experts) copies a weight given transposed into a
# contiguous one (measured: the growth of one call is its output plus the weight)
CPU_WORKSPACES = {
    **_BOTH,
    _aten._grouped_mm.default: lambda a, b, *_, **__: 0 if b.is_contiguous() else b.numel() * b.element_size(),
}
# collectives that other libraries register as operators of their own (their bodies call c10d below the dry run's
# dispatch mode): operator name -> the c10d collective it is
OPERATOR_COLLECTIVES = {"deepspeed::dim_zero_all_to_all": "alltoall_base_"}  # (DeepSpeed's Ulysses: input, group)


def _grouped_mm_any_dtype(func, a, b, *args, **kwargs):
    """torch._grouped_mm's meta kernel takes bf16 only (CUDA's rule); the CPU kernel takes fp32 too (transformers'
    mixtures of experts call it on CPU): the output's shape from a bf16 call, in the inputs' dtype."""
    if a.dtype == torch.bfloat16:
        return None
    shape = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args, **kwargs).shape
    return torch.empty(shape, dtype=a.dtype, device=META)


META_FIXES = {_aten._grouped_mm.default: _grouped_mm_any_dtype}


class DryRunError(RuntimeError):
    """The step cannot run without the values of device tensors (a host-side read of activations)."""


def _fake_group(common_opts, backend_opts):
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


@contextlib.contextmanager
def dry_world(world_size: int, rank: int = 0):
    """A default process group of `world_size` fake ranks in this process, playing `rank`; collectives on the CPU
    and the meta device return without moving data."""
    if dist.is_initialized():
        raise RuntimeError("hfcp's dry run makes its own process group of the full world size: run it in a process "
                           f"without one (this one has a group of {dist.get_world_size()} ranks)")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _fake_group, extended_api=True, devices=["cpu", "meta"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass
class Region:
    """The highest the activations (live bytes but the parameters' gradients) reached while a part of the step ran,
    with the gradients alive then and what was alive then, by the part of the step that made it."""
    act: int = 0
    grads: int = 0
    alive: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Ledger:
    """What a dry step allocates on the device: live and peak bytes, the parameters' gradients among them (a plan
    shards those), the peak of the rest in each part of the step (`regions`: "forward mlp", "backward attention",
    ...; each is affine in the length, and which one is highest changes with it); and what went to host memory."""
    live: int = 0
    peak: int = 0
    grads: int = 0
    host: int = 0
    host_peak: int = 0
    sent: float = 0.0  # bytes this rank sends (collectives counted as NCCL's ring algorithms move them)
    collectives: dict = dataclasses.field(default_factory=dict)  # c10d operator -> calls
    phase: str = "forward"
    where: str = "outside the model"
    regions: dict = dataclasses.field(default_factory=dict)
    alive: dict = dataclasses.field(default_factory=dict)  # live bytes by the part of the step that made them
    # the model computes its loss itself from whole logits (not hfcp's chunked loss, whose frames name it): what runs
    # after the head in forward, and in backward until the first parameter's gradient, is the loss's
    model_loss: bool = False
    _grads_started: bool = False
    _seen: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)

    @property
    def act_peak(self) -> int:
        return max((r.act for r in self.regions.values()), default=0)

    def note(self, tensor: torch.Tensor, host: bool = False) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        entry = self._seen[storage] = [f"{self.phase} {self._part()}", storage.nbytes(), host]
        weakref.finalize(storage, self._free, entry)
        if host:
            self.host += entry[1]
            self.host_peak = max(self.host_peak, self.host)
            return
        self.live += entry[1]
        self.alive[entry[0]] = self.alive.get(entry[0], 0) + entry[1]
        self._peaks(0)

    def _part(self) -> str:
        """The part of the step at hand: the module whose forward runs (set by dry_step's hooks); in backward, which
        runs no module hooks, the hfcp autograd function whose backward runs (attention's, the tiled MLP's, the
        loss's), else "between blocks" (the gradients of the layers' own operators)."""
        if not self.phase.startswith("backward"):
            return self.where
        frame = sys._getframe(3)
        while frame is not None:
            name = frame.f_code.co_filename
            if "/hfcp/" in name and "/planning/" not in name:
                for part, kind in BACKWARD_PARTS:
                    if part in name:
                        return kind
            frame = frame.f_back
        if self.model_loss and not self._grads_started:
            return "loss"
        return self.where if self.where in ("attention", "mlp", "loss") and _in_recompute() else "between blocks"

    def tag_gradient(self, tensor: torch.Tensor) -> None:
        """`tensor` is a parameter's gradient."""
        self._grads_started = True
        entry = self._seen.get(tensor.untyped_storage())
        if entry is not None and not entry[2] and entry[0] != "gradients" and entry[1]:
            self.alive[entry[0]] -= entry[1]
            entry[0] = "gradients"
            self.alive["gradients"] = self.alive.get("gradients", 0) + entry[1]
            self.grads += entry[1]

    def transient(self, nbytes: int) -> None:
        """An operator's workspace, alive only inside it (WORKSPACES)."""
        self._peaks(nbytes)

    def _peaks(self, extra: int) -> None:
        self.peak = max(self.peak, self.live + extra)
        key = f"{self.phase} {self.where}"
        region = self.regions.get(key)
        if region is None:
            region = self.regions[key] = Region()
        act = self.live + extra - self.grads
        if act > region.act:
            region.act, region.grads, region.alive = act, self.grads, dict(self.alive)
            if extra:
                region.alive[f"{key} workspace"] = extra

    def collective(self, func, args) -> None:
        name = func.__name__.split(".")[0]
        self.collectives[name] = self.collectives.get(name, 0) + 1
        group = next((_group_size(a) for a in args if isinstance(a, torch.ScriptObject)), 1)
        share = (group - 1) / group if group > 1 else 0.0
        if name == "send":
            self.sent += sum(_nbytes(t) for t in args[0])
        elif name == "alltoall_base_":
            self.sent += _nbytes(args[1]) * share
        elif name in ("allgather_", "allgather_into_tensor_coalesced", "_allgather_base_"):
            self.sent += _nbytes(args[1]) * (group - 1)
        elif name in ("allreduce_",):
            self.sent += 2 * share * sum(_nbytes(t) for t in args[0])
        elif name in ("reduce_scatter_tensor_coalesced", "_reduce_scatter_base_"):
            self.sent += _nbytes(args[1]) * share

    def operator_collective(self, name: str, args) -> None:
        """A collective another library runs as an operator of its own (OPERATOR_COLLECTIVES): (input, group name)."""
        self.collectives[name] = self.collectives.get(name, 0) + 1
        group = dist.distributed_c10d._resolve_process_group(args[1]).size()
        self.sent += _nbytes(args[0]) * (group - 1) / group

    def _free(self, entry: list) -> None:
        if entry[2]:
            self.host -= entry[1]
            return
        self.live -= entry[1]
        self.alive[entry[0]] -= entry[1]
        if entry[0] == "gradients":
            self.grads -= entry[1]


def _group_size(script_object) -> int:
    from torch._C._distributed_c10d import ProcessGroup

    return ProcessGroup.unbox(script_object).size()


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


BACKWARD_PARTS = (("/attention/", "attention"), ("/mixers/", "attention"), ("/memory/", "mlp"), ("/loss/", "loss"))


def _in_recompute() -> bool:
    """Whether a checkpointed layer's forward is being recomputed (its modules' hooks name the part then)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "recompute_fn":
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """The innermost frame of hfcp or transformers: where a host-side read of a device value happens."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/hfcp/" in name or "/transformers/" in name or "/peft/" in name:
            return f"{name.split('/site-packages/')[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "outside hfcp and transformers"


def _tensors(args, kwargs):
    for group in (args, kwargs.values()):
        for x in group:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (list, tuple)):
                yield from (y for y in x if isinstance(y, torch.Tensor))


# The outputs of an operator on meta tensors (their shapes, strides, dtypes) follow from the inputs' alone, and many
# meta kernels are Python (torch's refs: about 130 us an elementwise op, 1.6 ms a logaddexp, 80% of a dry run); so
# each operator that makes fresh tensors is run once for each kind of input it is given, and its outputs are then
# made from the record. What the record holds, by (operator, the default dtype, every argument: a tensor's shape,
# strides and dtype, anything else its type and value): the outputs' specs, or None where the operator mutates an
# argument or returns a tensor on an input's storage (a view: the ledger counts a storage once), which always run.
_MADE: dict = {}
_UNSEEN = object()


def _spec_key(x):
    if isinstance(x, torch.Tensor):
        return type(x), x.shape, x.stride(), x.dtype
    if isinstance(x, (list, tuple)):
        return tuple(_spec_key(y) for y in x)
    return type(x), x


def _record(func, args, kwargs, out):
    """The outputs' specs (a tensor's shape, strides, dtype; anything else itself), or None where they cannot be
    remade: an operator that writes an argument, returns an input's storage or one storage twice, or outputs other
    than a tensor or a tuple."""
    if func._schema.is_mutable:
        return None
    outs = out if isinstance(out, tuple) else (out,)
    if not isinstance(out, (torch.Tensor, tuple)) or any(isinstance(o, (list, dict)) for o in outs):
        return None
    inputs = set()
    for t in _tensors(args, kwargs):
        if type(t) not in (torch.Tensor, torch.nn.Parameter):  # (a subclass's dispatch may add its own rules)
            return None
        inputs.add(t.untyped_storage()._cdata)
    specs = []
    for o in outs:
        if isinstance(o, torch.Tensor):
            if type(o) is not torch.Tensor or not o.is_meta or o.storage_offset() \
                    or o.untyped_storage()._cdata in inputs:
                return None
            inputs.add(o.untyped_storage()._cdata)  # (a second output on the same storage is not fresh either)
            specs.append((o.shape, o.stride(), o.dtype))
        else:
            specs.append((None, o, None))
    return isinstance(out, tuple), specs


def _remade(record):
    is_tuple, specs = record
    outs = tuple(value if shape is None else torch.empty_strided(shape, value, dtype=dtype, device=META)
                 for shape, value, dtype in specs)
    return outs if is_tuple else outs[0]


def _to_meta(x):
    return x.to(META) if isinstance(x, torch.Tensor) and not x.is_meta else x


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


class _DryMode(TorchDispatchMode):
    def __init__(self, ledger: Ledger, kernels: str):
        super().__init__()
        self.ledger, self.workspaces = ledger, CPU_WORKSPACES if kernels == "cpu" else WORKSPACES

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and args[0].is_meta:
            raise DryRunError(f"hfcp's dry run: {_caller()} reads a value of a device tensor on the host, which a dry "
                              "run does not have (its tensors have shapes, not values)")
        to_host = False
        if func is _aten._to_copy.default:
            target = kwargs.get("device")
            if target is not None and target.type == "meta" and not args[0].is_meta \
                    and not args[0].is_floating_point():
                kwargs = dict(kwargs, device=args[0].device)  # (host data stays readable)
            elif target is not None and target.type != "meta" and args[0].is_meta:
                kwargs, to_host = dict(kwargs, device=META), True  # (offloaded: counted as host memory)
        if func.namespace == "c10d":
            self.ledger.collective(func, args)
        elif func.name().split(".")[0] in OPERATOR_COLLECTIVES:
            self.ledger.operator_collective(OPERATOR_COLLECTIVES[func.name().split(".")[0]], args)
        fix = META_FIXES.get(func)
        if fix is not None and _is_meta(args[0]):
            out = fix(func, *args, **kwargs)
            if out is not None:
                self.ledger.note(out)
                return out
        meta = real = False
        for x in _tensors(args, kwargs):
            if x.is_meta:
                meta = True
            else:
                real = True
        if meta and real:
            args, kwargs = tree_map(_to_meta, args), tree_map(_to_meta, kwargs)
        out = self._made(func, args, kwargs) if meta and func.namespace == "aten" else \
            func(*args, **kwargs)
        for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
            if _is_meta(t):
                self.ledger.note(t, host=to_host)
        workspace = self.workspaces.get(func)
        if workspace is not None and _is_meta(args[0]):
            self.ledger.transient(workspace(*args, **kwargs))
        return out

    @staticmethod
    def _made(func, args, kwargs):
        """func(*args, **kwargs) on meta tensors, or its outputs remade from the record of an earlier call (_MADE)."""
        try:
            key = (func, torch.get_default_dtype(), _spec_key(args), _spec_key(tuple(kwargs.items())))
            record = _MADE.get(key, _UNSEEN)
        except TypeError:  # (an argument that cannot be hashed: run each time)
            return func(*args, **kwargs)
        if record is not None and record is not _UNSEEN:
            return _remade(record)
        out = func(*args, **kwargs)
        if record is _UNSEEN:
            _MADE[key] = _record(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def dry_step(model: torch.nn.Module, kernels: str = "cuda", model_loss: bool = False):
    """Inside: the model's (meta) forward and backward run as a rank's would, counted in the yielded Ledger;
    decoder blocks name the part of the step they allocate in. kernels: "cuda" or "cpu", whose operators'
    workspaces are counted (WORKSPACES, CPU_WORKSPACES). model_loss: the model computes its loss from whole logits
    (Ledger.model_loss)."""
    ledger = Ledger(model_loss=model_loss)
    after = "loss" if model_loss else "between blocks"
    for t in [*model.parameters(), *model.buffers()]:  # (made before the step: not the step's)
        ledger._seen[t.untyped_storage()] = ["before the step", 0, False]
    handles = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("self_attn", "attention", "attn", "linear_attn", "mixer", "mamba"):
            kind = "attention"
        elif leaf in MLP_NAMES or leaf == "block_sparse_moe":
            kind = "mlp"
        elif leaf in ("lm_head", "norm", "final_layernorm") and "layers" not in name:
            kind = "loss"
        else:
            continue
        handles.append(module.register_forward_pre_hook(lambda *_, k=kind: setattr(ledger, "where", k)))
        handles.append(module.register_forward_hook(
            lambda *_, k=kind: setattr(ledger, "where", after if k == "loss" else "between blocks")))
    handles += [p.register_post_accumulate_grad_hook(lambda p: ledger.tag_gradient(p.grad))
                for p in model.parameters() if p.requires_grad]
    try:
        with _DryMode(ledger, kernels):
            yield ledger
    finally:
        for h in handles:
            h.remove()
