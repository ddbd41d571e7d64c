"""HfcpTrainer: the stock `transformers.Trainer` with context parallelism.

What changes against the parent, and why:
- data: every dataloader is sharded over data-parallel groups (CP groups), not processes, so every rank of a
  CP group gets the same batch (accelerate's own sharding would give each rank another one);
- loss: hfcp's global token-weighted loss with the Trainer's `num_items_in_batch`; the loss is scaled by the
  number of DP groups (not processes) before DDP averages the gradients over all processes, because the mean of
  the gradients over a CP group is already the gradient of that group's loss (docs/concepts/exactness.md);
- counters: tokens seen and FLOPs count each DP group once, the total batch size is per DP group;
- evaluate / predict: see evaluation.py (whole sequences, one copy per DP group, no repeated samples);
- logging: `cp_imbalance` beside the training loss (the steps' attention work max / mean over the CP group's ranks).
"""
from __future__ import annotations

import contextlib
import functools
import logging

from accelerate.data_loader import IterableDatasetShard, prepare_data_loader
from transformers import Trainer

from ..distributed.data import data_parallel_rank_and_size
from ..distributed.mesh import consecutive_block
from ..api import patch
from ..report import step_imbalance
from ..state import cp_state, find_pretrained
from .ddp_options import ddp_options_for_reentrant_checkpointing
from .evaluation import CountedIterable, EvaluationMixin
from .parallelism import UNSET, accelerate_view, describe, handed_to_accelerate, layout_problems, requested_layout

log = logging.getLogger("hfcp")


class HfcpTrainerMixin(EvaluationMixin):
    """The overrides shared by HfcpTrainer and HfcpSFTTrainer; put it before the Trainer class in the bases."""

    def __init__(self, *args, cp_size=UNSET, strategy=UNSET, loss_chunk=UNSET, timeout=UNSET, check_inputs=UNSET,
                 balance=UNSET, tiled_mlp=UNSET, offload_checkpoints=UNSET, **kwargs):
        """The Trainer's arguments, plus hfcp.patch's options (UNSET: not given): the model is patched once the
        parent's __init__ has made the Accelerator and the process group."""
        # read with the layout, when the parent's __init__ creates the Accelerator
        self._hfcp_given = dict(cp_size=cp_size, strategy=strategy)
        super().__init__(*args, **kwargs)
        self._hfcp_init(dict(cp_size=cp_size, strategy=strategy, loss_chunk=loss_chunk, timeout=timeout,
                             check_inputs=check_inputs, balance=balance, tiled_mlp=tiled_mlp,
                             offload_checkpoints=offload_checkpoints))

    def _hfcp_init(self, patch_options: dict) -> None:
        """After the parent's __init__ (the process group exists then): patch the model, refuse what is not exact.

        patch_options: the options the caller gave (UNSET: not given). A model patched already keeps its settings;
        an option given that differs from them is refused, as hfcp.patch does.
        """
        self._hfcp_refuse_unsupported()
        self._hfcp_imbalances = []  # hfcp.step_imbalance of each training step since the last logged loss
        given = {k: v for k, v in patch_options.items() if v is not UNSET}
        layout = self._hfcp_layout
        state = cp_state(self.model)
        if layout is not None and state is not None:  # patched beforehand: its CP groups must be the layout's
            given.pop("cp_size", None)  # (a cp_size given was checked against the layout already)
            cp, world = layout.cp_size, self.args.world_size
            blocks = tuple(tuple(consecutive_block(d, cp)) for d in range(world // cp))
            if state.mesh.cp_groups != blocks:
                raise ValueError(f"the model is patched already with CP groups {list(state.mesh.cp_groups)}, but "
                                 f"{describe(layout)} puts its cp dimension on {list(blocks)}: pass the model "
                                 f"unpatched, or patch it with cp_size={cp}")
        elif layout is not None:  # the layout's cp dimension (checked against a cp_size given)
            given["cp_size"] = layout.cp_size
        if state is None:
            patch(self.model, **given)
        else:
            differ = state.settings.differences(given)
            if differ:
                raise ValueError(f"the model is patched already with other settings ({differ}: patched, given); "
                                 "pass the model unpatched, or leave these options out")
            log.info("hfcp: the model is patched already; %s keeps its settings", type(self).__name__)
        self._install_dp_data_loader()

    def _hfcp_refuse_unsupported(self) -> None:
        args = self.args
        problems = []
        if getattr(self, "model_init", None) is not None:
            problems.append("model_init (pass the model itself)")
        if args.label_smoothing_factor:
            problems.append(f"label_smoothing_factor={args.label_smoothing_factor} (hfcp's chunked loss has no "
                            "label smoothing; set it to 0)")
        if self.compute_loss_func is not None:
            problems.append("compute_loss_func (it would see this rank's local logits only; hfcp computes the "
                            "causal-LM loss over the whole sequence)")
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if args.fsdp and plugin is None:
            problems.append("fsdp is set but accelerate did not enable FSDP (it does only on accelerators such as "
                            "GPUs; here the model would be replicated, not sharded): use DeepSpeed ZeRO-3, or torch's "
                            "fully_shard in your own loop as scripts/finetune_lora.py --full-finetune does")
        if plugin is not None and plugin.fsdp_version != 2:
            problems.append(f"FSDP version {plugin.fsdp_version} (hfcp supports FSDP2, whose dynamic model class it "
                            "recognises: set fsdp_config={'version': 2})")
        if args.neftune_noise_alpha:
            problems.append(f"neftune_noise_alpha={args.neftune_noise_alpha} (NEFTune sizes its noise by the sequence "
                            "length it sees, which is a rank's shard under CP)")
        if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
            problems.append("train_sampling_strategy='batch_rebalance' "
                            "(its sampler shards by process, not by CP group)")
        if args.accelerator_config.split_batches:
            problems.append("accelerator_config.split_batches=True (the Trainer would weight eval losses by the "
                            "unsplit batch size; "
                            "set per_device_train_batch_size to the batch of each CP group instead)")
        if args.accelerator_config.dispatch_batches:
            problems.append("accelerator_config.dispatch_batches=True (rank 0 would dispatch one batch per process; "
                            "hfcp needs one per CP group: leave it unset)")
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run exactly with: {'; '.join(problems)}")

    # ---- the layout: accelerate's ParallelismConfig ------------------------------------------------------------
    def _hfcp_take_layout(self, cp_size, strategy) -> None:
        """Before the Accelerator exists: the ParallelismConfig asked for (TrainingArguments or accelerate launch), or
        None; refused when hfcp cannot run it exactly (cp_size, strategy: the trainer's own options, UNSET when not
        given)."""
        tp = (getattr(find_pretrained(self.model), "tp_size", None) or 1) if self.model is not None else 1
        if tp > 1:  # transformers would hand accelerate a layout with its TP (before any hfcp check could run)
            raise ValueError(
                f"{type(self).__name__} cannot run a tensor-parallel model (tp_size={tp}) exactly: TP x CP is exact in "
                "a loop of your own (hfcp.patch(model, device_mesh=mesh['cp']); docs: how-to/scaling-out.md), but "
                "through the Trainer it needs accelerate's TP, which runs only on GPUs and has not been verified; load "
                "the model without tp_plan / DistributedConfig here")
        self._hfcp_layout = layout = requested_layout(self.args)
        if layout is None:
            return
        if strategy is UNSET:  # the strategy hfcp will run: a patched model's, else hfcp.patch's default
            state = cp_state(self.model) if self.model is not None else None
            strategy = state.settings.strategy if state is not None else "ring"
        problems = layout_problems(layout, self.args.world_size, cp_size, strategy)
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run this layout exactly: {'; '.join(problems)}")

    def create_accelerator_and_postprocess(self) -> None:
        if not hasattr(self, "_hfcp_layout"):  # the first call, from the parent's __init__
            given = getattr(self, "_hfcp_given", {})
            self._hfcp_take_layout(given.get("cp_size", UNSET), given.get("strategy", UNSET))
        layout = self._hfcp_layout
        view = accelerate_view(layout) if layout is not None else None
        with handed_to_accelerate(self.args, view) if layout is not None else contextlib.nullcontext():
            try:
                super().create_accelerator_and_postprocess()
            except ValueError as e:
                if view is None:
                    raise
                raise ValueError(f"{describe(layout)}: hfcp does its cp dimension and hands accelerate "
                                 f"{describe(view)} (FSDP2 over dp_shard x cp), which accelerate refused: {e}") from e
        kept = self.accelerator.parallelism_config
        if layout is not None and kept is not None and (kept.cp_enabled or kept.sp_enabled):
            raise ValueError(f"accelerate kept {describe(kept)}, not what hfcp handed it, so torch's CP would run "
                             "under hfcp's: an Accelerator was configured before the trainer (accelerator_config's "
                             "use_configured_state, or an Accelerator(parallelism_config=...) of your own); let the "
                             "trainer create it")
        if view is not None and view.dp_shard_size > 1 and not self.accelerator.is_fsdp2:
            raise ValueError(f"{describe(layout)}: dp_shard x cp = {view.dp_shard_size} ranks shard the parameters "
                             "with FSDP2, which accelerate did not enable: pass fsdp_config={'version': 2} (or launch "
                             "with --use_fsdp --fsdp_version 2)")
        if layout is not None:
            log.info("hfcp: %s: CP over its cp dimension by hfcp, %s", describe(layout),
                     f"accelerate over {describe(view)}" if view is not None else "DDP over every process")
        model = getattr(self, "model", None)
        if model is not None and cp_state(model) is not None:  # re-created by train(): keep the DP sharding
            self._install_dp_data_loader()
        ddp_options_for_reentrant_checkpointing(self)

    def _install_dp_data_loader(self) -> None:
        self.accelerator.prepare_data_loader = self._prepare_dp_data_loader

    def _prepare_dp_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """accelerate's prepare_data_loader with DP-group coordinates: ranks of one CP group get the same batches."""
        acc = self.accelerator
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        if cp_state(self.model) is None:  # no CP (one process, cp_size 1): the DP groups are the processes
            return type(acc).prepare_data_loader(acc, data_loader, device_placement, slice_fn_for_dispatch)
        dp_rank, dp_size = data_parallel_rank_and_size(self.model)
        shards = getattr(data_loader.dataset, "n_shards", None)
        if dp_size > 1 and isinstance(shards, int) and shards >= dp_size:  # decided alike on every rank
            raise ValueError(
                f"a {type(data_loader.dataset).__name__} with n_shards={shards} over {dp_size} DP groups: accelerate "
                "would give each DP group whole shards, so the groups could get different numbers of batches (one "
                "would wait for the others at its next collective) and other batches than one process; pass a "
                f"map-style dataset, or an iterable one with fewer than {dp_size} shards")
        seeding = data_loader.worker_init_fn
        if isinstance(seeding, functools.partial) and "rank" in seeding.keywords:  # the Trainer's seed_worker:
            data_loader.worker_init_fn = functools.partial(seeding, rank=dp_rank)  # same worker seeds in a CP group
        prepared = prepare_data_loader(
            data_loader, acc.device, num_processes=dp_size, process_index=dp_rank, split_batches=acc.split_batches,
            put_on_device=acc.device_placement if device_placement is None else device_placement,
            rng_types=acc.rng_types.copy(), dispatch_batches=False, even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader,
        )
        acc._dataloaders.append(prepared)  # as Accelerator.prepare_data_loader does (state saving)
        shard = getattr(prepared, "dataset", None)
        if isinstance(shard, IterableDatasetShard) and not shard.drop_last:  # it may repeat samples at the end
            shard.dataset = CountedIterable(shard.dataset)
        return prepared

    @property
    def _hfcp_cp(self) -> tuple[int, int]:
        """(cp_rank, cp_size) of this process; (0, 1) without CP."""
        state = cp_state(self.model)
        return (state.mesh.cp_rank, state.mesh.cp_size) if state is not None else (0, 1)

    @property
    def _hfcp_batch_sharers(self) -> int:
        """Processes that share one batch: a CP group (times a TP group); 1 unpatched."""
        return self.args.world_size // data_parallel_rank_and_size(self.model)[1]

    def get_cp_size(self) -> int:
        """Ranks that share one batch: the Trainer divides gathered counts and the world size by it."""
        return self._hfcp_cp[1]

    def _get_num_items_in_batch(self, batch_samples, device):
        # the one place (private in transformers 5) that counts targets for training and evaluation alike
        num_items = super()._get_num_items_in_batch(batch_samples, device)
        if num_items is not None and not self.args.average_tokens_across_devices:
            num_items = num_items * self.get_cp_size()  # a local count: the parent divided it by cp all the same
        return num_items

    # ---- loss -----------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """hfcp's loss (equal on every rank of a CP group), scaled by the number of DP groups when it is normalised
        by the count of targets over all of them (DDP then averages over all processes)."""
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        if isinstance(outputs, dict) and outputs.get("loss") is None:
            raise ValueError(f"the model returned no loss (inputs: {sorted(inputs)}); pass labels")
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                and num_items_in_batch is not None):
            loss = loss * data_parallel_rank_and_size(self.model)[1]  # the reducer averages over dp x cp ranks
        return (loss, outputs) if return_outputs else loss

    # ---- logging: the attention work imbalance of the steps, with the loss ---------------------------------------
    def train(self, *args, **kwargs):
        self._hfcp_imbalances = []  # (as the Trainer's running loss, nothing carries over from an earlier train())
        ddp_options_for_reentrant_checkpointing(self)  # (checkpointing enabled on the model after __init__)
        return super().train(*args, **kwargs)

    def training_step(self, *args, **kwargs):
        """The parent's; then the step's attention work imbalance (hfcp.step_imbalance of its last forward, counted
        from the layout it ran, without communication), kept for the next log of the loss. None without CP."""
        loss = super().training_step(*args, **kwargs)
        imbalance = step_imbalance(self.model)
        if imbalance is not None:
            self._hfcp_imbalances.append(imbalance)
        return loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        """The parent's, with `cp_imbalance` beside a training loss: the mean over the steps since the last one (as
        the loss) of max / mean attention work over the ranks of this process's CP group."""
        if "loss" in logs and getattr(self, "_hfcp_imbalances", None):
            logs["cp_imbalance"] = sum(self._hfcp_imbalances) / len(self._hfcp_imbalances)
            self._hfcp_imbalances = []
        super().log(logs, *args, **kwargs)

    # ---- counters -------------------------------------------------------------------------------------------
    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathered over all processes: each batch counted by all its sharers
        self.state.num_input_tokens_seen = before + ((self.state.num_input_tokens_seen - before)
                                                     // self._hfcp_batch_sharers)

    def floating_point_ops(self, inputs) -> int:
        return super().floating_point_ops(inputs) if self._hfcp_cp[0] == 0 else 0  # summed over processes

class HfcpTrainer(HfcpTrainerMixin, Trainer):
    """`transformers.Trainer` for a context-parallel model: every argument of Trainer, plus hfcp.patch's options.

    Args:
        cp_size, strategy, loss_chunk, timeout, check_inputs, balance, tiled_mlp: passed to `hfcp.patch` when the model
            is not patched yet; an option not given takes hfcp.patch's default (ring, "auto" chunked loss, ...). A model
            patched already keeps its settings, and an option given that differs from them is refused. With accelerate's
            ParallelismConfig (TrainingArguments.parallelism_config, or accelerate launch's), the CP size is its
            cp_size (a cp_size given here must agree; None: the whole world).
    Logged as by Trainer, and under CP (cp_size > 1) `cp_imbalance` with each training loss: the mean over the steps
    since the previous log of max / mean attention work over the ranks of this process's CP group, under the layout
    each step ran (hfcp.step_imbalance); 1.0 is even.
    Raises:
        ValueError: settings hfcp cannot make exact (label smoothing, compute_loss_func, FSDP version 1,
            split_batches, dispatch_batches, model_init, a tensor-parallel model), and ParallelismConfig layouts it
            cannot run (see hfcp.integrations.parallelism).
    """
