"""Workers for HfcpTrainer / HfcpSFTTrainer tests: the same training run with 1, 2 (cp 2) or 4 (dp 2 x cp 2)
processes; each returns what the Trainer logged and predicted."""
from __future__ import annotations

import os
import multiprocessing
import tempfile

import torch
import torch.distributed as dist

from workers_model import tiny_model

L = 24


class Rows(torch.utils.data.Dataset):
    """n rows of L tokens; some rows padded (labels -100 there), some labels ignored."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            ids = torch.randint(0, 64, (L,), generator=g)
            mask = torch.ones(L, dtype=torch.long)
            if i % 3 == 1:
                mask[L - 1 - i % 7 :] = 0
            labels = ids.masked_fill(mask == 0, -100)
            labels[: i % 5] = -100
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class IterableRows(torch.utils.data.IterableDataset):
    def __init__(self, n: int, seed: int = 0):
        self.rows = Rows(n, seed)

    def __iter__(self):
        return iter(self.rows.rows)


class SizedIterable(torch.utils.data.IterableDataset):
    """An IterableDataset with a length (as many streaming wrappers have)."""

    def __init__(self, rows):
        self.rows = list(rows)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)


EVAL_DATA = {"map": Rows, "iterable": IterableRows, "sized": lambda n, seed: SizedIterable(Rows(n, seed).rows)}


def _reset_accelerate():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)  # a new Trainer may change mixed precision


def _args(out, per_device, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
              max_steps=4, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=1, logging_steps=1,
              report_to=[], save_strategy="no", seed=0, data_seed=0, max_grad_norm=1.0,
              include_num_input_tokens_seen="all", disable_tqdm=True, use_cpu=True, dataloader_drop_last=False)
    kw.update(overrides)
    return TrainingArguments(**kw)


def _history(trainer):
    keys = ("loss", "grad_norm", "learning_rate", "num_input_tokens_seen", "eval_loss", "total_flos")
    return [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history]


def train_run(per_device: int, cp_size=None, strategy="ring", iterable=False, overrides=None, configured=False,
              options=None, family: str = "llama"):
    """Train 4 steps, evaluate, predict. per_device is the batch of each DP group (1 process: the global batch).
    configured: keep the accelerate state the caller set up (else it is reset first). options: more of hfcp.patch's,
    given to the trainer. family: "llama", or any registered family's tiny model (hfcp.testing.tiny)."""
    from hfcp.integrations import HfcpTrainer
    from hfcp.testing.tiny import tiny_model as any_tiny_model

    if not configured:
        _reset_accelerate()
    model = tiny_model("llama") if family == "llama" else any_tiny_model(family)
    data = IterableRows(24) if iterable else Rows(24)
    with tempfile.TemporaryDirectory() as out:
        args = _args(out, per_device, **(overrides or {}))
        trainer = HfcpTrainer(model=model, args=args, train_dataset=data, eval_dataset=Rows(10, seed=1),
                              cp_size=cp_size, strategy=strategy, **(options or {}))
        trainer.train()
        metrics = trainer.evaluate()
        pred = trainer.predict(Rows(5, seed=2))
    return {"history": _history(trainer), "eval_loss": metrics["eval_loss"],
            "model_class": type(trainer.model).__name__,
            "predictions": _logits(pred.predictions), "label_ids": torch.as_tensor(pred.label_ids),
            "total_batch": trainer.get_total_train_batch_size(trainer.args),
            "wrapped_class": type(trainer.model_wrapped).__name__}


def _logits(predictions) -> torch.Tensor:
    """The prediction's logits (an MoE's predictions are the logits, then its router logits)."""
    return torch.as_tensor(predictions[0] if isinstance(predictions, tuple) else predictions)


def checkpointing_run(per_device: int, cp_size=None, overrides=None, enable_on_model=False, weights="lora",
                      reentrant=True, options=None):
    """4 steps with gradient checkpointing (asked for in the arguments, or enabled on the model before the trainer
    is made), LoRA on q/v or full weights (every parameter trains): the history and the DDP options the trainer
    wraps the model with (under CP the trainer wraps it in DDP even at dp 1). options: more of hfcp.patch's."""
    from peft import LoraConfig, get_peft_model

    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    model = tiny_model("llama")
    if weights == "lora":
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    checkpointing = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    if enable_on_model:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
        checkpointing = {}
    with tempfile.TemporaryDirectory() as out:
        trainer = HfcpTrainer(model=model, args=_args(out, per_device, **checkpointing, **(overrides or {})),
                              train_dataset=Rows(24), cp_size=cp_size, **(options or {}))
        trainer.train()
    handler = trainer.accelerator.ddp_handler
    return {"history": _history(trainer), "ddp": None if handler is None else
            {"static_graph": handler.static_graph, "find_unused_parameters": handler.find_unused_parameters}}


def resume_run(world_tag: str, cp_size=None):
    """8 steps straight, and 8 steps as 5 + resume from the checkpoint at step 5: the same losses."""
    from hfcp.integrations import HfcpTrainer

    per_device = 4 if dist.get_world_size() < 4 else 2
    out = os.path.join(tempfile.gettempdir(), f"hfcp-resume-{world_tag}")
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    runs = {}
    for name, resume in (("straight", None), ("resumed", os.path.join(out, "checkpoint-5"))):
        _reset_accelerate()
        args = _args(out, per_device, max_steps=8, save_strategy="steps", save_steps=5)
        trainer = HfcpTrainer(model=tiny_model("llama", seed=0), args=args, train_dataset=Rows(24), cp_size=cp_size)
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return runs


ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto", "bf16": {"enabled": False}, "fp16": {"enabled": False}}


def deepspeed_run(per_device: int, cp_size=None, accum: int = 1, options=None, family: str = "llama"):
    """DeepSpeed ZeRO-3 (parameters, gradients and optimizer states partitioned over all processes) on CPU. options:
    more of hfcp.patch's, given to the trainer."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    # DeepSpeed's CPU shared-memory all-reduce is a C++ extension built on first use (about 60 s on a fresh
    # machine, every CI run); marked unavailable, DeepSpeed reduces through torch.distributed (gloo) instead
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    try:
        result = train_run(per_device, cp_size, "ring", False,
                           {"deepspeed": ZERO3, "gradient_accumulation_steps": accum}, options=options, family=family)
    finally:  # DeepSpeed's process-wide settings would follow later tests in this pool process
        import deepspeed.utils.groups

        deepspeed.utils.groups._WORLD_GROUP = None  # (its clone of the world group, which a later run finds destroyed)
        unset_hf_deepspeed_config()
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        _reset_accelerate()
    dist.barrier()
    return result


def _force_fsdp_state(version: int):
    """accelerate enables FSDP only for accelerator distributed types: on CPU, set its state to FSDP by hand (the one
    thing that differs from a GPU run); a Trainer with use_configured_state then takes it. Returns what to restore."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)  # whatever an earlier test in this process left
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap="LlamaDecoderLayer",
                                            state_dict_type="FULL_STATE_DICT")
    Accelerator(cpu=True)
    before = PartialState._shared_state["distributed_type"]
    AcceleratorState._shared_state.update(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return before


def _restore_state(before) -> None:
    from accelerate.state import PartialState

    PartialState._shared_state["distributed_type"] = before  # later tests in this process: accelerate's CPU state
    _reset_accelerate()


def accelerate_fsdp2_run(per_device: int, cp_size=None, accum: int = 1):
    """The Trainer under accelerate's FSDP2 plugin (on CPU: see _force_fsdp_state)."""
    before = _force_fsdp_state(2)
    try:
        return train_run(per_device, cp_size, "ring", False, {"accelerator_config": {"use_configured_state": True},
                                                              "gradient_accumulation_steps": accum}, configured=True)
    finally:
        _restore_state(before)


def bf16_run(per_device: int, cp_size=None):
    """Trainer(bf16=True): autocast through accelerate."""
    return train_run(per_device, cp_size, "ring", False, {"bf16": True})


def refused(kind: str):
    from transformers import Trainer

    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    with tempfile.TemporaryDirectory() as out:
        try:
            if kind == "stock_trainer":
                import hfcp

                model = hfcp.patch(tiny_model("llama"))
                Trainer(model=model, args=_args(out, 2), train_dataset=Rows(8)).train()
            elif kind == "label_smoothing":
                HfcpTrainer(model=tiny_model("llama"), args=_args(out, 2, label_smoothing_factor=0.1))
            elif kind == "compute_loss_func":
                HfcpTrainer(model=tiny_model("llama"), args=_args(out, 2), compute_loss_func=lambda *a, **k: 0)
            elif kind == "neftune":
                HfcpTrainer(model=tiny_model("llama"), args=_args(out, 2, neftune_noise_alpha=5.0))
            elif kind == "split_batches":
                HfcpTrainer(model=tiny_model("llama"), args=_args(out, 2, accelerator_config={"split_batches": True}))
            elif kind == "fsdp1":
                before = _force_fsdp_state(1)
                try:
                    HfcpTrainer(model=tiny_model("llama"), args=_args(out, 2, accelerator_config={
                        "use_configured_state": True}))
                finally:
                    _restore_state(before)
            elif kind == "fsdp":
                HfcpTrainer(model=tiny_model("llama"), args=_args(out, 2, fsdp=True, fsdp_config={"version": 2}))
            elif kind == "dispatch_batches":
                HfcpTrainer(model=tiny_model("llama"),
                            args=_args(out, 2, accelerator_config={"dispatch_batches": True}))
            elif kind == "reentrant_find_unused_without_static_graph":
                checkpointing_run(4, None, {"ddp_static_graph": False, "ddp_find_unused_parameters": True})
            elif kind == "reentrant_static_graph_accumulation":
                checkpointing_run(2, None, {"ddp_static_graph": True, "gradient_accumulation_steps": 2}, weights="full")
        except ValueError as e:
            return str(e)
    return None


def save_and_reload():
    """The checkpoint a patched run saves loads without hfcp, with the original attention implementation."""
    import subprocess
    import sys

    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    out = os.path.join(tempfile.gettempdir(), "hfcp-save-reload")
    trainer = HfcpTrainer(model=tiny_model("llama"), args=_args(out, 4, max_steps=2), train_dataset=Rows(8))
    trainer.train()
    trainer.save_model(out)
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    code = ("import sys, json, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "print(json.dumps([m.config._attn_implementation, 'hfcp' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code, out], capture_output=True, text=True, timeout=120)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr[-2000:]


class VariableRows(torch.utils.data.Dataset):
    """Rows of different lengths for a padding-free (flattening) collator."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, 64, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def flattened_run(per_device: int, cp_size=None):
    from transformers import DataCollatorWithFlattening

    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    with tempfile.TemporaryDirectory() as out:
        args = _args(out, per_device, prediction_loss_only=True)
        trainer = HfcpTrainer(model=tiny_model("llama"), args=args, train_dataset=VariableRows(24),
                              eval_dataset=VariableRows(8, seed=1),
                              data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                              cp_size=cp_size)
        trainer.train()
        return {"history": _history(trainer), "eval_loss": trainer.evaluate()["eval_loss"],
                "imbalance_logged": [("cp_imbalance" in h) for h in trainer.state.log_history if "loss" in h]}


def word_tokenizer():
    """A 64-word tokenizer (t0..t59 and 4 specials) for the tiny model's vocabulary, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<bos>": 62, "<unk>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def prompt_completion(n: int, seed: int):
    import datasets

    g = torch.Generator().manual_seed(seed)
    words = lambda k: " ".join(f"t{int(i)}" for i in torch.randint(0, 60, (k,), generator=g))  # noqa: E731
    rows = [{"prompt": words(int(torch.randint(3, 12, (1,), generator=g))),
             "completion": words(int(torch.randint(2, 14, (1,), generator=g)))} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def tokenized_rows(n: int, seed: int, no_target=()):
    """Tokenized rows with labels; the rows in `no_target` have every label -100 (TRL counts their loss as 0)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 60, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * len(ids) if i in no_target else ids})
    return datasets.Dataset.from_list(rows)


def sft_run(per_device: int, cp_size=None, overrides=None, no_target_eval=False, lora_head=False):
    """no_target_eval: evaluate on 8 rows, the last 4 (one whole batch of 1 process) without targets.
    lora_head: LoRA on q/v with the output head trained in full (PEFT modules_to_save: a head that is no nn.Linear,
    so hfcp's chunked loss calls it under activation checkpointing)."""
    from trl import SFTConfig

    from hfcp.integrations import HfcpSFTTrainer

    _reset_accelerate()
    peft = {}
    if lora_head:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         modules_to_save=["lm_head"], init_lora_weights=False)
    with tempfile.TemporaryDirectory() as out:
        kw = dict(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                  max_steps=4, learning_rate=3e-3, warmup_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                  seed=0, data_seed=0, bf16=False, use_cpu=True, disable_tqdm=True, max_length=32,
                  include_num_input_tokens_seen="non_padding")  # padding differs per DP group
        kw.update(overrides or {})
        trainer = HfcpSFTTrainer(model=tiny_model("llama"), args=SFTConfig(**kw), processing_class=word_tokenizer(),
                                 train_dataset=prompt_completion(24, 0),
                                 eval_dataset=tokenized_rows(8, 1, range(4, 8)) if no_target_eval
                                 else prompt_completion(10, 1),
                                 cp_size=cp_size, **peft)
        trainer.train()
        metrics = trainer.evaluate()
        pred = trainer.predict(trainer.eval_dataset["eval"] if isinstance(trainer.eval_dataset, dict)
                               else trainer.eval_dataset)
    keys = ("loss", "grad_norm", "learning_rate", "num_input_tokens_seen", "mean_token_accuracy", "entropy",
            "num_tokens")
    history = [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
    return {"history": history, "imbalance": [h.get("cp_imbalance") for h in trainer.state.log_history if "loss" in h],
            "eval": {k: v for k, v in metrics.items() if k.startswith("eval_") and
                                         k.split("_", 1)[1] in ("loss", "mean_token_accuracy", "entropy")},
            "predictions": torch.as_tensor(pred.predictions), "label_ids": torch.as_tensor(pred.label_ids)}


class CroppedRows(Rows):
    """Random crops in __getitem__ (as long-context pipelines do): with worker processes, only seeding workers
    per DP group (not per process) gives the ranks of a CP group the same batch."""

    def __getitem__(self, i):
        row = self.rows[i]
        start = int(torch.randint(0, 5, (1,)))
        return {k: torch.roll(v, -start) for k, v in row.items()}


def cropped_run(per_device: int):
    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    # DataLoader workers forked, as in a process torchrun or accelerate launch starts (Linux's default); this pool's
    # processes were spawned, and would spawn them too (a fresh interpreter importing torch each: seconds apiece)
    method = multiprocessing.get_start_method()
    multiprocessing.set_start_method("fork", force=True)
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = HfcpTrainer(model=tiny_model("llama"), args=_args(out, per_device, dataloader_num_workers=1),
                                  train_dataset=CroppedRows(24))
            trainer.train()
    finally:
        multiprocessing.set_start_method(method, force=True)
    return {"history": _history(trainer)}


def vision_predict():
    """ViTModel (base): predictions are its whole last_hidden_state, as from one process."""
    from transformers import ViTConfig, ViTModel

    from hfcp.integrations import HfcpTrainer

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"pixel_values": torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(i))}

    _reset_accelerate()
    torch.manual_seed(0)
    model = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                               image_size=16, patch_size=4, attn_implementation="sdpa"), add_pooling_layer=False)
    with tempfile.TemporaryDirectory() as out:
        trainer = HfcpTrainer(model=model, args=_args(out, 2))
        pred = trainer.predict(Images())
    return torch.as_tensor(pred.predictions)


def conflicting_options():
    import hfcp
    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    model = hfcp.patch(tiny_model("llama"), strategy="ring")
    with tempfile.TemporaryDirectory() as out:
        try:
            HfcpTrainer(model=model, args=_args(out, 2), strategy="ulysses")
        except ValueError as e:
            return str(e)
    return None


def iterable_eval_run(per_device: int, cp_size=None, kind="iterable", overrides=None, workers=True, stock=False):
    """evaluate and predict (untrained model) on datasets (EVAL_DATA[kind]) whose last batch does not fill every DP
    group, their rows with different numbers of targets; then (workers) predict with 2 DataLoader workers, refused
    for an IterableDataset over DP groups: the error. stock: transformers' Trainer (one process), not HfcpTrainer."""
    from transformers import Trainer

    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    data = EVAL_DATA[kind]
    with tempfile.TemporaryDirectory() as out:
        args = _args(out, per_device, **(overrides or {}))
        trainer = Trainer(model=tiny_model("llama"), args=args) if stock else \
            HfcpTrainer(model=tiny_model("llama"), args=args, cp_size=cp_size)
        metrics = trainer.evaluate(data(10, 1))
        pred = trainer.predict(data(5, 2))
        small = trainer.predict(data(3, 3))  # fewer rows than one batch of all DP groups
        trainer.args.dataloader_num_workers, refused = 2, None
        try:
            if workers:
                trainer.predict(data(5, 2))
        except ValueError as e:
            refused = str(e)
    return {"eval_loss": metrics["eval_loss"], "test_loss": pred.metrics["test_loss"],
            "predictions": torch.as_tensor(pred.predictions), "label_ids": torch.as_tensor(pred.label_ids),
            "small_loss": small.metrics["test_loss"], "small_predictions": torch.as_tensor(small.predictions),
            "refused": refused, "targets": [int((r["labels"][1:] != -100).sum()) for r in Rows(5, 2).rows]}


def sharded_stream_refused(shards: int) -> str | None:
    """predict on a datasets.IterableDataset of `shards` shards at dp 2 x cp 2: the error every rank raises."""
    import datasets

    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    stream = datasets.Dataset.from_list([{k: v.tolist() for k, v in r.items()} for r in Rows(5, 2).rows])
    stream = stream.to_iterable_dataset(num_shards=shards).with_format("torch")
    with tempfile.TemporaryDirectory() as out:
        trainer = HfcpTrainer(model=tiny_model("llama"), args=_args(out, 2), cp_size=2)
        try:
            trainer.predict(stream)
        except ValueError as e:
            return str(e)
    return None


class ImageRows(torch.utils.data.Dataset):
    """n rows of a tiny LLaVA's inputs: 40 tokens with one image (16 placeholder tokens) at a row-dependent place,
    its pixels, labels off the image; every third row text only (no pixels: its own batch, see vlm_run)."""

    def __init__(self, n: int, seed: int = 0, with_images: bool = True):
        from workers_vlm import IMAGE

        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            ids = torch.randint(3, 88, (40,), generator=g)
            row = {"input_ids": ids}
            if with_images:
                at = 3 + 5 * (i % 4)  # images at different places, some across the zigzag cut
                ids[at:at + 16] = IMAGE
                row["pixel_values"] = torch.randn(3, 16, 16, generator=g)
            row["labels"] = ids.masked_fill(ids == IMAGE, -100)
            self.rows.append(row)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def vlm_run(per_device: int, cp_size=None, with_images: bool = True):
    """4 LoRA steps (adapters on the language model's attention only) of a tiny LLaVA, then evaluate: the history."""
    from workers_vlm import tiny_vlm

    return _multimodal_lora_run(tiny_vlm("llava"), ImageRows(16, 0, with_images), ImageRows(6, 1, with_images),
                                per_device, cp_size)


def _multimodal_lora_run(model, train, evaluation, per_device: int, cp_size):
    """4 LoRA steps of HfcpTrainer (adapters on the language model's q / v projections only), then evaluate:
    {"history", "eval_loss", "lora_only_in_language_model"}."""
    from peft import LoraConfig, get_peft_model

    from hfcp.integrations import HfcpTrainer

    _reset_accelerate()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=r".*language_model.*\.(q_proj|v_proj)"))
    with tempfile.TemporaryDirectory() as out:
        trainer = HfcpTrainer(model=model, args=_args(out, per_device), train_dataset=train, eval_dataset=evaluation,
                              cp_size=cp_size)
        trainer.train()
        metrics = trainer.evaluate()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {"history": _history(trainer), "eval_loss": metrics["eval_loss"],
            "lora_only_in_language_model": bool(trainable) and all("language_model" in n and "lora_" in n
                                                                   for n in trainable)}


class ClipRows(torch.utils.data.Dataset):
    """n rows of a tiny Qwen2-Audio's inputs: 40 tokens with one clip (8 placeholder tokens) at a row-dependent
    place, its mel features and frame mask, labels off the clip."""

    def __init__(self, n: int, seed: int = 0):
        from hfcp.testing.tiny_audio import AUDIO, FRAMES

        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            ids = torch.randint(3, 88, (40,), generator=g)
            at = 3 + 6 * (i % 4)  # clips at different places, some across the zigzag cut
            ids[at:at + 8] = AUDIO
            self.rows.append({"input_ids": ids, "labels": ids.masked_fill(ids == AUDIO, -100),
                              "input_features": torch.randn(8, FRAMES, generator=g),
                              "feature_attention_mask": torch.ones(FRAMES, dtype=torch.long)})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def audio_run(per_device: int, cp_size=None):
    """4 LoRA steps (adapters on the language model's attention only) of a tiny Qwen2-Audio, then evaluate."""
    from hfcp.testing.tiny_audio import tiny_audio

    return _multimodal_lora_run(tiny_audio("qwen2_audio"), ClipRows(16, 0), ClipRows(6, 1), per_device, cp_size)


def audio_sft_run(per_device: int, cp_size=None):
    """4 steps of HfcpSFTTrainer on a tiny Qwen2-Audio, rows already made (TRL's SFT has no audio preparation, so
    the dataset is passed through with skip_prepare_dataset and a collator that stacks the clips), LoRA on the
    language model, then evaluate: the history, the eval loss and the clips this rank's audio encoder was given."""
    from peft import LoraConfig
    from trl import SFTConfig

    from hfcp.integrations import HfcpSFTTrainer
    from hfcp.testing.tiny_audio import tiny_audio

    _reset_accelerate()
    model, clips_encoded = tiny_audio("qwen2_audio"), []
    model.model.audio_tower.conv1.register_forward_pre_hook(  # inside the split
        lambda m, a: clips_encoded.append(a[0].shape[0]))

    def rows(n, seed):  # a datasets.Dataset of ClipRows' rows (TRL takes no torch Dataset)
        import datasets

        return datasets.Dataset.from_list([{k: v.tolist() for k, v in r.items()} for r in ClipRows(n, seed).rows])

    def stack(batch):  # (with the attention mask TRL's metrics read)
        out = {k: torch.tensor([r[k] for r in batch], dtype=torch.float32 if k == "input_features" else torch.long)
               for k in batch[0]}
        return {**out, "attention_mask": torch.ones_like(out["input_ids"])}

    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                         max_steps=4, learning_rate=3e-3, warmup_steps=1, logging_steps=1, report_to=[],
                         save_strategy="no", seed=0, data_seed=0, bf16=False, use_cpu=True, disable_tqdm=True,
                         max_length=None, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
        trainer = HfcpSFTTrainer(model=model, args=args, train_dataset=rows(16, 0), eval_dataset=rows(6, 1),
                                 data_collator=stack, processing_class=word_tokenizer(),
                                 peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                        target_modules=r".*language_model.*\.(q_proj|v_proj)"),
                                 cp_size=cp_size)
        trainer.train()
        metrics = trainer.evaluate()
    return {"history": [{k: h[k] for k in ("loss", "grad_norm") if k in h} for h in trainer.state.log_history
                        if "loss" in h], "eval_loss": metrics["eval_loss"], "clips_encoded": clips_encoded}


def vlm_processor():
    """A LLaVA processor for workers_vlm's tiny LLaVA, built offline: word_tokenizer's words with "<image>" (id 90),
    and a SigLIP image processor to 16 x 16 (each image becomes 16 placeholder tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast, SiglipImageProcessorPil

    vocab = {f"t{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<bos>": 62, "<unk>": 63, "<image>": 90}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
                "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}")
    return LlavaProcessor(image_processor=SiglipImageProcessorPil(size={"height": 16, "width": 16}), tokenizer=tok,
                          patch_size=4, vision_feature_select_strategy="full", image_token="<image>",
                          num_additional_image_tokens=0, chat_template=template)


def image_text_rows(n: int, seed: int):
    """TRL's conversational vision format: "images" (PIL images, 0 to 2 per row, of different sizes) and "messages"
    (a user turn and an assistant turn; TRL puts the images before the user's text)."""
    import datasets
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    words = lambda k: " ".join(f"t{int(i)}" for i in torch.randint(0, 60, (k,), generator=g))  # noqa: E731
    rows = []
    for i in range(n):
        count = i % 3
        images = [Image.fromarray(torch.randint(0, 256, (int(torch.randint(12, 30, (1,), generator=g)), 20, 3),
                                                generator=g, dtype=torch.uint8).numpy()) for _ in range(count)]
        turns = [words(int(torch.randint(2, 9, (1,), generator=g))) for _ in range(2)]
        rows.append({"images": images, "messages": [{"role": "user", "content": turns[0]},
                                                    {"role": "assistant", "content": turns[1]}]})
    return datasets.Dataset.from_list(rows)


def vlm_sft_run(per_device: int, cp_size=None):
    """4 steps of HfcpSFTTrainer on a tiny LLaVA with TRL's vision collator (its processor makes the pixel values
    and expands each "<image>"), LoRA on the language model: the history and the eval loss."""
    from peft import LoraConfig
    from trl import SFTConfig

    from hfcp.integrations import HfcpSFTTrainer
    from workers_vlm import tiny_vlm

    _reset_accelerate()
    model, images_encoded = tiny_vlm("llava"), []
    model.model.vision_tower.embeddings.register_forward_pre_hook(  # inside the split
        lambda m, a: images_encoded.append(a[0].shape[0]))
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                         max_steps=4, learning_rate=3e-3, warmup_steps=1, logging_steps=1, report_to=[],
                         save_strategy="no", seed=0, data_seed=0, bf16=False, use_cpu=True, disable_tqdm=True,
                         max_length=None)
        trainer = HfcpSFTTrainer(model=model, args=args, processing_class=vlm_processor(),
                                 train_dataset=image_text_rows(12, 0), eval_dataset=image_text_rows(6, 1),
                                 peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                        target_modules=r".*language_model.*\.(q_proj|v_proj)"),
                                 cp_size=cp_size)
        trainer.train()
        metrics = trainer.evaluate()
    keys = ("loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens")
    return {"history": [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h],
            "eval_loss": metrics["eval_loss"], "images_encoded": images_encoded}


def sft_eval_run(per_device: int, cp_size=None, kind="sized"):
    """HfcpSFTTrainer.predict (untrained model) on 5 tokenized rows of 6-19 tokens (different numbers of targets,
    TRL's collator pads them), map-style or a SizedIterable (kind "sized"): the loss, predictions and labels."""
    from trl import SFTConfig

    from hfcp.integrations import HfcpSFTTrainer

    _reset_accelerate()
    rows = [{k: torch.tensor(v) for k, v in r.items()} for r in tokenized_rows(5, 2)]
    data = SizedIterable(rows) if kind == "sized" else rows
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_eval_batch_size=per_device, report_to=[], bf16=False,
                         use_cpu=True, disable_tqdm=True, max_length=32)
        trainer = HfcpSFTTrainer(model=tiny_model("llama"), args=args, processing_class=word_tokenizer(),
                                 train_dataset=prompt_completion(4, 0), cp_size=cp_size)
        pred = trainer.predict(data)
    return {"test_loss": pred.metrics["test_loss"], "predictions": torch.as_tensor(pred.predictions),
            "label_ids": torch.as_tensor(pred.label_ids),
            "targets": [int((r["labels"][1:] != -100).sum()) for r in rows]}
