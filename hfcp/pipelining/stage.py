"""One pipeline stage of a causal LM: the model's own forward, run over this stage's decoder layers only.

Every rank holds the whole model's modules; the stage keeps the parameters of its layers (stage 0 its input
embeddings, the last stage its final norm and output head) and frees the others. The model's forward still runs
from the top, so everything hfcp and the model do there (the CP layout of the microbatch, its mask stand-in, RoPE
from global positions, Gemma's scaled embeddings, the loss) happens as without pipelining; the layers that are not
this stage's are replaced for the time of the pipeline:

- the layer just before the stage's first one returns the hidden states received from the previous stage (a leaf
  that requires grad: its gradient goes back to that stage);
- the layer just after the stage's last one ends the forward (`StageDone`, carrying what the stage sends on);
- any other layer passes its input through; stage > 0's input embeddings give zeros (their output is replaced).

The stage's own layers are untouched, so gradient checkpointing recomputes them as usual (the microbatch's step
travels with its mask stand-in).
"""
from __future__ import annotations

import torch


class StageDone(Exception):
    """Raised after the stage's last layer: `hidden` is what it sends to the next stage."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage done")
        self.hidden = hidden


def layer_ranges(layers: int, stages: int) -> list[range]:
    """Contiguous ranges of decoder layers, as even as can be (the earlier stages take the extra ones)."""
    k, extra = divmod(layers, stages)
    starts = [s * k + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def bind_stage(layers: list, own: range, embeddings: torch.nn.Module, receive, first: bool) -> None:
    """Replace the forwards of the layers outside `own` (and stage > 0's embeddings) as the module docstring says.
    receive(like): the hidden states from the previous stage, shaped like `like`. For good: the model serves this
    stage from now on (hfcp.unpatch does not give it its layers back)."""
    for i, layer in enumerate(layers):
        if i in own:
            continue
        if i == own.start - 1:
            forward = _receiving(receive)
        elif i == own.stop:
            forward = _stopping
        else:
            forward = _passing
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = False  # (nothing of theirs to recompute)
        layer.forward = forward
    if not first:
        embeddings.forward = _zeros_like_embeddings(embeddings)


def _passing(hidden_states, *args, **kwargs):
    return hidden_states


def _stopping(hidden_states, *args, **kwargs):
    raise StageDone(hidden_states)


def _receiving(receive):
    def forward(hidden_states, *args, **kwargs):
        return receive(hidden_states)
    return forward


def _zeros_like_embeddings(embeddings):
    width, weight = embeddings.embedding_dim, embeddings.weight

    def forward(input_ids, *args, **kwargs):  # (the previous stage's hidden states replace them)
        # (where the embedding's weight lives, as nn.Embedding's output: the ids may be on the host, a dry run's are)
        return torch.zeros(*input_ids.shape, width, dtype=weight.dtype, device=weight.device)
    return forward


def stage_parameters(model, inner, layers: list, own: range, first: bool, last: bool) -> dict[str, torch.nn.Parameter]:
    """{name as in `model`: parameter} of this stage: its layers', stage 0's input embeddings, the last stage's
    output head and every parameter outside the layers and the embeddings (the final norm)."""
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    embedding = {id(p) for p in inner.get_input_embeddings().parameters()}
    head = {id(p) for p in inner.get_output_embeddings().parameters()}
    mine = {}
    for name, p in model.named_parameters():  # (a tied weight once, by its first name, as the model names it)
        i = layer_of.get(id(p))
        if (i is not None and i in own) or (first and id(p) in embedding) or (last and id(p) in head) \
                or (last and i is None and id(p) not in embedding and id(p) not in head):
            mine[name] = p
    return mine


def free_other_parameters(model, mine: dict) -> int:
    """Release the storage of every parameter that is not this stage's (the model serves this stage only from
    now on; `hfcp_full_shape` keeps a freed parameter's shape). Returns the number of elements freed."""
    keep = {id(p) for p in mine.values()}
    freed = 0
    for p in model.parameters():
        if id(p) not in keep and p.numel():
            freed += p.numel()
            p.hfcp_full_shape = tuple(p.shape)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return freed
