"""HfcpSFTTrainer: TRL's SFTTrainer with context parallelism (trl is the optional extra `hfcp[trl]`).

SFTTrainer computes its loss, token accuracy and entropy with a fused LM head that calls the backbone directly,
around hfcp's hook. Here the loss goes through hfcp's chunked loss instead, and the metrics come from sums that
the chunked loss takes per chunk (valid targets, top-1 hits, entropy), summed over the CP group and then over
the DP groups: exact, and training still never materialises (tokens x vocab) logits.
"""
from __future__ import annotations

try:
    from trl import SFTTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("hfcp.integrations.HfcpSFTTrainer needs TRL: pip install 'hfcp[trl]' (or pip install trl)") from e

import torch

from ..state import cp_state
from .trainer import HfcpTrainerMixin


class HfcpSFTTrainer(HfcpTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` for a context-parallel model: every argument of SFTTrainer, plus hfcp.patch's options.

    Logged per step as by SFTTrainer: loss, mean_token_accuracy, entropy, num_tokens (each DP group counted once).
    Raises:
        ValueError: what HfcpTrainer refuses, and loss_type other than "nll" or an MoE auxiliary loss.
    """

    def _hfcp_refuse_unsupported(self) -> None:
        problems = []
        if self.args.loss_type != "nll":
            problems.append(f"loss_type={self.args.loss_type!r} (hfcp's loss is the token-mean NLL)")
        if self.aux_loss_enabled:
            problems.append("the MoE router auxiliary loss (TRL adds it itself, divided by the gradient accumulation "
                            "steps; HfcpSFTTrainer does not reproduce that weighting: hfcp.integrations.HfcpTrainer "
                            "adds it as the model's forward does)")
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run exactly with: {'; '.join(problems)}")
        super()._hfcp_refuse_unsupported()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if cp_state(self.model) is None:  # one process or cp_size 1: SFTTrainer as it is
            return super(HfcpTrainerMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        inputs = {**inputs, "use_cache": False, "hfcp_token_stats": True}  # the forward sums what the metrics need
        if num_items_in_batch is None and mode == "eval":
            # SFTTrainer evaluates without a count, as sum / max(targets, 1): a batch without targets counts as 0,
            # not NaN (which the Trainer would drop). The count is over all DP groups when tokens are averaged
            # across devices (the eval loss is then their token mean), else over this CP group's batch
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
            if num_items_in_batch is not None:
                num_items_in_batch = torch.as_tensor(num_items_in_batch).clamp(min=1)
        loss, outputs = HfcpTrainerMixin.compute_loss(self, model, inputs, True, num_items_in_batch)
        self._log_token_metrics(mode, inputs)
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(self, mode: str, inputs) -> None:
        """SFTTrainer's entropy, mean_token_accuracy and num_tokens, from hfcp's per-chunk sums."""
        cp = self._hfcp_batch_sharers
        stats = cp_state(self.model).fwd.token_stats  # (3,) summed over this CP group
        if stats is None:
            raise RuntimeError("hfcp computed no token statistics: was the batch given labels?")
        tokens, hits, entropy = (self.accelerator.reduce(stats.to(self.args.device), "sum") / cp).tolist()
        self._metrics[mode]["entropy"].append(entropy / tokens if tokens > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(hits / tokens if tokens > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
            self._total_train_tokens += int(self.accelerator.reduce(local.to(self.args.device), "sum").item()) // cp
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
