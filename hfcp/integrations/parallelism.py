"""accelerate's ParallelismConfig as HfcpTrainer's front door: hfcp does its cp dimension, accelerate the others.

A user writes the layout once, as `TrainingArguments(parallelism_config=ParallelismConfig(...))`, on
`accelerate launch --use_parallelism_config --parallelism_config_cp_size N` or in an accelerate config file (the
launcher announces those in the environment). accelerate alone would give the cp dimension to torch's experimental
CP (SDPA only, every mask replaced by causal). Here it never sees a cp dimension: the cp ranks are folded into
dp_shard, the same ranks in the same order (rank = ((r * dp_shard + s) * cp + c) * tp + t), so FSDP2 shards over
dp_shard x cp as accelerate would, and hfcp builds its CP groups over the cp dimension of that order.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from accelerate import ParallelismConfig

UNSET = object()  # an option the caller did not give (None is a value: cp_size=None, loss_chunk=None)
ENV_FLAG = "ACCELERATE_USE_PARALLELISM_CONFIG"  # set by accelerate launch for --use_parallelism_config / a config file


def requested_layout(args) -> "ParallelismConfig | None":
    """The ParallelismConfig the user gave (`args.parallelism_config` of TrainingArguments, which wins) or launched
    with (accelerate launch's environment), or None."""
    if getattr(args, "parallelism_config", None) is not None:
        return args.parallelism_config
    if os.environ.get(ENV_FLAG, "false").lower() == "true":
        from accelerate import ParallelismConfig

        return ParallelismConfig()  # its sizes from accelerate launch's PARALLELISM_CONFIG_* variables
    return None


def describe(pc) -> str:
    """The sizes of a ParallelismConfig, for messages."""
    return (f"ParallelismConfig(dp_replicate_size={pc.dp_replicate_size}, dp_shard_size={pc.dp_shard_size}, "
            f"cp_size={pc.cp_size}, tp_size={pc.tp_size}, sp_size={pc.sp_size})")


def layout_problems(pc, world: int, cp_size_given, strategy: str = "ring") -> list[str]:
    """What HfcpTrainer cannot run exactly in a layout, or would run otherwise than asked.

    Args:
        pc: the ParallelismConfig asked for.
        world: the number of processes.
        cp_size_given: the trainer's own cp_size option (`UNSET`: not given; None: the whole world).
        strategy: the hfcp strategy the trainer will run.
    Returns:
        One sentence per problem, each naming the setting and what to do; empty when the layout runs.
    """
    problems = []
    if pc.sp_size > 1:
        problems.append(f"{describe(pc)} has sp_size={pc.sp_size} (DeepSpeed's Ulysses sequence parallelism splits the "
                        "sequence too; hfcp's CP replaces it: set sp_size=1 and cp_size)")
    if pc.tp_size > 1:
        problems.append(f"{describe(pc)} has tp_size={pc.tp_size}: tensor parallelism x CP is exact in a loop of your "
                        "own (a model loaded with transformers' tp_plan, hfcp.patch(model, device_mesh=mesh['cp'])), "
                        "but accelerate runs TP only on GPUs and it has not been verified through the Trainer; use "
                        "tp_size=1 here")
    if pc.total_size != world:
        problems.append(f"{describe(pc)} covers {pc.total_size} processes, but {world} run: make dp_replicate x "
                        f"dp_shard x cp x tp equal {world}")
    if cp_size_given is not UNSET and (world if cp_size_given is None else cp_size_given) != pc.cp_size:
        given = f"None (the whole world, {world})" if cp_size_given is None else cp_size_given
        problems.append(f"cp_size={given} given to the trainer, but parallelism_config.cp_size={pc.cp_size}: "
                        "give the CP size in one place")
    comm = getattr(pc.cp_handler, "cp_comm_strategy", None) if pc.cp_size > 1 else None
    if comm == "alltoall" and strategy not in ("ulysses", "usp"):  # an all-to-all asked for, a ring or all-gather run
        problems.append(f"the ParallelismConfig's cp_comm_strategy='alltoall' (torch's CP, which hfcp replaces) asks "
                        f"for an all-to-all, but hfcp would run strategy={strategy!r}: pass strategy='ulysses' (or "
                        "'usp') to the trainer, or leave cp_comm_strategy at 'allgather'")
    return problems


def accelerate_view(pc) -> "ParallelismConfig | None":
    """The ParallelismConfig accelerate gets for a layout `pc` that layout_problems accepted (no tp, no sp): None when
    dp_shard is 1 (DDP over every process, as without a layout), else cp folded into dp_shard (FSDP2 over dp_shard x
    cp); never a cp dimension, so torch's CP is never enabled."""
    if pc.dp_shard_size == 1:
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=pc.dp_replicate_size, dp_shard_size=pc.dp_shard_size * pc.cp_size,
                             tp_size=1, cp_size=1, sp_size=1)


@contextlib.contextmanager
def handed_to_accelerate(args, view) -> Iterator[None]:
    """While the Trainer creates its Accelerator: `view` in `args.parallelism_config` (TrainingArguments), and no
    launcher flag that would make accelerate build the requested layout (torch's CP included) from the environment;
    both restored afterwards."""
    saved_pc, saved_flag = args.parallelism_config, os.environ.get(ENV_FLAG)
    args.parallelism_config = view
    os.environ.pop(ENV_FLAG, None)
    try:
        yield
    finally:
        args.parallelism_config = saved_pc
        if saved_flag is not None:
            os.environ[ENV_FLAG] = saved_flag
