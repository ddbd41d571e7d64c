"""Evaluation and prediction under CP: what HfcpTrainer's evaluate / predict change against the Trainer's.

Sequence outputs are gathered whole (original order and length); the gathered arrays keep one copy per DP group,
without the samples accelerate repeats to fill the last batch (map-style and iterable datasets), and the loss
leaves those samples out, so every array and the loss equal those of one process.
"""
from __future__ import annotations

import multiprocessing

import torch
from accelerate.utils import find_batch_size, recursively_apply

from ..distributed.data import data_parallel_rank_and_size
from ..hooks.causal_lm import DEFAULT_LOSS_CHUNK
from ..outputs import gather_outputs
from ..state import cp_state


class CountedIterable(torch.utils.data.IterableDataset):
    """An iterable dataset that counts the samples it yields, in shared memory (a DataLoader worker writes it too).

    Over several DP groups, accelerate's IterableDatasetShard fills the last batch with samples from the first, and
    (unlike for map-style data) accelerate does not know how many: the count says which are the dataset's own."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.count = multiprocessing.Value("q", -1)  # -1: not iterated to its end yet

    def __iter__(self):
        self.count.value = n = -1
        for n, sample in enumerate(self.dataset):
            yield sample
        self.count.value = n + 1

    def __len__(self):
        return len(self.dataset)  # TypeError when the dataset has no length, as before

    def __getattr__(self, name):  # set_epoch, generator, ...: the dataset's, as IterableDatasetShard looks for them
        if name in ("dataset", "count") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class EvaluationMixin:
    """prediction_step / evaluation_loop of HfcpTrainerMixin (needs the Trainer's accelerator, args, model)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The parent's step with whole-sequence outputs, no target from a sample repeated to even out the last
        batch, and the loss of the whole step (all DP groups) on every rank: the gathered losses are then
        truncated to the samples of the dataset, as they are for one process."""
        if cp_state(model) is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        self._hfcp_last_rows = find_batch_size(inputs)  # (what one process counts of a stream's last batch)
        inputs = self._without_repeated_targets(inputs)

        # no logits wanted: the chunked loss, as in training, so evaluation never needs more memory than a step
        chunked = prediction_loss_only and cp_state(model).loss_chunk == "auto"
        options = {"hfcp_loss_chunk": DEFAULT_LOSS_CHUNK} if chunked else {}

        def call(**kwargs):  # the parent only calls the model: give it whole-sequence outputs
            out = model(**kwargs, **options)
            return out if prediction_loss_only else gather_outputs(out, model)

        loss, logits, labels = super().prediction_step(call, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if loss is not None and self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs:
            loss = self.accelerator.reduce(loss, "sum") / self.args.world_size  # dp * S_d / N -> sum_d S_d / N
        return loss, logits, labels

    def _counted_shard(self):
        """The active data loader's IterableDatasetShard when hfcp counts its samples (CountedIterable), else None."""
        gs = self.accelerator.gradient_state
        shard = getattr(gs.active_dataloader, "dataset", None) if gs.in_dataloader else None
        return shard if isinstance(getattr(shard, "dataset", None), CountedIterable) else None

    def _remainder(self) -> int:
        """At the end of a data loader: how many samples of its last batch (of all DP groups) are the dataset's
        own, the others repeat samples to give every DP group a full batch; 0 or -1: none is repeated."""
        shard = self._counted_shard()
        if shard is None:  # map-style data, or one DP group: accelerate knows it (-1: a stream, nothing repeated)
            return self.accelerator.gradient_state.remainder
        n = shard.dataset.count.value
        return n % (shard.batch_size * shard.num_processes) if n >= 0 else -1

    def _kept_of_last_gather(self) -> int:
        """At the end of a data loader: how many of the last gathered entries (the step's loss repeated per sample,
        the outputs' rows) one process keeps; 0 or -1: all. One process counts a map-style dataset's last batch
        in samples, and an IterableDataset's (through accelerate's dispatcher, with a length or not) in the rows
        of the collated batch: a collator that makes several rows a sample (a preference pair) counts them all."""
        shard = self._counted_shard()
        rows = getattr(self, "_hfcp_last_rows", None)
        if shard is not None:  # an IterableDataset over DP groups: its samples, in one process's rows
            remainder = self._remainder()
            return remainder * (rows // shard.batch_size) if remainder > 0 and rows else remainder
        gs = self.accelerator.gradient_state
        data = getattr(gs.active_dataloader, "dataset", None) if gs.in_dataloader else None
        one_group = data_parallel_rank_and_size(self.model)[1] == 1
        if one_group and isinstance(data, torch.utils.data.IterableDataset) and rows:  # its last batch, whole
            return rows
        return gs.remainder

    def _without_repeated_targets(self, inputs):
        """In the last batch, accelerate repeats samples so that every DP group gets a full batch; they are
        dropped from the gathered arrays, and here from the loss (labels -100), as one process never sees them."""
        targets = {k: inputs[k] for k in ("labels", "shift_labels") if inputs.get(k) is not None}
        if not self.accelerator.gradient_state.end_of_dataloader or not targets:
            return inputs
        remainder = self._remainder()
        b = next(iter(targets.values())).shape[0]
        if remainder <= 0 or (remainder % b == 0 and remainder // b >= data_parallel_rank_and_size(self.model)[1]):
            return inputs  # no DP group holds a repeated sample
        if any(t.is_floating_point() for t in targets.values()):  # decided alike on every rank
            raise ValueError(
                f"the last evaluation batch repeats samples to fill every DP group, and float labels cannot mark them "
                f"ignored; make the dataset size a multiple of {b} x the number of DP groups, or set "
                "dataloader_drop_last=True")
        dp_rank, _ = data_parallel_rank_and_size(self.model)
        repeated = torch.arange(dp_rank * b, (dp_rank + 1) * b) >= remainder
        if not bool(repeated.any()):
            return inputs
        masked = {k: t.masked_fill(repeated.to(t.device).view(-1, *[1] * (t.dim() - 1)), -100)
                  for k, t in targets.items()}
        return {**inputs, **masked}

    def evaluation_loop(self, dataloader, *args, **kwargs):
        if cp_state(self.model) is not None:
            shard = getattr(dataloader, "dataset", None)
            if isinstance(getattr(shard, "dataset", None), CountedIterable) and dataloader.num_workers > 1:
                raise ValueError(
                    f"dataloader_num_workers={dataloader.num_workers} with an IterableDataset over "
                    f"{shard.num_processes} DP groups: each worker would fill its own last batch with repeated "
                    "samples, which hfcp cannot tell from the dataset's; evaluate with dataloader_num_workers <= 1, "
                    "or on a map-style dataset")
            self.gather_function = self._gather_once_per_dp_group  # the parent resets it at the end
        return super().evaluation_loop(dataloader, *args, **kwargs)

    def _gather_once_per_dp_group(self, data):
        """accelerate's gather_for_metrics, keeping one copy per CP group (every rank of it holds the same)."""
        acc = self.accelerator
        leaders = list(cp_state(self.model).mesh.data_leaders)  # the first rank of each DP group, by dp rank
        world = self.args.world_size

        def first_of_each_group(t):  # (world * n, ...) in rank order -> (dp * n, ...)
            return t.reshape(world, -1, *t.shape[1:])[leaders].reshape(-1, *t.shape[1:])

        data = recursively_apply(first_of_each_group, acc.gather(data))
        if not acc.gradient_state.end_of_dataloader:
            return data
        # one process truncates the gathered last batch to its own samples, with a length or without one
        # (accelerate's dispatcher counts a stream's last batch), so that batch weighs its own samples in the loss
        remainder = self._kept_of_last_gather()
        if remainder > 0:  # drop the samples repeated to even batches
            data = recursively_apply(lambda t: t[:remainder], data)
        return data
