"""A patched forward's outputs: which are local sequences (stamped with their step for gather_sequence), the last
positions of logits_to_keep, and the check that every attention module ran through hfcp."""
from __future__ import annotations

import torch

from ..distributed.collectives import all_reduce_sum


def keep_last_positions(hidden: torch.Tensor, keep: int, step, group) -> torch.Tensor:
    """The hidden states of the last `keep` positions of the global sequence, (B, keep, D) on every rank, from this
    rank's (B, L_local, D): each rank places the rows it holds, the others are zero, summed over the group (its
    backward sums the gradients, as hfcp.gather_sequence's)."""
    layout = step.layout
    keep = min(keep, layout.seq_len)
    first = layout.seq_len - keep
    index = layout.local_index(step.rank, hidden.device)
    mine = ((index >= first) & (index < layout.seq_len)).nonzero().flatten()
    rows = hidden.new_zeros(hidden.shape[0], keep, hidden.shape[-1])
    rows = rows.index_copy(1, index[mine] - first, hidden.index_select(1, mine))
    return all_reduce_sum(rows, group)


def swap_forward(module, forward):
    """Make `forward` the instance forward of `module` (an output head, for one call); returns the restore function,
    which may be called more than once. An instance forward of its own (another hook's) is kept and restored."""
    own = module.__dict__.get("forward")
    module.forward = forward
    if own is not None:
        return lambda: setattr(module, "forward", own)
    return lambda: module.__dict__.pop("forward", None)


def check_attention_ran(state, module) -> None:
    """Raises RuntimeError when a patched attention module ran this forward without calling hfcp's attention
    function (for example after model.set_attn_implementation(...) on a patched model): its output is wrong."""
    expected = state.modules if state.ran_modules is None else state.ran_modules
    missed = [m for m in expected if id(m) not in state.fwd.attention_calls]
    if missed:
        raise RuntimeError(
            f"{len(missed)} of {len(expected)} attention modules of {type(module).__name__} "
            f"({type(missed[0]).__name__}) ran this forward without hfcp's attention (attn_implementation is now "
            f"{module.config._attn_implementation!r}), so they attended within this rank's shard only and the outputs "
            "are wrong. Do not change the attention implementation of a patched model: hfcp.unpatch(model) first"
        )


# output fields that are local but not (batch, seq, ...) sequences, or not local at all (a VLM's image features)
NOT_SEQUENCE_OUTPUTS = frozenset({"router_logits", "image_hidden_states", "video_hidden_states", "image_outputs",
                                  "video_outputs"})


def stamp_sequence_outputs(output, step, skip: tuple = ()) -> frozenset:
    """Tag the local sequence tensors of an output with their step, so that gather_sequence can refuse a tensor
    of an earlier forward (its layout may differ even when its local length does not). Returns the names of the
    output fields that hold them (router logits are (tokens, experts) rows: local, but not (batch, seq, ...));
    `skip`: fields that are not local (the logits of logits_to_keep, the same on every rank)."""
    items = enumerate(output) if isinstance(output, tuple) else output.items()
    names = set()
    for name, v in items:
        if name in NOT_SEQUENCE_OUTPUTS or name in skip or (skip and name == 0):
            continue
        for t in (v if isinstance(v, tuple) else (v,)):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == step.layout.local_len:
                t.hfcp_step = step
                names.add(name)
    return frozenset(n for n in names if isinstance(n, str))


def first_field(output, name: str):
    """A model output's field `name`, read from a ModelOutput by name or from a tuple at index 0 (where
    transformers puts the first field: logits, last_hidden_state)."""
    return output[0] if isinstance(output, tuple) else output[name]


def output_values(output):
    """The fields of a ModelOutput or the items of a tuple output."""
    return output if isinstance(output, tuple) else output.values()
