"""hfcp.patch / hfcp.unpatch: the one-line surgery and its inverse.

patch reads as a script: the settings checked, the model's record and plan resolved (hfcp/families/resolve.py:
everything that can refuse, before any collective), the mesh built, then one attach per model kind
(hfcp/hooks/attach.py), each change pushing its undo on the state, which unpatch pops. gather_sequence:
hfcp/outputs/gather.py.
"""
from __future__ import annotations

import logging


from .hooks.attach import ATTACH, attach_attention
from .distributed.mesh import build_mesh
from .attention.interface import register_with_transformers
from .loss.linear_ce import IDENTITY
from .families.resolve import attention_group, patcher_for, plan_patch, router_aux_for
from .state import CPState, Settings, cp_state, find_pretrained
from .families.introspect import decoder_layers
from .memory.offload import offload_checkpoints as offload_to_host
from .memory.norm_recompute import recompute_norms
from .memory.tiled_mlp import mlps_to_tile, tile_layers, tile_mlps, tile_tokens

log = logging.getLogger("hfcp")


def patch(model, cp_size: int | None = None, strategy: str = "ring", process_group=None, timeout=None,
          check_inputs: bool = True, loss_chunk: int | str | None = "auto", ulysses_size: int | None = None,
          device_mesh=None, balance: str = "auto", tiled_mlp: bool | int = False, offload_checkpoints: bool = False):
    """Make `model` context-parallel in place and return it.

    Args:
        model: a transformers PreTrainedModel, PEFT-wrapped or not, optionally inside DDP.
        cp_size: ranks per CP group (None: the whole world, or the size of `process_group`).
        strategy: "ring", "allgather", "ulysses" or "usp" (Ulysses inside groups of `ulysses_size` consecutive
            ranks of the CP group, ring across them).
        process_group: an existing group to use as the CP group: any set of ranks. Every rank of the world then
            calls patch: the groups are compared, and their data-parallel coordinates read, in one all-gather.
        timeout: seconds or timedelta bounding every collective on the CP group.
        check_inputs: verify each step (one tiny all-gather) that every rank of a CP group got the same batch.
        loss_chunk: how a causal LM's loss is computed when labels are given. An int: this many tokens at a
            time from the last hidden states, so (tokens x vocab) logits are never materialised (out.logits is
            then None). None: the model computes its logits as usual and hfcp the loss from them. "auto"
            (default): 1024-token chunks in training forwards (train mode, grad enabled), logits otherwise.
            One forward can take another setting with the keyword `hfcp_loss_chunk=` (the same values).
        ulysses_size: usp only: ranks per Ulysses group (None: the largest divisor of cp that divides both head
            counts).
        device_mesh: a torch DeviceMesh whose group is the CP group: a 1-D mesh such as `mesh["cp"]`, or a mesh
            with a dimension named "cp". Instead of `process_group`.
        balance: "auto" (default): a training forward whose rows hold packed documents (position_ids resets)
            is split so that every rank holds as many tokens and about as much attention work as the others
            (hfcp.layout.balance); "row": every row zigzag (contiguous for bidirectional models), as one document.
        tiled_mlp: False (default); True or a number of tokens: in training forwards each decoder layer's MLP runs
            over tiles of the rank's tokens (True: hidden_size tokens a tile), each recomputed in backward, so its
            intermediates exist for one tile at a time (hfcp/memory/tiled_mlp.py). MLPs hfcp cannot show compute
            each token alone are refused. The layer's norms are then not kept for backward where the MLP or a linear
            layer reads their output: recomputed from their input (hfcp/memory/norm_recompute.py).
        offload_checkpoints: in training forwards with gradient checkpointing, what the forward keeps for backward
            outside the checkpointed layers (each layer's input) is held in host memory (pinned, copied without
            blocking on CUDA) and brought back in backward (hfcp/memory/offload.py). A training forward whose layers
            are not checkpointed is refused.

    A model that transformers loaded tensor-parallel (`tp_plan`, DistributedConfig) keeps its TP: each rank's
    attention sees its TP rank's heads, and the CP groups run across TP groups (hfcp builds them so with
    `cp_size`; a given group must share no rank with the TP group).
    Returns:
        The same model object. With one process or cp_size 1 the model is left unchanged.
    Raises:
        UnsupportedModelError: no patcher for config.model_type, or an unsupported head.
        ValueError: unknown strategy or balance, bad cp_size / timeout / check_inputs / loss_chunk, ulysses with
            indivisible heads, a process_group without this rank, groups the ranks disagree on, a device_mesh without a
            CP dimension, a CP group inside the TP group, a tensor-parallel model with recurrent layers, a VLM or a
            vision model, pipeline stages, already patched with other settings.
    """
    settings = Settings(cp_size, strategy, process_group, timeout, check_inputs, loss_chunk, ulysses_size, device_mesh,
                        balance, tiled_mlp, offload_checkpoints)
    inner = find_pretrained(model)
    patcher = patcher_for(inner)  # raises on every rank before any collective
    plan = plan_patch(inner, patcher, settings)
    tile = tile_tokens(tiled_mlp, plan.owner.config)
    mlps = mlps_to_tile(plan.owner) if tile else []  # (refuses before any collective)
    existing = cp_state(inner)
    if existing is not None:
        differ = existing.settings.differences(settings)
        if not differ:
            return model
        raise ValueError(f"model is already patched with other settings "
                         f"({', '.join(f'{k}={a!r}, now {b!r}' for k, (a, b) in differ.items())}); "
                         "call hfcp.unpatch(model) before patching with other settings")
    mesh = build_mesh(settings.cp_size, plan.process_group, settings.timeout, plan.tp_ranks)
    if mesh is None:
        unused = [f"{k}={v!r}"
                  for k, v in (("tiled_mlp", tiled_mlp), ("offload_checkpoints", offload_checkpoints)) if v]
        if unused:
            log.warning("hfcp: one process or cp_size=1: %s runs unchanged, without %s (options of a CP model; "
                        "hfcp.pipeline applies them at cp_size=1 too)", type(inner).__name__, ", ".join(unused))
        else:
            log.info("hfcp: one process or cp_size=1: %s runs unchanged", type(inner).__name__)
        return model
    state = CPState(settings, mesh, plan.patcher, plan.head, attn_owner=plan.owner,
                    original_attn=plan.owner.config._attn_implementation, loss_chunk=plan.loss_chunk,
                    logit_transform=plan.transform or IDENTITY, modules=list(plan.modules),
                    attention_group=attention_group(inner, plan, mesh, settings),
                    router_aux=router_aux_for(inner, plan))
    register_with_transformers()
    attach_attention(state, inner, plan)
    ATTACH[plan.kind](state, inner, plan)
    state.undo.extend(apply_memory_options(inner, plan.owner, tile, mlps, offload_checkpoints))
    log.info("hfcp: %s patched: strategy=%s cp=%d (dp=%d), %d attention modules",
             type(inner).__name__, strategy, mesh.cp_size, mesh.dp_size, len(plan.modules))
    return model


def apply_memory_options(inner, owner, tile: int | None, mlps: list, offload: bool) -> list:
    """tiled_mlp (its tiles on `mlps`, from mlps_to_tile, and the norms recomputed) and offload_checkpoints on a
    model whose decoder layers `owner` holds; returns their undos, in the order applied."""
    undo = []
    if tile and mlps:
        undo.append(tile_mlps(mlps, tile))
        undo.append(recompute_norms(tile_layers(owner), mlps, owner.config.get_text_config().hidden_size, tile))
    if offload:
        layers = decoder_layers(owner, owner.config.get_text_config().num_hidden_layers) or []
        undo.append(offload_to_host(inner, layers))
    return undo


def unpatch(model):
    """Undo `patch`: original attention implementation, no hfcp hook (other hooks kept). Returns model."""
    state = cp_state(model)
    while state is not None and state.undo:
        state.undo.pop()()
    return model
