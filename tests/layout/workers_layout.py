"""HfcpTrainer driven by accelerate's ParallelismConfig (issue 21): from TrainingArguments, from accelerate launch's
environment, FSDP2 on dp_shard x cp, and what is refused."""
from __future__ import annotations

import os
import tempfile

import workers_trainer as T
from hfcp.integrations.parallelism import UNSET
from workers_model import tiny_model

LAUNCH_ENV = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"}


def layout_run(per_device: int, layout: dict | None, fsdp: bool = False, env: bool = False, lora: bool = False,
               prepatched: bool = False, cp_size=UNSET):
    """train_run's 4 steps, evaluation and prediction, with the CP size from a ParallelismConfig (`layout`: its
    sizes) or from the variables accelerate launch sets for --use_parallelism_config --parallelism_config_cp_size 2
    (layout None, env False: one process, no layout: the reference); and what accelerate was handed (its parallelism
    config: torch's CP must stay off)."""
    from accelerate import ParallelismConfig

    from hfcp.integrations import HfcpTrainer

    overrides = {"parallelism_config": ParallelismConfig(**layout)} if layout is not None else {}
    before = restore_init = None
    if fsdp:
        before = T._force_fsdp_state(2)
        overrides["accelerator_config"] = {"use_configured_state": True}
        restore_init = _configured_state_takes_the_parallelism_config()
    else:
        T._reset_accelerate()
    if env:
        os.environ.update(LAUNCH_ENV)
    try:
        with tempfile.TemporaryDirectory() as out:
            model = tiny_model("llama")
            if lora:  # LoRA on the attention projections (PEFT), as the job trains
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
            if prepatched:  # patched by the user, hfcp's default groups (the whole world)
                import hfcp

                hfcp.patch(model)
            trainer = HfcpTrainer(model=model, args=T._args(out, per_device, **overrides),
                                  train_dataset=T.Rows(24), eval_dataset=T.Rows(10, seed=1), cp_size=cp_size)
            trainer.train()
            metrics = trainer.evaluate()
            pred = trainer.predict(T.Rows(5, seed=2))
            handed = trainer.accelerator.parallelism_config
    finally:
        for k in LAUNCH_ENV if env else ():
            os.environ.pop(k, None)
        if fsdp:
            restore_init()
            T._restore_state(before)
    import torch

    handed_sizes = None if handed is None else (handed.dp_shard_size, handed.cp_size, handed.cp_enabled)
    return {"history": T._history(trainer), "eval_loss": metrics["eval_loss"],
            "model_class": type(trainer.model).__name__,
            "predictions": torch.as_tensor(pred.predictions), "label_ids": torch.as_tensor(pred.label_ids),
            "total_batch": trainer.get_total_train_batch_size(trainer.args), "handed": handed_sizes,
            "cp": trainer.get_cp_size()}


def _configured_state_takes_the_parallelism_config():
    """The FSDP state forced on CPU (workers_trainer._force_fsdp_state) is configured before the Trainer, so it would
    drop the ParallelismConfig the Trainer hands its Accelerator: take it, as a state created with it would. Then
    accelerate builds the mesh, validates it and shards over it with its own code. Returns the undo."""
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__

    def init(self, *args, parallelism_config=None, **kwargs):
        original(self, *args, parallelism_config=parallelism_config, **kwargs)
        if parallelism_config is not None:
            self.parallelism_config = parallelism_config

    AcceleratorState.__init__ = init
    return lambda: setattr(AcceleratorState, "__init__", original)


def layout_refused(kind: str):
    from accelerate import ParallelismConfig

    from hfcp.integrations import HfcpTrainer

    T._reset_accelerate()
    from accelerate.utils import TorchContextParallelConfig

    alltoall = dict(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"))
    layouts = {"conflict": dict(cp_size=2), "sp": dict(sp_size=2), "size": dict(cp_size=4), "tp": dict(tp_size=2),
               "dp_shard_on_cpu": dict(dp_shard_size=2), "alltoall": alltoall, "alltoall_ulysses": alltoall,
               "patched_other_groups": dict(cp_size=4)}
    given = {"conflict": {"cp_size": 1}, "alltoall_ulysses": {"strategy": "ulysses"}}.get(kind, {})
    model = tiny_model("llama")
    if kind == "patched_other_groups":  # 4 processes: patched with CP groups {0,1}, {2,3}; the layout's is all four
        import hfcp

        hfcp.patch(model, cp_size=2)
    with tempfile.TemporaryDirectory() as out:
        args = T._args(out, 2, parallelism_config=ParallelismConfig(**layouts[kind]))
        try:
            HfcpTrainer(model=model, args=args, **given)
        except ValueError as e:
            return str(e)
    return None


def sft_layout_run(per_device: int, layout: dict):
    """HfcpSFTTrainer with SFTConfig(parallelism_config=ParallelismConfig(**layout)) and no cp_size of its own."""
    from accelerate import ParallelismConfig

    return T.sft_run(per_device, None, {"parallelism_config": ParallelismConfig(**layout)})


def configured_accelerator_kept_cp():
    """An Accelerator configured before the trainer (its state on FSDP, forced on CPU) whose ParallelismConfig has
    cp 2, and a trainer told to use it: accelerate keeps that layout, so torch's CP would run under hfcp's."""
    from accelerate import ParallelismConfig
    from accelerate.state import AcceleratorState

    from hfcp.integrations import HfcpTrainer

    before = T._force_fsdp_state(2)
    AcceleratorState._shared_state["parallelism_config"] = ParallelismConfig(cp_size=2)
    try:
        with tempfile.TemporaryDirectory() as out:
            args = T._args(out, 2, parallelism_config=ParallelismConfig(cp_size=2),
                           accelerator_config={"use_configured_state": True})
            HfcpTrainer(model=tiny_model("llama"), args=args)
    except ValueError as e:
        return str(e)
    finally:
        T._restore_state(before)
    return None
