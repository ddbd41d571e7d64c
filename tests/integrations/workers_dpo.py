"""Workers for HfcpDPOTrainer tests: the same DPO run in 1 process (stock trl.DPOTrainer), at cp 2 and at dp 2 x cp 2;
each returns what the trainer logged."""
from __future__ import annotations

import tempfile

import torch

from workers_model import tiny_model
from workers_trainer import _reset_accelerate, word_tokenizer

METRICS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy",
           "mean_token_accuracy", "num_tokens")


def preference_rows(n: int, seed: int):
    """n preference pairs of random words: prompts of 3-11 words, completions of 1-9 (chosen, rejected differ)."""
    import datasets

    g = torch.Generator().manual_seed(seed)

    def words(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(f"t{int(i)}" for i in torch.randint(0, 60, (k,), generator=g))

    return datasets.Dataset.from_list([{"prompt": words(3, 12), "chosen": " " + words(1, 10),
                                        "rejected": " " + words(1, 10)} for _ in range(n)])


class LeftPadding:
    """TRL's preference collator, then each row's padding moved to its left (every mask along with it)."""

    def __init__(self, pad_token_id: int):
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        self.collate = DataCollatorForPreference(pad_token_id=pad_token_id)

    def __call__(self, examples):
        batch = self.collate(examples)
        shift = batch["attention_mask"].shape[1] - batch["attention_mask"].sum(1)
        for k in ("input_ids", "attention_mask", "completion_mask"):
            batch[k] = torch.stack([torch.roll(row, int(s)) for row, s in zip(batch[k], shift)])
        return batch


def _config(out, per_device: int, **overrides):
    from trl import DPOConfig

    kw = dict(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
              max_steps=3, learning_rate=3e-3, warmup_steps=1, logging_steps=1, report_to=[], save_strategy="no",
              seed=0, data_seed=0, bf16=False, use_cpu=True, disable_tqdm=True, gradient_checkpointing=False,
              max_length=None, dataset_num_proc=None)
    kw.update(overrides)
    return DPOConfig(**kw)


def _trainer(out, per_device, cp_size, reference: str, overrides: dict, left_padding: bool, ref_seed: int = 0):
    """reference: "model" (an explicit model: a copy of the initial policy, or with ref_seed another one), "lora"
    (LoRA; the reference is the policy with its adapter disabled) or "precompute" (an explicit model whose
    log-probs are computed before training)."""
    from hfcp.integrations import HfcpDPOTrainer

    _reset_accelerate()
    tok = word_tokenizer()
    extra = {}
    if reference in ("model", "precompute"):
        extra["ref_model"] = tiny_model("llama", seed=ref_seed, initializer_range=0.2)
    if reference == "precompute":
        overrides = {**overrides, "precompute_ref_log_probs": True}
    if reference == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                          init_lora_weights=False)
    if left_padding:
        extra["data_collator"] = LeftPadding(tok.pad_token_id)
    return HfcpDPOTrainer(model=tiny_model("llama", initializer_range=0.2), args=_config(out, per_device, **overrides),
                          processing_class=tok, train_dataset=preference_rows(8, 0), eval_dataset=preference_rows(4, 1),
                          cp_size=cp_size, **extra)


def _patched(trainer) -> tuple[bool, bool]:
    """(policy patched and given hfcp's fused head, reference patched and given it); None: no reference model."""
    from hfcp.state import cp_state, find_pretrained

    def patched(m):
        return cp_state(m) is not None and getattr(find_pretrained(m).forward, "hfcp_fused_head", False)

    return patched(trainer.model), None if trainer.ref_model is None else patched(trainer.ref_model)


def dpo_run(per_device: int, cp_size=None, reference="model", overrides=None, left_padding=False, predict=False):
    """Train 3 steps and evaluate: the logged metrics of each step and the eval metrics; predict: also the logits
    and labels trainer.predict returns on the eval pairs."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(out, per_device, cp_size, reference, overrides or {}, left_padding)
        trainer.train()
        metrics = trainer.evaluate()
        pred = trainer.predict(trainer.eval_dataset) if predict else None
    history = [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]
    imbalance = [h.get("cp_imbalance") for h in trainer.state.log_history if "loss" in h]
    return {"history": history, "imbalance": imbalance, "patched": _patched(trainer),
            "predictions": (None if pred is None
                            else (torch.as_tensor(pred.predictions), torch.as_tensor(pred.label_ids))),
            "eval": {k: v for k, v in metrics.items() if k.startswith("eval_") and k.split("_", 1)[1] in METRICS}}


# every loss type DPOTrainer offers, and the options that change what it computes from the log-probs
LOSS_CASES = [dict(loss_types=[t]) for t in (
    "sigmoid", "hinge", "ipo", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero",
    "apo_down", "discopop", "sft", "sigmoid_norm")] + [
    dict(loss_types=["exo_pair"], label_smoothing=1e-3),
    dict(loss_types=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),  # RPO (rpo_alpha=0.5 of older TRL)
    dict(loss_types=["sigmoid"], f_divergence_type="js_divergence"),
    dict(loss_types=["hinge"], f_divergence_type="alpha_divergence"),
    dict(loss_types=["sigmoid"], ld_alpha=0.5),
    dict(loss_types=["sigmoid"], use_weighting=True),
]


def loss_table(cp_size=None):
    """One batch of 3 pairs through DPOTrainer.compute_loss for each case of LOSS_CASES (the reference model another
    one than the policy, so that every log-ratio counts): the loss, the norm of the gradient (averaged over the CP
    group, as DDP would) and the metrics it logged."""
    import hfcp

    results = []
    with tempfile.TemporaryDirectory() as out:
        # use_weighting at construction: DPOTrainer's own fused head computes log sum p^2 only when asked then
        trainer = _trainer(out, 3, cp_size, "model", {"use_weighting": True}, False, ref_seed=1)
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        defaults = {k: getattr(trainer, k) for k in ("loss_types", "loss_weights", "label_smoothing",
                                                     "f_divergence_type", "ld_alpha", "use_weighting")}
        for case in LOSS_CASES:
            for k, v in {**defaults, "loss_weights": [1.0] * len(case["loss_types"]), "use_weighting": False,
                         **case}.items():
                setattr(trainer, k, v)
            trainer.model.zero_grad()
            trainer._metrics["train"].clear()
            loss = trainer.compute_loss(trainer.model, batch)
            loss.backward()
            hfcp.average_gradients(trainer.model)
            grads = [p.grad.double() for p in trainer.model.parameters() if p.grad is not None]
            norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
            metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
            results.append({"loss": float(loss), "grad_norm": float(norm), **metrics})
    return results


def refused(kind: str) -> str | None:
    """The ValueError a refused setting raises (None: none raised)."""
    import transformers
    from peft import PromptTuningConfig

    from hfcp.integrations import HfcpDPOTrainer

    extra = {}
    if kind == "prompt_tuning":
        model = tiny_model("llama")
        extra["peft_config"] = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    elif kind == "moe_aux":  # a mixture of experts whose config declares a router auxiliary loss
        cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                         num_experts_per_tok=1, router_aux_loss_coef=0.01)
        model = transformers.MixtralForCausalLM(cfg)
        extra["ref_model"] = transformers.MixtralForCausalLM(cfg)
    _reset_accelerate()
    try:
        with tempfile.TemporaryDirectory() as out:
            HfcpDPOTrainer(model=model, args=_config(out, 2), processing_class=word_tokenizer(),
                           train_dataset=preference_rows(4, 0), cp_size=2, **extra)
    except ValueError as e:
        return str(e)
    return None
