"""What hfcp holds for a patched model, one object per lifetime.

- `Settings` (frozen): what the caller asked `hfcp.patch` for; compared when a patched model meets options again.
- `CPState`: what patch decided from the settings and the model (fixed until unpatch), the undo stack that
  `unpatch` pops, and the data of the current step and forward (replaced by each forward).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from transformers import PreTrainedModel

from .layout import StepBatch

if TYPE_CHECKING:  # (annotations only: state sits below the parts that define them, tests/test_layers.py)
    from .distributed.mesh import Mesh
    from .families.registry import Patcher
    from .loss.linear_ce import LogitTransform

# the strategies of hfcp.attention (its STRATEGIES maps each to its function)
STRATEGY_NAMES = ("allgather", "ring", "ulysses", "usp")


def as_timedelta(timeout) -> datetime.timedelta | None:
    """None, seconds (int/float) or a timedelta -> timedelta or None.

    Raises ValueError for anything else, including zero, negative, NaN and infinite values (a collective cannot
    wait forever: None keeps the process group's default).
    """
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) and seconds > 0
    if not ok:
        raise ValueError(f"timeout={timeout!r} must be a positive, finite number of seconds or datetime.timedelta "
                         "(None: the process group's default timeout)")
    return datetime.timedelta(seconds=float(seconds))


def check_tiled_mlp(value) -> None:
    """tiled_mlp: False (off), True (tiles of hidden_size tokens) or a positive number of tokens per tile."""
    if isinstance(value, bool) or (isinstance(value, int) and value > 0):
        return
    raise ValueError(f"tiled_mlp={value!r}: pass False, True (tiles of hidden_size tokens) or a positive int (tokens "
                     "per tile)")


BALANCE_CHOICES = ("auto", "row")


def check_balance(value) -> str:
    """value, when it is a balance setting; else ValueError naming the choices."""
    if value not in BALANCE_CHOICES:
        raise ValueError(f"balance={value!r} is not one of {list(BALANCE_CHOICES)}")
    return value


def check_offload_checkpoints(value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"offload_checkpoints={value!r} must be True or False")


def check_loss_chunk(value, name: str = "loss_chunk"):
    """value, when it is a loss chunk setting (a positive number of tokens, "auto" or None); else ValueError."""
    if value not in (None, "auto") and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive number of tokens, 'auto' or None")
    return value


@dataclass(eq=False)
class ForwardData:
    """What one forward of the patched model carries from its pre-hook to its post-hook and to the integrations that
    read it after the forward (a new one each forward: nothing of a forward outlives the next one)."""

    targets: torch.Tensor | None = None  # this rank's shifted labels, padded to the layout
    denominator: object = None  # the global count of target tokens (or the Trainer's num_items_in_batch)
    loss_sum: torch.Tensor | None = None  # the chunked loss's local sum, computed by the output head's stand-in
    token_stats: torch.Tensor | None = None  # with labels: (3,) fp64 [targets, top-1 hits, entropy sum], whole sequence
    local_output_names: frozenset = frozenset()  # output fields that hold local sequences
    attention_calls: set = field(default_factory=set)  # id() of the attention modules that ran
    router_logits_wanted: bool = False  # this forward records router logits: the aux loss is computed
    router_logits: tuple | None = None  # the local router logits, taken by RouterStatsHook
    pending_layout: object = None  # a VLM's layout between its outer model's hook and its language model's hook
    cache: object = None  # generation: the ShardedKVCache of this forward (hfcp/inference/kv_cache.py), None otherwise
    decoding: bool = False  # a decode step (new tokens whole on every rank), not the prompt's prefill


@dataclass(frozen=True)
class Settings:
    """The options of `hfcp.patch` as the caller gave them (see its docstring), checked; the timeout as a timedelta.

    Raises:
        ValueError: a bad loss_chunk, strategy, check_inputs, balance or timeout, or both process_group and device_mesh.
    """

    cp_size: int | None = None
    strategy: str = "ring"
    process_group: object = None
    timeout: datetime.timedelta | None = None
    check_inputs: bool = True
    loss_chunk: int | str | None = "auto"
    ulysses_size: int | None = None
    device_mesh: object = None
    balance: str = "auto"
    tiled_mlp: bool | int = False
    offload_checkpoints: bool = False

    def __post_init__(self):
        check_loss_chunk(self.loss_chunk)
        check_tiled_mlp(self.tiled_mlp)
        check_offload_checkpoints(self.offload_checkpoints)
        check_balance(self.balance)
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {sorted(STRATEGY_NAMES)}")
        if not isinstance(self.check_inputs, bool):
            raise ValueError(f"check_inputs={self.check_inputs!r} must be True or False")
        if self.device_mesh is not None and self.process_group is not None:
            raise ValueError("pass either process_group= or device_mesh= (the CP group), not both")
        object.__setattr__(self, "timeout", as_timedelta(self.timeout))

    def differences(self, other: "Settings | dict") -> dict[str, tuple]:
        """{option: (this value, the other value)} for each option that differs: every option of another Settings,
        or the options in a dict (checked and normalised as patch does: a timeout in seconds equals its timedelta).
        """
        given = (other if isinstance(other, dict)
                 else {f.name: getattr(other, f.name) for f in dataclasses.fields(other)})
        other = dataclasses.replace(self, **given)
        return {k: (getattr(self, k), getattr(other, k)) for k in given if getattr(self, k) != getattr(other, k)}


@dataclass(eq=False)
class CPState:
    """Everything hfcp holds for one patched model (no globals): the settings, what patch decided, the undo stack,
    and the current step's layout (`step`) and forward's data (`fwd`), both replaced each forward."""

    settings: Settings
    # what patch decided (fixed until unpatch)
    mesh: Mesh
    patcher: Patcher
    head: str  # "causal_lm", "sequence_classification", "token_classification", "classification" or "base"
    attn_owner: object  # the model whose attn_implementation patch set (a VLM: its language model only)
    original_attn: str
    loss_chunk: int | str | None = "auto"  # the setting, or None where the model's logits are needed
    # what the model does to its head's output (the chunked loss applies it; patch gives loss.linear_ce.IDENTITY
    # where it does nothing)
    logit_transform: LogitTransform | None = None
    modules: list = field(default_factory=list)  # the attention modules
    ran_modules: list | None = None  # those each forward calls, where not all (a pipeline stage's own)
    attention_group: object = None  # what the strategy communicates over: the CP group, or usp's sub-groups
    router_aux: object = None  # RouterAux, None (no aux loss in the forward) or why hfcp cannot compute it
    # hfcp.mixers.binding.LayerSteps: the step each mixer call (and its recompute) belongs to
    layer_steps: object = None
    # what unpatch undoes, last first
    undo: list[Callable[[], None]] = field(default_factory=list)
    # the current step and forward
    step: StepBatch | None = None
    fwd: ForwardData = field(default_factory=ForwardData)

    @property
    def strategy(self) -> str:
        return self.settings.strategy

    @property
    def check_inputs(self) -> bool:
        return self.settings.check_inputs

    def __deepcopy__(self, memo):
        raise RuntimeError(
            "copy.deepcopy of a hfcp-patched model is not supported (its hooks and process groups cannot be "
            "copied correctly): deepcopy before hfcp.patch, or hfcp.unpatch, copy, and patch both"
        )


def find_pretrained(model) -> PreTrainedModel:
    """The transformers model inside PEFT / DDP / accelerate wrappers."""
    m = model
    for _ in range(8):
        if isinstance(m, PreTrainedModel):
            return m
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        elif isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        else:
            break
    raise TypeError("hfcp.patch expects a transformers PreTrainedModel (optionally PEFT/DDP-wrapped), got "
                    f"{type(model).__name__}")


def cp_state(model) -> CPState | None:
    """The CP state of a patched model, or None."""
    return getattr(find_pretrained(model), "_hfcp_state", None)
