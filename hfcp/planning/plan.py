"""hfcp.plan: the memory one rank needs for a training step of a model at a length and layout, the longest length
that fits a device, the bytes a rank sends and a roofline estimate of the step's time.

The activations come from hfcp's own step, dry-run (dry_run.py, trace.py): three traces of the model cut to two
and three periods of its layer pattern, at two lengths a rank, give a per-token cost of a layer's working set, a
per-token per-layer cost of what the layers keep (the checkpoints) and the fixed parts (the loss chunk, a tile, an
attention kernel's piece): every count is what the code allocates, so a change to the code that changes memory
changes the plan. Everything a rank holds besides (weights, gradients, optimizer states, gathered shards) is
counted from the model's parameters as transformers builds them (on the meta device); what a GPU process holds
beside its tensors is the device's stated overhead (devices.py).
"""
from __future__ import annotations

import dataclasses
import json
import math

from ..attention.tiles import KERNEL_TILE
from ..attention.volume import comm_bytes
from ..families.introspect import decoder_layers, uses_attention_interface
from ..families.registry import UnsupportedModelError
from ..hooks.causal_lm import DEFAULT_LOSS_CHUNK
from ..memory.tiled_mlp import EXPERTS_NAME, tile_tokens
from ..pipelining.runner import REDUCE_BUCKET
from ..pipelining.schedule import check_schedule
from ..pipelining.stage import layer_ranges, stage_parameters
from ..state import find_pretrained
from .alst import LOSS_SHARD_BYTES
from .configs import load_config
from .devices import GIB, Device, resolve_device
from .tensor_parallel import check_narrowed, model_tp_plan, narrowed, rank_numel
from .trace import DTYPES, Setup, build, layer_period, reduced, trace

STRATEGIES = ("ring", "allgather", "ulysses", "usp")
RING_TRACED = 4  # a ring's ranks hold the same bytes at any ring size: traced on this many ranks at most
ADAM_BYTES = 8  # two fp32 moments a trainable parameter
MASTER_BYTES = 4  # the fp32 copy of a trainable parameter trained in bf16 / fp16 (mixed precision)


@dataclasses.dataclass
class Params:
    """Parameter counts of the whole model (meta device)."""
    total: int
    trainable: int
    largest_layer: int  # the largest decoder layer or the head / embedding: what one sharded gather holds
    active: int  # parameters one token multiplies through (a mixture's chosen experts only)
    attention_layers: int
    weight_bytes: int  # bytes an element of the weights
    layers: int  # decoder layers the rank runs (under pipeline stages its stage's)
    tied: int = 0  # elements of a weight tied between the first and the last pipeline stage that the rank holds


BASE_PERIODS = 2  # the traces' layer counts: 2 and 3 periods of the pattern (the first layer reads the embedding's
# output, not a layer's: what one more layer adds is measured past it)


@dataclasses.dataclass
class Line:
    """bytes = base + per_token x n + (L / period - 2) x per_token_period x n, for n tokens a rank and L layers."""
    base: float
    per_token: float
    per_token_period: float

    def at(self, n: float, periods: float) -> float:
        return self.base + self.per_token * n + (periods - BASE_PERIODS) * self.per_token_period * n


def _line(a: float, b: float, c: float, n1: int, n2: int) -> Line:
    """The Line through a = (two periods, n1), b = (two periods, n2), c = (three periods, n1)."""
    slope = (b - a) / (n2 - n1)
    return Line(a - slope * n1, slope, (c - a) / n1)


@dataclasses.dataclass
class Fit:
    """A rank's step bytes against its tokens n and the layer count L: for each part of the step (the forward of the
    MLPs, the loss, the backward of attention, ...) the activations' peak while it runs, a Line, with what is alive
    then by component (Lines too) and the gradients alive then (bytes at two periods, and what a period adds: a
    pipeline stage's later microbatches run with every layer's gradients alive); the step's peak is the highest
    part's."""
    period: int
    regions: dict  # part -> (Line of its activations' peak, {component: Line}, (gradients, per period) alive then)
    host: Line
    whole_logits: bool = False  # the traced loss is computed from whole logits (Trace.whole_logits)

    def peak(self, n: float, layers: int, held=lambda grads: grads) -> tuple[float, dict, float]:
        """(activations, {component: bytes}, gradients) of the part of the step whose activations plus gradients
        are highest, at n tokens a rank and `layers` layers; held(gradients): what the rank holds of them."""
        periods = layers / self.period

        def at(region) -> tuple[float, float]:
            line, _, (grads, per_period) = region
            return line.at(n, periods), held(grads + max(0.0, periods - BASE_PERIODS) * per_period)

        region = max(self.regions.values(), key=lambda r: sum(at(r)))
        act, grads = at(region)
        return act, {k: v.at(n, periods) for k, v in region[1].items()}, grads


@dataclasses.dataclass
class Plan:
    model: str
    device: str
    seq_len: int
    layout: dict
    peak_bytes: int
    step_bytes: int
    breakdown: dict  # component -> bytes on the device at the peak
    host_bytes: int
    max_seq_len: int
    comm_bytes_per_step: float
    step_time_s: float  # a roofline estimate (peak FLOP/s, link bandwidths): a lower bound
    time_parts: dict
    fits: bool
    limit: str  # the largest component at twice max_seq_len, and what would move it
    stage: int | None = None  # under pipeline stages: the stage of the worst rank (the highest peak)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def __str__(self) -> str:
        lay = ", ".join(f"{k}={v}" for k, v in self.layout.items() if v not in (None, False))
        rows = [f"hfcp plan: {self.model} on {self.device}, {self.seq_len:,} tokens",
                f"  layout: {lay}"]
        if self.stage is not None:
            rows.append(f"  the worst rank: pipeline stage {self.stage} of {self.layout['pp_size']} (its first rank)")
        rows.append(f"  {'component':38s} {'GiB per rank':>12s}")
        for name, nbytes in self.breakdown.items():
            rows.append(f"  {name:38s} {nbytes / GIB:12.2f}")
        rows += [f"  {'peak (device memory per rank)':38s} {self.peak_bytes / GIB:12.2f}"
                 f"   {'fits' if self.fits else 'DOES NOT FIT'}",
                 f"  {'the step adds (step_bytes)':38s} {self.step_bytes / GIB:12.2f}",
                 f"  {'host memory per rank':38s} {self.host_bytes / GIB:12.2f}",
                 f"  longest sequence that fits: {self.max_seq_len:,} tokens",
                 f"  limit: {self.limit}",
                 f"  sent per rank per step: {self.comm_bytes_per_step / GIB:.2f} GiB",
                 f"  step time (roofline estimate, a lower bound): {self.step_time_s:.2f} s ("
                 + ", ".join(f"{k} {v:.2f} s" for k, v in self.time_parts.items()) + ")"]
        return "\n".join(rows)


def _params(config, setup: Setup) -> Params:
    """The parameters one rank holds (under TP its share of each, as the model's tp_plan shards it; under pipeline
    stages those of setup.stage, as hfcp.pipeline gives them: pipelining.stage)."""
    model = build(config, setup)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = decoder_layers(base, config.num_hidden_layers) or []
    held = _held(config, setup, model, layers)
    runs, tied = layers, 0
    if setup.pp > 1:
        own = layer_ranges(len(layers), setup.pp)[setup.stage]
        first, last = setup.stage == 0, setup.stage == setup.pp - 1
        mine = {id(p) for p in stage_parameters(model, find_pretrained(model), layers, own, first, last).values()}
        held = {k: (v if k in mine else 0) for k, v in held.items()}
        runs = [layers[i] for i in own]
        weight = base.get_input_embeddings().weight
        if weight is base.get_output_embeddings().weight and (first or last):
            tied = held[id(weight)]
    experts = 0
    for name, module in base.named_modules():
        if name.endswith(EXPERTS_NAME):
            experts += sum(held[id(p)] for p in module.parameters())
    top_k = getattr(config, "num_experts_per_tok", None)
    n_exp = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    total = sum(held[id(p)] for p in model.parameters())
    active = total - experts + (experts * top_k // n_exp if top_k and n_exp else experts)
    embed = held[id(base.get_input_embeddings().weight)]  # (a lookup: no multiply)
    largest = max([sum(held[id(p)] for p in layer.parameters()) for layer in layers] + [embed])
    # (what exchanges K/V across ranks)
    attention = sum(1 for m in (base.modules() if setup.pp == 1 else (m for layer in runs for m in layer.modules()))
                    if uses_attention_interface(m))
    return Params(int(total), int(sum(held[id(p)] for p in model.parameters() if p.requires_grad)), int(largest),
                  int(active - embed), attention, DTYPES[setup.dtype].itemsize,
                  len(runs) if setup.pp > 1 else config.num_hidden_layers, int(tied))


def _held(config, setup: Setup, model, layers: list) -> dict:
    """id(parameter) -> the elements of it a rank holds: all, or under TP its share by the model's tp_plan, once
    the narrowed config that the dry run traces is checked to hold exactly that share of every layer's parameter
    (tensor_parallel.py)."""
    if setup.tp == 1:
        return {id(p): p.numel() for p in model.parameters()}
    if not layers:
        raise ValueError(f"tp_size={setup.tp}: hfcp's plan finds no decoder layers in {type(model).__name__} to check "
                         "the narrowed config against its tp_plan; plan tp_size=1")
    tp_plan = model_tp_plan(model)
    first = next(n for n, m in model.named_modules() if m is layers[0])
    small = reduced(config, layer_period(config))
    check_narrowed(build(small, setup), build(narrowed(small, setup.tp), setup), setup.tp, first.rsplit(".", 1)[0])
    return {id(p): rank_numel(name, p.numel(), tp_plan, setup.tp) for name, p in model.named_parameters()}


def _attention_shape(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) as the config gives them."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads


def _category(where: str) -> str:
    if where == "gradients":
        return "gradients"
    if "workspace" in where and "loss" in where or where.endswith("loss"):
        return "loss chunk"
    if where.startswith("forward") and ("between blocks" in where or "outside" in where):
        return "checkpoints (on device)"
    if where.startswith("backward") and "between blocks" in where:
        return "activation gradients"
    if "attention" in where:
        return "attention working set"
    if "mlp" in where:
        return "MLP working set"
    return "other activations"


def _trace_cp(setup: Setup) -> int:
    if setup.strategy == "ring":
        return min(setup.cp, RING_TRACED)
    if setup.strategy == "usp":
        u = setup.ulysses_size or 1
        return u * min(setup.cp // u, 2)
    return setup.cp


_FITS: dict = {}  # (config, traced setup) -> Fit: what a process has fitted


def _trace_microbatches(setup: Setup) -> int:
    """The microbatches a pipeline stage's trace runs: all of them under GPipe; under 1F1B enough for the stage's
    most microbatches in flight (pp - stage) plus one forward after a backward (the gradients alive then): the
    schedule repeats after that."""
    if setup.schedule == "GPipe":
        return setup.microbatches
    return min(setup.microbatches, setup.pp - setup.stage + 1)


def fit(config, setup: Setup) -> Fit:
    """The dry run's three traces, fitted (module docstring); once a process for each config and traced setup (a
    ring's bytes a rank do not depend on the ring's size: rings of 4 and 64 share one fit)."""
    traced = dataclasses.replace(setup, cp=_trace_cp(setup))
    if setup.pp > 1:
        m = _trace_microbatches(setup)
        traced = dataclasses.replace(traced, microbatches=m, batch=m * setup.batch // setup.microbatches)
    key = (config.to_json_string(use_diff=False), traced)
    if key not in _FITS:
        _FITS[key] = _fit(config, traced)
    return _FITS[key]


def _fit(config, traced: Setup) -> Fit:
    """The dry run's three traces of `traced`, fitted (module docstring)."""
    tile = tile_tokens(traced.tiled_mlp, config) or 0
    chunk = DEFAULT_LOSS_CHUNK
    if traced.step == "alst":  # (ALST's MLP shards of hidden_size tokens, loss shards of ~1 GiB of fp32 logits)
        tile = config.hidden_size if traced.tiled_mlp else 0
        chunk = math.ceil(LOSS_SHARD_BYTES / 4 / config.get_text_config().vocab_size)
    n1 = 2 * max(KERNEL_TILE, chunk, tile)
    n2, p = 2 * n1, layer_period(config)
    k = BASE_PERIODS * p
    a, b, c = (trace(config, traced, k, n1), trace(config, traced, k, n2), trace(config, traced, k + p, n1))
    regions = {}
    for key in a.regions.keys() & b.regions.keys() & c.regions.keys() - {"reduction gradients"}:  # (evaluate's)
        ra, rb, rc = a.regions[key], b.regions[key], c.regions[key]
        names = {_category(w) for r in (ra, rb, rc) for w in r.alive} - {"gradients"}
        parts = {name: _line(*(sum(v for w, v in r.alive.items() if _category(w) == name) for r in (ra, rb, rc)),
                             n1, n2) for name in names}
        regions[key] = (_line(ra.act, rb.act, rc.act, n1, n2), parts, (ra.grads, max(0, rc.grads - ra.grads)))
    return Fit(p, regions, _line(a.host_peak, b.host_peak, c.host_peak, n1, n2), a.whole_logits)


def _static(params: Params, setup: Setup, shards: int, param_offload: bool, optimizer_offload: bool) -> dict:
    wb = params.weight_bytes
    mixed = setup.dtype != "fp32"
    trainable = params.trainable
    frozen = params.total - trainable
    weights = 0 if param_offload else (frozen + trainable) * wb / shards
    states = trainable * (ADAM_BYTES + (MASTER_BYTES if mixed else 0)) / shards
    return {"weights": weights, "optimizer states": 0 if optimizer_offload else states,
            "host: weights and optimizer states": (params.total * wb / shards if param_offload else 0)
            + (states if optimizer_offload else 0)}


def evaluate(config, setup: Setup, seq_len: int, device: Device, fitted: Fit, params: Params, sharded: bool,
             dp: tuple, param_offload: bool, optimizer_offload: bool, name: str) -> Plan:
    """The plan of `setup` at `seq_len` (dp: dp_shard, dp_replicate); under pipeline stages, of setup.stage's ranks
    (params and fitted are that stage's)."""
    layers = params.layers
    shards = dp[0] * setup.cp if sharded else 1
    n = seq_len / setup.cp
    static = _static(params, setup, shards, param_offload, optimizer_offload)
    gathered = 2 * params.largest_layer * params.weight_bytes if sharded or param_offload else 0
    grads_total = params.trainable * params.weight_bytes / shards
    grads_host = 0.0
    if param_offload or optimizer_offload:  # (the optimizer steps on the host: each gradient leaves the device once
        # reduced, FSDP2's CPUOffloadPolicy and ZeRO-3's offload alike; what stays is a layer's, before its reduction)
        grads_host = grads_total
        grads_total = min(grads_total, params.largest_layer * params.weight_bytes)
    # (hfcp.pipeline's runner averages a stage's gradients over its dp x cp ranks in fp32 buckets: one alive at once)
    reduction = 4 * min(REDUCE_BUCKET, params.trainable) if setup.pp > 1 and dp[0] * dp[1] * setup.cp > 1 else 0

    def step(tokens: float) -> tuple[float, dict]:
        act, parts, grads_peak = fitted.peak(tokens, layers, lambda grads: min(grads / shards, grads_total))
        parts = {(WHOLE_LOGITS if k == "loss chunk" and fitted.whole_logits else k): v for k, v in parts.items()
                 if v > 0}
        at_act = act + grads_peak + gathered
        at_end = grads_total + gathered + reduction
        if at_end > at_act:  # (after backward: the gradients, and what reduces them)
            parts = {"gradients": grads_total, GATHERED: gathered, REDUCTION: reduction}
        else:
            parts.update({"gradients": grads_peak, GATHERED: gathered})
        return max(at_act, at_end), {k: v for k, v in parts.items() if v}

    def peak(tokens: float) -> tuple[float, dict]:
        s, parts = step(tokens)
        fixed = static["weights"] + static["optimizer states"] + device.overhead
        return (fixed + s) * (1 + device.slack), parts

    total, parts = peak(n)
    step_bytes = step(n)[0]
    breakdown = {"weights": static["weights"], "optimizer states": static["optimizer states"], **parts,
                 "framework overhead (CUDA context, NCCL, workspaces)": device.overhead,
                 "allocator slack": total - total / (1 + device.slack)}
    breakdown = {k: int(v) for k, v in breakdown.items() if v}
    unit = 2 * setup.cp
    longest = _longest(lambda tokens: peak(tokens)[0], device.memory) * setup.cp // unit * unit
    host = static["host: weights and optimizer states"] + grads_host + fitted.host.at(n, layers / fitted.period)
    comm = _comm(config, setup, seq_len, params, dp[0] * dp[1], sharded)
    time_parts = _time(config, setup, seq_len, params, device, comm, fitted.host.at(n, layers / fitted.period),
                       dp[0] * dp[1])
    step_time = max(time_parts["compute"], time_parts["communication"]) if setup.strategy == "ring" \
        else time_parts["compute"] + time_parts["communication"]
    step_time += sum(time_parts.get(k, 0.0) for k in ("host transfers", "tensor-parallel communication",
                                                     "pipeline sends"))
    if setup.pp > 1:  # (the pipeline's bubble: pp - 1 microbatches' time that a stage waits, 1F1B and GPipe alike)
        time_parts["pipeline bubble"] = step_time * (setup.pp - 1) / setup.microbatches
        step_time += time_parts["pipeline bubble"]
    pipelined = setup.pp > 1
    layout = dict(cp_size=setup.cp, strategy=setup.strategy, ulysses_size=setup.ulysses_size, tp_size=setup.tp,
                  pp_size=setup.pp, n_microbatches=setup.microbatches if pipelined else None,
                  schedule=setup.schedule if pipelined else None, dp_shard=dp[0], dp_replicate=dp[1],
                  sharded=sharded, batch_size=setup.batch, lora_rank=setup.lora_rank,
                  gradient_checkpointing=setup.checkpointing, tiled_mlp=setup.tiled_mlp,
                  offload_checkpoints=setup.offload_checkpoints, param_offload=param_offload,
                  optimizer_offload=optimizer_offload, dtype=setup.dtype, step=setup.step)
    return Plan(name, device.name, seq_len, layout, int(total), int(step_bytes), breakdown, int(host), longest,
                comm, step_time, time_parts, total <= device.memory, _limit(peak(2 * max(longest, unit) / setup.cp)[1],
                                                                          setup), setup.stage if pipelined else None)


def _longest(peak, memory: int) -> int:
    """The most tokens a rank n with peak(n) <= memory (peak grows with n: the highest of affine parts)."""
    if peak(1) > memory:
        return 0
    hi = 2
    while peak(hi) <= memory and hi < 1 << 40:
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= memory else (lo, mid)
    return lo


WHOLE_LOGITS = "loss (the TP head's whole logits)"  # (under TP the loss is computed from them: no chunks)
GATHERED = "gathered parameter shards"
REDUCTION = "gradient reduction (fp32 bucket)"  # (hfcp.pipeline's)
ADVICE = {
    "checkpoints (on device)": "offload_checkpoints=True, or a larger cp",
    "MLP working set": "tiled_mlp=True",
    "attention working set": "a larger cp (each rank's queries and keys), or strategy='ulysses'/'usp'",
    "loss chunk": "a smaller loss_chunk",
    "gradients": "LoRA, or sharding over more ranks (dp_shard)",
    "weights": "sharding over more ranks (dp_shard), or param_offload=True",
    "optimizer states": "optimizer_offload=True, or sharding over more ranks",
    GATHERED: "more layers (smaller ones) or tensor parallelism",
    REDUCTION: "a smaller hfcp.pipelining.runner.REDUCE_BUCKET",
    "other activations": "a larger cp",
    "activation gradients": "a larger cp",
}


def _limit(parts: dict, setup: Setup) -> str:
    """The largest component at twice the longest length, and what would move it (an option not already on)."""
    name = max(parts, key=parts.get)
    advice = ADVICE.get(name, "a larger cp")
    if name == "MLP working set" and setup.tiled_mlp:
        advice = "a larger cp, or smaller tiles (tiled_mlp=<tokens>)"
    if name == "checkpoints (on device)" and setup.offload_checkpoints:
        advice = "a larger cp"
    if name == "attention working set" and setup.strategy in ("ulysses", "usp"):
        advice = "a larger cp (each rank's queries and keys)"
    if name == WHOLE_LOGITS:
        advice = "a larger cp, or tp_size=1 (hfcp's chunked loss: the tensor-parallel head gathers whole logits)"
    return f"{name} ({parts[name] / GIB:.1f} GiB at twice the longest length): {advice}"


def _comm(config, setup: Setup, seq_len: int, params: Params, dp: int, sharded: bool) -> float:
    heads, kv, head_dim = _attention_shape(config)
    e = DTYPES[setup.dtype].itemsize
    per_layer = comm_bytes(setup.strategy, setup.batch, seq_len, heads // setup.tp, kv // setup.tp, head_dim,
                           setup.cp, setup.ulysses_size, e, recompute=setup.checkpointing)
    ranks = dp * setup.cp
    # all-reduce (or reduce-scatter + the gathers below); hfcp.pipeline's runner averages a stage's in fp32
    grads = params.trainable * (4 if setup.pp > 1 else e) * 2 * (ranks - 1) / ranks
    gathers = params.total * e * (ranks - 1) / ranks * (3 if setup.checkpointing else 2) if sharded else 0.0
    tied = params.tied * e  # (a weight tied between the first and the last stage: its gradient summed over the two)
    return (per_layer * params.attention_layers + grads + gathers + tied + _tp_comm(config, setup, seq_len)
            + _pp_comm(config, setup, seq_len))


def _pp_comm(config, setup: Setup, seq_len: int) -> float:
    """Bytes a rank of a middle stage sends to its neighbour stages in a step (a first or last stage half of it):
    each microbatch's hidden states forward and their gradient backward, a rank's shard of the sequence."""
    if setup.pp == 1:
        return 0.0
    hidden = setup.batch * seq_len / setup.cp * config.get_text_config().hidden_size * DTYPES[setup.dtype].itemsize
    return hidden * (2 if setup.pp > 2 else 1)


def _tp_comm(config, setup: Setup, seq_len: int) -> float:
    """Bytes a rank sends for TP in a step: per layer and pass (forward, the recompute, backward) two all-reduces of
    the rank's hidden states (after the attention's and the MLP's row-sharded projections; in backward, before their
    column-sharded ones: Megatron's count), the embedding's all-reduce and the head's gather of the logits."""
    tp = setup.tp
    if tp == 1:
        return 0.0
    text = config.get_text_config()
    e = DTYPES[setup.dtype].itemsize
    tokens = setup.batch * seq_len / setup.cp
    hidden = tokens * text.hidden_size * e
    passes = 3 if setup.checkpointing else 2
    all_reduce = 2 * (tp - 1) / tp
    layers = 2 * passes * config.num_hidden_layers * hidden * all_reduce
    return layers + hidden * all_reduce + tokens * text.vocab_size * e * (tp - 1) / tp


def _time(config, setup: Setup, seq_len: int, params: Params, device: Device, comm: float, host: float,
          dp: int = 1) -> dict:
    tokens = setup.batch * seq_len / setup.cp
    full = setup.lora_rank is None
    # forward, backward (twice a forward's with the weights' gradients), the recompute
    passes = (3 if full else 2) + (1 if setup.checkpointing else 0)
    matmul = 2 * params.active * tokens * passes
    heads, _, head_dim = _attention_shape(config)
    heads //= setup.tp  # (a TP rank's)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    span = min(seq_len, window) if window else seq_len / 2  # keys a query sees on average (causal)
    attention = 4 * setup.batch * seq_len * span * heads * head_dim / setup.cp * (1 + 2.5 + (1 if setup.checkpointing
                                                                                             else 0))
    attention *= params.attention_layers
    out = {"compute": (matmul + attention) / device.peak_flops(setup.dtype)}
    ring = setup.cp * setup.tp <= device.per_node  # (TP groups are consecutive ranks; a CP group runs across them)
    tp_comm = _tp_comm(config, setup, seq_len)  # (TP inside a node, not overlapped with the compute)
    pp_comm = _pp_comm(config, setup, seq_len)  # (stages dp x cp ranks apart, a node's at most: not overlapped)
    out["communication"] = (comm - tp_comm - pp_comm) / (device.link if ring else device.network)
    if tp_comm:
        out["tensor-parallel communication"] = tp_comm / device.link
    if pp_comm:
        out["pipeline sends"] = pp_comm / (device.link if dp * setup.cp * setup.pp <= device.per_node
                                           else device.network)
    if host:
        out["host transfers"] = 2 * host / device.host_link
    return out


def plan(config, seq_len: int | None = None, cp_size: int = 2, strategy: str = "ring", ulysses_size: int | None = None,
         dp_shard: int = 1, dp_replicate: int = 1, tp_size: int = 1, pp_size: int = 1, batch_size: int = 1,
         lora_rank: int | None = None, lora_targets=None, gradient_checkpointing: bool = True,
         tiled_mlp: bool | int = False, offload_checkpoints: bool = False, param_offload: bool = False,
         optimizer_offload: bool = False, sharded: bool | None = None, dtype: str | None = None,
         device="h100-80gb", step: str = "hfcp", n_microbatches: int = 1, schedule: str = "1F1B") -> Plan:
    """What a training step of `config` needs per rank (see docs/how-to/plan.md).

    Args:
        config: a transformers config, a config.json path, a model directory or a shipped name (hfcp plan --list).
        seq_len: tokens a row; None: the longest that fits the device.
        cp_size, strategy, ulysses_size, tiled_mlp, offload_checkpoints: as hfcp.patch takes them.
        dp_shard, dp_replicate: data-parallel ranks beside the CP group (sharding over dp_shard x cp_size).
        pp_size, n_microbatches, schedule: hfcp.pipeline's stages (the worst stage's rank is planned).
        sharded: parameters, gradients and optimizer states sharded over dp_shard x cp_size ranks (FSDP2 /
            ZeRO-3); None: for a full fine-tune on more than one rank, not for LoRA.
        param_offload, optimizer_offload: FSDP2's / ZeRO-3's host offload of the weights / optimizer states.
        dtype: "bf16" (default on GPUs), "fp16" or "fp32" (default on "cpu").
        device: "cpu", "h100-80gb", "h200-141gb", "a100-80gb", "a100-40gb", a dict spec or a Device.
        step: "hfcp" (hfcp's step), or "alst": DeepSpeed ALST's step (its Ulysses over the cp_size ranks, tiled MLP
            and loss, checkpoints offloaded as the flags say; cp_size 1 allowed) to set beside hfcp's. Needs deepspeed.
    """
    device = resolve_device(device)
    dtype = dtype or ("fp32" if device.is_cpu else "bf16")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {list(STRATEGIES)}")
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if step not in ("hfcp", "alst"):
        raise ValueError(f"step={step!r} is not 'hfcp' or 'alst' (DeepSpeed ALST's step)")
    if step == "alst" and cp_size > 1 and (strategy != "ulysses" or ulysses_size is not None):
        raise ValueError(f"step='alst' runs ALST's Ulysses over the cp_size={cp_size} ranks: pass strategy='ulysses' "
                         f"without ulysses_size (got strategy={strategy!r}, ulysses_size={ulysses_size})")
    if cp_size < 1 or cp_size < 2 and step == "hfcp":
        raise ValueError(f"cp_size={cp_size}: hfcp.patch leaves a model with one rank a group unchanged, so there is "
                         "no hfcp step to plan; pass cp_size >= 2 (or step='alst', which plans one GPU too; "
                         "hfcp.pipeline's stages run at cp_size 1, but the dry run cannot run transformers' own mask "
                         "code, which reads the positions' values on the device)")
    if seq_len is not None and seq_len % cp_size:
        raise ValueError(f"seq_len={seq_len} must be a multiple of cp_size={cp_size}")
    if strategy == "usp" and (ulysses_size is None or cp_size % ulysses_size):
        raise ValueError(f"strategy='usp' needs ulysses_size dividing cp_size={cp_size} (got {ulysses_size})")
    for name, value in (("dp_shard", dp_shard), ("dp_replicate", dp_replicate), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    config, name = load_config(config)
    if pp_size > 1 or n_microbatches > 1:
        _check_pipeline(config, pp_size, n_microbatches, schedule, batch_size, step=step, tp_size=tp_size,
                        param_offload=param_offload, optimizer_offload=optimizer_offload, sharded=sharded)
    if tp_size > 1:
        _check_tensor_parallel(config, tp_size, step=step, lora_rank=lora_rank, tiled_mlp=tiled_mlp,
                               offload_checkpoints=offload_checkpoints, param_offload=param_offload,
                               optimizer_offload=optimizer_offload, sharded=sharded)
    setup = Setup(cp_size, strategy, ulysses_size, batch_size, lora_rank, tuple(lora_targets) if lora_targets else None,
                  gradient_checkpointing, tiled_mlp, offload_checkpoints, dtype,
                  "cpu" if device.is_cpu else "cuda", step, tp_size, pp_size, n_microbatches, schedule)
    if sharded is None:  # (under TP transformers' replicas average the gradients, under hfcp.pipeline its runner)
        sharded = lora_rank is None and dp_shard * cp_size > 1 and tp_size == 1 and pp_size == 1
    # a pipeline's worst rank is on its first stage (the most layers and microbatches in flight, the embedding) or
    # its last (the head and the loss): both are traced, the stages between hold less than the first
    stages = [dataclasses.replace(setup, stage=s) for s in sorted({0, pp_size - 1})]
    try:
        fitted = [(fit(config, s), _params(config, s)) for s in stages]
    except UnsupportedModelError as e:  # (what hfcp.pipeline refuses, raised by it in the dry run)
        if pp_size == 1:
            raise
        raise ValueError(f"pp_size={pp_size}: {e}; plan pp_size=1") from None
    dp = (dp_shard, dp_replicate)

    def worst(length: int) -> Plan:
        plans = [evaluate(config, s, length, device, f, p, sharded, dp, param_offload, optimizer_offload, name)
                 for s, (f, p) in zip(stages, fitted)]
        shortest = min(plans, key=lambda p: p.max_seq_len)
        slowest = max(plans, key=lambda p: p.step_time_s)  # (a pipeline runs at its slowest stage's pace)
        return dataclasses.replace(max(plans, key=lambda p: p.peak_bytes), max_seq_len=shortest.max_seq_len,
                                   limit=shortest.limit, step_time_s=slowest.step_time_s,
                                   time_parts=slowest.time_parts)

    first = worst(seq_len or 2 * cp_size)
    if seq_len is not None or first.max_seq_len == 0:
        return first
    return worst(first.max_seq_len)


def _check_pipeline(config, pp: int, microbatches: int, schedule: str, batch: int, **options) -> None:
    """What hfcp.pipeline runs: its stages' gradients averaged by its runner (no FSDP / ZeRO sharding, no host
    offload of an optimizer it does not make), no tensor parallelism, hfcp's step; n_microbatches dividing the rows.
    What it refuses for the model (recurrent mixers, a vision-language model, a router aux loss) it refuses itself,
    in the plan's dry run of its step.

    Raises:
        ValueError: the option hfcp.pipeline does not run, by name, or a schedule, microbatch count or stage count
            it refuses."""
    check_schedule(schedule)  # (hfcp.pipeline's own check)
    if batch % microbatches:
        raise ValueError(f"n_microbatches={microbatches} must divide batch_size={batch} (hfcp.pipeline splits a "
                         "batch's rows into its microbatches)")
    if pp == 1:
        raise ValueError(f"n_microbatches={microbatches} with pp_size=1: microbatches are a pipeline's; plan "
                         "pp_size > 1, or batch_size for rows")
    if pp > config.get_text_config().num_hidden_layers:
        raise ValueError(f"pp_size={pp} stages for {config.get_text_config().num_hidden_layers} decoder layers: "
                         "hfcp.pipeline puts at least one layer on a stage")
    if options.pop("step") != "hfcp":
        raise ValueError(f"pp_size={pp} with step='alst': ALST's step has no pipeline stages; plan pp_size=1")
    unrun = [k for k, v in options.items() if (v != 1 if k == "tp_size" else v not in (None, False))]
    if unrun:
        raise ValueError(f"pp_size={pp} with {', '.join(f'{k}={options[k]!r}' for k in unrun)}: hfcp.pipeline "
                         "averages each stage's gradients itself, without sharding, host offload or tensor "
                         "parallelism (docs/how-to/pipeline.md); plan pp_size=1, or without these")


def _check_tensor_parallel(config, tp: int, **options) -> None:
    """What hfcp runs under TP x CP (docs/how-to/scaling-out.md): a causal LM whose sequence mixers are all
    attention, loaded with transformers' tp_plan, a full fine-tune in a loop of one's own, replicas averaging their
    gradients; the plan plans that, and refuses the rest by name.

    Raises:
        ValueError: the option or model that hfcp's TP x CP does not run (verified), or a config without a tp_plan.
    """
    from ..families.registry import REGISTRY
    from ..families.resolve import tensor_parallel_unverified

    if options.pop("step") != "hfcp":
        raise ValueError(f"tp_size={tp} with step='alst': ALST's step has no tensor parallelism; plan tp_size=1")
    unverified = [k for k, v in options.items() if v not in (None, False)]
    if unverified:
        raise ValueError(f"tp_size={tp} with {', '.join(f'{k}={options[k]!r}' for k in unverified)}: hfcp's TP x CP "
                         "is verified for full fine-tunes in a loop of your own, gradients averaged over replicas "
                         "(docs/how-to/scaling-out.md); plan tp_size=1, or without these")
    patcher = REGISTRY.get(config.model_type)
    what = tensor_parallel_unverified(patcher) if patcher is not None else None
    if what is not None:
        raise ValueError(f"tp_size={tp}: {config.model_type} ({what}) is refused tensor-parallel by hfcp.patch "
                         "(unverified); plan tp_size=1")
    if not getattr(config.get_text_config(), "base_model_tp_plan", None):
        raise ValueError(f"tp_size={tp}: transformers has no tensor-parallel plan for model_type "
                         f"{config.model_type!r}; plan tp_size=1")
    narrowed(config, tp)  # (raises for heads or widths that do not divide)


def layouts(config, gpus: int, tp_sizes=(1,), pp_sizes=(1,)) -> list[dict]:
    """The CP layouts of `gpus` ranks hfcp can run for `config`: for each TP size of `tp_sizes` that divides gpus and
    both head counts, every cp dividing the rest (the rest of that data-parallel), ring; ulysses where both head
    counts a TP rank has divide by cp; usp with the largest Ulysses group that divides both. Then for each pipeline
    size of `pp_sizes` above 1 that divides gpus and leaves 2 ranks or more a stage, every cp dividing a stage's
    ranks, ring (the rest of a stage's ranks data-parallel replicas, as hfcp.pipeline lays them out)."""
    heads, kv, _ = _attention_shape(config)
    out = []
    for pp in (p for p in pp_sizes if p > 1 and gpus % p == 0 and gpus // p >= 2):
        ranks = gpus // pp
        out += [dict(cp_size=cp, strategy="ring", pp_size=pp, dp_replicate=ranks // cp)
                for cp in range(2, ranks + 1) if ranks % cp == 0]
    for tp in (t for t in tp_sizes if gpus % t == 0 and heads % t == 0 and kv % t == 0):
        ranks, h, k = gpus // tp, heads // tp, kv // tp
        tensor = {"tp_size": tp} if tp > 1 else {}
        for cp in [c for c in range(2, ranks + 1) if ranks % c == 0]:
            out.append(dict(cp_size=cp, strategy="ring", dp_shard=ranks // cp, **tensor))
            if h % cp == 0 and k % cp == 0:
                out.append(dict(cp_size=cp, strategy="ulysses", dp_shard=ranks // cp, **tensor))
            u = max(d for d in range(1, cp + 1) if cp % d == 0 and h % d == 0 and k % d == 0)
            if 1 < u < cp:
                out.append(dict(cp_size=cp, strategy="usp", ulysses_size=u, dp_shard=ranks // cp, **tensor))
    return out


OPTIONS = (dict(), dict(tiled_mlp=True), dict(tiled_mlp=True, offload_checkpoints=True))


def search(config, gpus: int, seq_len: int | None = None, top: int = 10, **kwargs) -> list[Plan]:
    """hfcp's layouts and memory options on `gpus` ranks (layouts(): cp, strategy, dp, tp, pp; tiled_mlp and
    offload_checkpoints off, tiled, both, for CP alone), each planned (plan's keyword arguments in kwargs;
    n_microbatches and schedule go to the pipeline layouts only): with a target seq_len, those that fit, fastest
    first (the roofline estimate); without, the longest max_seq_len first."""
    config, _ = load_config(config)
    piped = {k: kwargs.pop(k) for k in ("n_microbatches", "schedule") if k in kwargs}  # (a pipeline's only)
    device = resolve_device(kwargs.get("device", "h100-80gb"))
    plans = []
    for layout in layouts(config, gpus, _tp_sizes(config, device, kwargs), _pp_sizes(config, kwargs, piped)):
        if "pp_size" in layout:  # (without tiles or offload; a model hfcp.pipeline refuses is left out)
            try:
                plans.append(plan(config, seq_len=seq_len, **{**kwargs, **layout, **piped}))
            except ValueError as e:
                if "hfcp.pipeline:" not in str(e):
                    raise
            continue
        for options in OPTIONS if "tp_size" not in layout else OPTIONS[:1]:  # (TP x CP: without tiles or offload)
            plans.append(plan(config, seq_len=seq_len, **{**kwargs, **layout, **options}))
    if seq_len is not None:
        plans = sorted((p for p in plans if p.fits), key=lambda p: p.step_time_s)
    else:
        plans.sort(key=lambda p: -p.max_seq_len)
    return plans[:top]


def _tp_sizes(config, device: Device, kwargs: dict) -> tuple:
    """1, and the TP sizes within a node (2, 4, 8) where hfcp runs TP x CP for the config and the options."""
    options = {k: kwargs.get(k) for k in ("lora_rank", "param_offload", "optimizer_offload", "sharded")}
    try:
        _check_tensor_parallel(config, 2, step="hfcp", tiled_mlp=False, offload_checkpoints=False, **options)
    except ValueError:
        return (1,)
    return (1, *(t for t in (2, 4, 8) if t <= device.per_node))


def _pp_sizes(config, kwargs: dict, piped: dict) -> tuple:
    """1, and pipelines of 2 and 4 stages where hfcp.pipeline runs the options (the model itself is checked by the
    plan's dry run)."""
    options = {k: kwargs.get(k) for k in ("param_offload", "optimizer_offload", "sharded")}
    try:
        _check_pipeline(config, 2, piped.get("n_microbatches", 1), piped.get("schedule", "1F1B"),
                        kwargs.get("batch_size", 1), step="hfcp", **options)
    except ValueError:
        return (1,)
    return (1, *(p for p in (2, 4) if p <= config.get_text_config().num_hidden_layers))


def table(plans: list[Plan]) -> str:
    """One line a plan: the layout, the peak, the longest length, the estimated step time."""
    rows = [f"{'layout':62s} {'peak GiB':>9s} {'longest':>12s} {'step s':>8s}"]
    for p in plans:
        lay = p.layout
        name = f"cp {lay['cp_size']} {lay['strategy']}" + (f" (ulysses {lay['ulysses_size']})" if lay["ulysses_size"]
                                                             else "") + f", dp {lay['dp_shard'] * lay['dp_replicate']}"
        name += f", tp {lay['tp_size']}" if lay.get("tp_size", 1) > 1 else ""
        name += f", pp {lay['pp_size']} ({lay['n_microbatches']} microbatches)" if lay.get("pp_size", 1) > 1 else ""
        name += "".join(f", {k}" for k in ("tiled_mlp", "offload_checkpoints", "param_offload", "optimizer_offload")
                        if lay.get(k))
        rows.append(f"{name:62s} {p.peak_bytes / GIB:9.1f} {p.max_seq_len:12,d} {p.step_time_s:8.2f}")
    return "\n".join(rows)
