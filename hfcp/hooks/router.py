"""The MoE router's statistics of a forward, taken for hfcp's aux loss over the whole sequence (hfcp/loss/router.py)."""
from __future__ import annotations

from accelerate.hooks import ModelHook

from ..compiler import eager


class RouterStatsHook(ModelHook):
    """On the base model: takes the router logits of this forward (transformers records them when
    output_router_logits is on) and hides them from the causal LM's own aux-loss code, which would take them as
    the whole sequence (with no router logits it computes 0); the LM hook adds the global aux loss instead."""

    def __init__(self, state):
        self.state = state

    @eager
    def post_forward(self, module, output):
        st = self.state
        logits = getattr(output, "router_logits", None)
        if st.fwd.router_logits_wanted and logits is not None:
            st.fwd.router_logits = tuple(logits)
            if isinstance(output, dict):  # (a ModelOutput: its entry too. Setting the attribute to None leaves the
                output["router_logits"] = None  # entry, and DeepSpeed ZeRO-3's forward hook writes every entry back
            else:  # to its attribute: the causal LM then took the rank's logits for its own aux loss)
                output.router_logits = None
        return output
