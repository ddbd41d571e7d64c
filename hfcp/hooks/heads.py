"""The sequence classifier's hook over a causal LM's sequence (which heads hfcp reproduces: hfcp/families/heads.py):
the hook (the score at the last non-pad token, found over the whole sequence, whole and identical on every rank).

A token classifier needs no hook of its own: its logits are a sequence output (local, as a causal LM's) and its loss
the token mean over the whole sequence, computed by the sequence hook from its unshifted labels (hooks/causal_lm.py).
"""
from __future__ import annotations

import torch

from ..compiler import eager
from ..distributed.collectives import pick_global_rows
from .causal_lm import ShardSequenceHook

def last_non_pad_index(module, kw: dict) -> torch.Tensor:
    """(B,) long: the global index of the token whose score a GenericForSequenceClassification returns, found over
    the whole sequence as transformers finds it: the rightmost token that is not pad_token_id (0 for a row of
    padding only), or the last token without pad_token_id (batch 1) or with inputs_embeds.

    Raises:
        ValueError: pad_token_id is None and the batch has more than one row (transformers' own refusal).
    """
    ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
    x = ids if ids is not None else embeds
    B, L = x.shape[:2]
    pad = module.config.get_text_config().pad_token_id
    if pad is None and B != 1:
        raise ValueError(f"{type(module).__name__}: cannot handle batch sizes > 1 if no padding token is defined "
                         f"(batch {B}, config.pad_token_id=None); set config.pad_token_id")
    if pad is None or ids is None:
        return torch.full((B,), L - 1, dtype=torch.long, device=x.device)
    positions = torch.arange(L, device=ids.device, dtype=torch.int32)
    return (positions * (ids != pad).to(torch.int32)).argmax(-1).long()


class SequenceClassificationHook(ShardSequenceHook):
    """The sequence hook of a sequence classifier (GenericForSequenceClassification's forward, or a registered one
    that pools the same way; classification_head_name): before sharding, the global index of each
    row's pooled token (last_non_pad_index); for the forward, its score head returns that token's scores (B, C)
    summed over the CP group (differentiably: they are computed on the rank that holds the token) and broadcast to
    every local position, so whatever local index the model's own code picks, it gets them, and its own loss
    (regression, single-label, multi-label) runs on the whole pooled logits, the same on every rank."""

    def __init__(self, state, head_name: str):
        super().__init__(state)
        self.head_name = head_name

    def _place(self, kw: dict, layout, outer_masks, pairs, cache) -> None:
        module = self._module
        rows = last_non_pad_index(module, kw)  # (B,) global indices, from the whole batch
        super()._place(kw, layout, outer_masks, pairs, cache)
        self._pool_head(module.get_submodule(self.head_name), rows)

    @eager
    def pre_forward(self, module, *args, **kwargs):
        self._module = module
        try:
            return super().pre_forward(module, *args, **kwargs)
        finally:
            self._module = None

    def _pool_head(self, head, rows: torch.Tensor) -> None:
        st = self.state

        def pooled_scores(hidden, *args, **kwargs):
            self.restore_pending_head()  # one call only
            scores = head(hidden, *args, **kwargs)  # (B, L/cp, C)
            pooled = pick_global_rows(scores, rows.to(scores.device), st.step, st.mesh.cp_group)  # (B, C)
            return pooled[:, None].expand_as(scores)

        self._swap_head(head, pooled_scores)

    @eager
    def post_forward(self, module, output):
        if self._restore_head is not None:  # the stand-in restores the head when called: it never ran
            self.restore_pending_head()
            raise RuntimeError(f"{type(module).__name__} did not call its {self.head_name!r} module, so hfcp could not "
                               "pool its scores over the whole sequence")
        output = super().post_forward(module, output)
        logits = output[1 if output[0].dim() == 0 else 0] if isinstance(output, tuple) else output["logits"]
        logits.hfcp_whole = True  # (B, C), the same on every rank: hfcp.gather_sequence returns it as it is
        if hasattr(logits, "hfcp_step"):  # (stamped as a sequence when C happens to equal the local length)
            del logits.hfcp_step
        if not isinstance(output, tuple):
            self.state.fwd.local_output_names -= {"logits"}
        return output
