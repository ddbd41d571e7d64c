"""HfcpRewardTrainer: TRL's RewardTrainer with context parallelism (trl is the optional extra `hfcp[trl]`).

The model is a sequence classifier: hfcp's sequence-classification hook gives every rank of a CP group each row's
score (at its last non-pad token) whole and identical, differentiably, so the pairwise loss built from the scores is
RewardTrainer's own on every rank, and the mean of the gradients over the CP group is the one-process gradient (DDP
then averages over the DP groups, as it does over processes without CP). What changes against RewardTrainer:
- the metrics (accuracy, margin, min / mean / max reward, num_tokens) count each DP group once, not once per rank;
- evaluation: each step's loss and metrics are taken over the pairs of all DP groups together, leaving out the
  pairs accelerate repeats to fill the last batch, so that the eval loss and metrics equal those of one process;
- the `margin` column reaches the loss, not the model (hfcp's attention refuses keywords it does not know).
"""
from __future__ import annotations

try:
    from trl import RewardTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("hfcp.integrations.HfcpRewardTrainer needs TRL: pip install 'hfcp[trl]' "
                      "(or pip install trl)") from e

import torch
import torch.nn.functional as F
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from ..distributed.data import data_parallel_rank_and_size
from ..state import cp_state, find_pretrained
from .trainer import HfcpTrainerMixin


class HfcpRewardTrainer(HfcpTrainerMixin, RewardTrainer):
    """`trl.RewardTrainer` for a context-parallel sequence classifier: every argument of RewardTrainer, plus
    hfcp.patch's options (cp_size, strategy, loss_chunk, timeout, check_inputs, balance, tiled_mlp, as for HfcpTrainer).

    The loss is RewardTrainer's: -logsigmoid(r_chosen - r_rejected [- margin]) averaged over the pairs, plus
    `center_rewards_coefficient` x the mean of (r_chosen + r_rejected)^2. Logged per step as by RewardTrainer:
    loss, accuracy, margin, min_reward, mean_reward, max_reward, num_tokens (each DP group counted once).
    Raises:
        ValueError: what HfcpTrainer refuses, and a model that is not a sequence classifier.
    """

    def _hfcp_refuse_unsupported(self) -> None:
        inner = find_pretrained(self.model)
        expected = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(inner.config.model_type)
        if expected is None or expected not in {c.__name__ for c in type(inner).__mro__}:
            raise ValueError(
                f"{type(self).__name__} needs a sequence classifier (the reward is its score at the last non-pad "
                f"token), got {type(inner).__name__} (model_type={inner.config.model_type!r}); load the model with "
                f"AutoModelForSequenceClassification (num_labels=1){f', here {expected}' if expected else ''}")
        super()._hfcp_refuse_unsupported()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if cp_state(self.model) is None:  # one process or cp_size 1: RewardTrainer as it is
            return super(HfcpTrainerMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        margin = inputs.get("margin")
        outputs = model(**{**{k: v for k, v in inputs.items() if k != "margin"}, "use_cache": False})
        chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)  # (B,) each, whole on every rank
        kept = self._pairs_of_the_dataset(chosen.shape[0]) if mode == "eval" else None
        loss = self._pairwise_loss(chosen, rejected, margin, kept)
        self._log_reward_metrics(mode, inputs, chosen.detach(), rejected.detach(), kept)
        return (loss, outputs) if return_outputs else loss

    def _pairwise_loss(self, chosen, rejected, margin, kept) -> torch.Tensor:
        """RewardTrainer's loss over this DP group's pairs (kept None: training), or over the kept pairs of every
        DP group (evaluation: the same value on every rank)."""
        diff = chosen - rejected if margin is None else chosen - rejected - margin
        terms = [-F.logsigmoid(diff)]
        center = self.args.center_rewards_coefficient
        if center is not None:
            terms.append((chosen + rejected) ** 2)
        if kept is None:
            loss = terms[0].mean()
            return loss + center * terms[1].mean() if center is not None else loss
        sums = self._sum_over_dp_groups(torch.stack([(t * kept).sum() for t in terms] + [kept.sum()]))
        loss = sums[0] / sums[-1].clamp(min=1)
        return loss + center * sums[1] / sums[-1].clamp(min=1) if center is not None else loss

    def _pairs_of_the_dataset(self, pairs: int) -> torch.Tensor:
        """(pairs,) float: 1 for this DP group's pairs that are the dataset's own, 0 for those accelerate repeats to
        give every DP group a full last batch (one process never sees them)."""
        device = self.args.device
        remainder = self._remainder() if self.accelerator.gradient_state.end_of_dataloader else 0
        if remainder <= 0:
            return torch.ones(pairs, device=device)
        dp_rank, _ = data_parallel_rank_and_size(self.model)
        return (torch.arange(dp_rank * pairs, (dp_rank + 1) * pairs, device=device) < remainder).float()

    def _sum_over_dp_groups(self, x: torch.Tensor) -> torch.Tensor:
        """Summed over the DP groups (every rank of a CP group holds the same x): the same on every rank (an integer
        tensor stays exact)."""
        total = self.accelerator.reduce(x.to(self.args.device), "sum")
        sharers = self._hfcp_batch_sharers
        return total / sharers if total.is_floating_point() else total // sharers

    def _log_reward_metrics(self, mode: str, inputs, chosen, rejected, kept) -> None:
        """RewardTrainer's metrics over the pairs of all DP groups (kept pairs only in evaluation), each group once."""
        if mode == "train":
            self._total_train_tokens += int(self._sum_over_dp_groups(inputs["attention_mask"].sum()).item())
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if kept is None:
            kept = torch.ones_like(chosen)
        hits, margins, rewards, pairs = self._sum_over_dp_groups(torch.stack([
            ((chosen > rejected).float() * kept).sum(), ((chosen - rejected) * kept).sum(),
            ((chosen + rejected) * kept).sum(), kept.sum()])).tolist()
        pairs = max(pairs, 1.0)
        self._metrics[mode]["accuracy"].append(hits / pairs)
        self._metrics[mode]["margin"].append(margins / pairs)
        self._metrics[mode]["mean_reward"].append(rewards / (2 * pairs))
        # (B, 3) per DP group -> the rows of every group once, kept pairs only
        rows = torch.stack([chosen, rejected, kept], dim=1).to(self.args.device)
        rows = self._gather_once_per_dp_group_rows(rows)
        scores = rows[rows[:, 2] > 0, :2]
        self._metrics[mode]["min_reward"].append(scores.min().item() if scores.numel() else 0.0)
        self._metrics[mode]["max_reward"].append(scores.max().item() if scores.numel() else 0.0)

    def _gather_once_per_dp_group_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (dp * n, ...): the rows of the first rank of each DP group, by dp rank."""
        leaders = list(cp_state(self.model).mesh.data_leaders)
        gathered = self.accelerator.gather(rows)  # (world * n, ...) in rank order
        return gathered.reshape(self.args.world_size, -1, *rows.shape[1:])[leaders].reshape(-1, *rows.shape[1:])
