"""HfcpDPOTrainer: TRL's DPOTrainer with context parallelism (trl is the optional extra `hfcp[trl]`).

DPOTrainer reads everything from its fused LM head (`model(..., labels=labels, fused_lm_head=True)`): per-token log
p(label), entropy, mean logit, top-1 hit (and log sum p^2 for WPO weighting), for the policy, the reference (an
explicit model, or the policy with its adapter disabled) and the precomputed reference log-probs alike. Here that
head is hfcp's (fused_head.py): chunked through the output head on each rank's tokens, then each per-token field
gathered whole (batch x sequence numbers). DPOTrainer's own code then computes every loss type, ld_alpha, the
f-divergences, WPO weights and its metrics from the same numbers as in one process: nothing of its loss is retyped.
What changes besides: the reference model is patched with the policy's CP groups, the precomputed reference
log-probs keep one copy per DP group, and the token count is divided by the ranks that share a batch.
"""
from __future__ import annotations

try:
    from trl import DPOTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("hfcp.integrations.HfcpDPOTrainer needs TRL: pip install 'hfcp[trl]' (or pip install trl)") from e

import torch
from datasets import Dataset, IterableDataset, concatenate_datasets
from torch.utils.data import DataLoader

from ..api import patch
from ..outputs import gather_sequence
from ..state import cp_state
from .fused_head import install_cp_fused_head
from .trainer import UNSET, HfcpTrainerMixin


class HfcpDPOTrainer(HfcpTrainerMixin, DPOTrainer):
    """`trl.DPOTrainer` for a context-parallel model: every argument of DPOTrainer, plus hfcp.patch's options.

    Args:
        cp_size, strategy, loss_chunk, timeout, check_inputs, balance, tiled_mlp: as for HfcpTrainer (passed to
            `hfcp.patch`). The reference model (`ref_model=`) is patched with the policy's CP groups and settings.
    Logged as by DPOTrainer: loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
    logps/chosen, logps/rejected, logits/chosen, logits/rejected, entropy, mean_token_accuracy, num_tokens (each DP
    group counted once).
    Raises:
        ValueError: what HfcpTrainer refuses, and use_liger_kernel, an MoE router auxiliary loss, vision-language
            models, prompt-learning PEFT adapters (prefix / prompt tuning).
    """

    def __init__(self, *args, cp_size=UNSET, strategy=UNSET, loss_chunk=UNSET, timeout=UNSET, check_inputs=UNSET,
                 balance=UNSET, tiled_mlp=UNSET, offload_checkpoints=UNSET, **kwargs):
        # read with the layout, when the parent's __init__ creates the Accelerator
        self._hfcp_given = dict(cp_size=cp_size, strategy=strategy)
        self._hfcp_options = dict(cp_size=cp_size, strategy=strategy, loss_chunk=loss_chunk, timeout=timeout,
                                  check_inputs=check_inputs, balance=balance, tiled_mlp=tiled_mlp,
                                  offload_checkpoints=offload_checkpoints)
        super(HfcpTrainerMixin, self).__init__(*args, **kwargs)  # DPOTrainer's; the patch follows in _hfcp_setup
        self._hfcp_setup()

    def _hfcp_setup(self) -> None:
        """Patch the policy (and the reference model) and give both hfcp's fused head; once, after the parent made
        the Accelerator and the reference model (at the end of __init__, or before precomputing reference
        log-probs, which runs inside it)."""
        if getattr(self, "_hfcp_ready", False):
            return
        self._hfcp_ready = True
        self._hfcp_init(self._hfcp_options)
        state = cp_state(self.model)
        if state is None:  # one process, or cp_size 1: DPOTrainer as it is
            return
        self._tp_size = self._hfcp_batch_sharers  # DPOTrainer divides its gathered token count by it
        install_cp_fused_head(self.model)
        if self.ref_model is not None:
            self._hfcp_patch_reference(state)
            install_cp_fused_head(self.ref_model)

    def _hfcp_patch_reference(self, state) -> None:
        ref = cp_state(self.ref_model)
        if ref is not None:
            if ref.mesh.cp_groups != state.mesh.cp_groups:
                raise ValueError(f"ref_model is patched with CP groups {list(ref.mesh.cp_groups)}, the policy with "
                                 f"{list(state.mesh.cp_groups)}: pass the reference model unpatched")
            return
        s = state.settings
        patch(self.ref_model, strategy=s.strategy, process_group=state.mesh.cp_group, timeout=s.timeout,
              check_inputs=s.check_inputs, loss_chunk=s.loss_chunk, ulysses_size=s.ulysses_size, balance=s.balance)

    def _hfcp_refuse_unsupported(self) -> None:
        problems = []
        if self.args.use_liger_kernel:
            problems.append("use_liger_kernel=True (Liger's layer kernels replace modules hfcp has not verified under "
                            "CP; set it to False)")
        if self.aux_loss_enabled:
            problems.append(f"the MoE router auxiliary loss (router_aux_loss_coef={self.router_aux_loss_coef}: "
                            "HfcpDPOTrainer does not reproduce it; set router_aux_loss_coef=0.0)")
        if self._is_vlm or self._is_vision_dataset:
            problems.append("a vision-language model or dataset (hfcp's fused head reads a causal LM's hidden states; "
                            "train the language model on text)")
        peft_config = getattr(self.model, "peft_config", None)
        if isinstance(peft_config, dict) and any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
            problems.append("a prompt-learning PEFT adapter (prefix / prompt tuning prepends virtual tokens, which "
                            "hfcp does not place in the sequence layout; use LoRA)")
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run exactly with: {'; '.join(problems)}")
        super()._hfcp_refuse_unsupported()

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """The reference log-probs of every row, before training, on the patched models: gathered once per DP group
        (every rank of a CP group computes the same rows) and added as columns on every rank. DPOTrainer instead has
        the main process write them to a cache file that the other processes read, which a dataset held in memory
        keeps in a temporary folder of that process only."""
        self._hfcp_setup()
        if cp_state(self.model) is None:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        if isinstance(dataset, IterableDataset):
            raise ValueError("precompute_ref_log_probs=True needs a map-style Dataset (an IterableDataset has no rows "
                             "to add the reference log-probs to); pass one, or set precompute_ref_log_probs=False")
        loader = self.accelerator.prepare(DataLoader(
            dataset, batch_size=batch_size, collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory, shuffle=False))
        model = self.ref_model or self.model
        chosen, rejected = [], []
        for batch in loader:
            logps = self._gather_once_per_dp_group(self.compute_ref_log_probs(model, batch))
            chosen.append(logps[0].cpu())
            rejected.append(logps[1].cpu())
        columns = Dataset.from_dict({"ref_chosen_logps": torch.cat(chosen).tolist(),
                                     "ref_rejected_logps": torch.cat(rejected).tolist()})
        return concatenate_datasets([dataset, columns], axis=1)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # DPOTrainer's loss: the fused head it calls is hfcp's under CP (not HfcpTrainerMixin's causal-LM loss)
        return DPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """DPOTrainer's (the loss through the fused head); logits, when asked for (compute_metrics, predict), are the
        model's local ones made whole."""
        loss, logits, labels = DPOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
        if logits is not None and cp_state(self.model) is not None:
            logits = gather_sequence(logits, self.model)
        return loss, logits, labels
