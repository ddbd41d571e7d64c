"""Workers for HfcpGRPOTrainer tests: the same GRPO run by TRL's GRPOTrainer in one process and by HfcpGRPOTrainer
at cp 2 (dp 1) or dp 2 x cp 2; each returns the completions it drew, what it logged and its grad norms."""
from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from workers_trainer import _reset_accelerate, word_tokenizer

# what the Trainer logs per step that depends on the clock, not on the run
_TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
           "eval_samples_per_second", "eval_steps_per_second")


def tiny_llama(seed: int = 0):
    """A tiny Llama built from its config as transformers builds one (its generation config from it too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         bos_token_id=62, eos_token_id=61, pad_token_id=60)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def prompts(n: int, seed: int = 0):
    """n prompts of 3 to 11 words (t0..t59): the batches have left padding."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(3, 12, (1,), generator=g))
        rows.append({"prompt": " ".join(f"t{int(i)}" for i in torch.randint(0, 60, (k,), generator=g))})
    return datasets.Dataset.from_list(rows)


REWARD_CALLS = [0]  # calls of key_repeated in this process since the last grpo_run began


def key_repeated(prompts, completions, **kwargs):
    """A rule-based reward: how often the completion repeats the prompt's first word (its key), less a length cost."""
    REWARD_CALLS[0] += 1
    out = []
    for p, c in zip(prompts, completions):
        key, words = p.split()[0], c.split()
        out.append(sum(w == key for w in words) + 0.1 * sum(w in p.split() for w in words) - 0.02 * len(words))
    return out


def grpo_args(out: str, per_device: int, **overrides):
    from trl import GRPOConfig

    kw = dict(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
              num_generations=4, max_completion_length=8,
              max_steps=3, learning_rate=5e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
              bf16=False, use_cpu=True, disable_tqdm=True, temperature=1.0)
    kw.update(overrides)
    return GRPOConfig(**kw)


def grpo_run(per_device: int, hfcp: bool, cp_size=None, overrides=None, lora=False, reference=False, evaluate=False,
             strategy="ring"):
    """Train GRPO steps (3 unless overrides say otherwise); per_device is the batch of each DP group (1 process: the
    global batch). hfcp False: TRL's GRPOTrainer (the reference, one process). reference: the model given as one
    loaded from a directory, from which TRL loads its reference model (beta > 0 without LoRA). evaluate: then
    evaluate on 12 other prompts (48 completions). strategy: HfcpGRPOTrainer's."""
    from trl import GRPOTrainer

    from hfcp import cp_state

    _reset_accelerate()
    REWARD_CALLS[0] = 0
    kw = {}
    if lora:
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    if hfcp:
        from hfcp.integrations import HfcpGRPOTrainer as cls

        kw.update(cp_size=cp_size, strategy=strategy)
    else:
        cls = GRPOTrainer
    drawn, widths = [], []
    with tempfile.TemporaryDirectory() as out:
        model = tiny_llama()
        if reference:  # transformers saves on rank 0 only: every rank loads rank 0's copy
            shared = [f"{out}/policy"]
            if dist.is_initialized():
                dist.broadcast_object_list(shared, src=0)
            model.save_pretrained(shared[0])
            if dist.is_initialized():
                dist.barrier()
            model = type(model).from_pretrained(shared[0])
        # the widest sequence the embeddings saw: under CP each rank embeds its shard only
        model.get_input_embeddings().register_forward_hook(lambda m, args, y: widths.append(args[0].shape[-1]))
        trainer = cls(model=model, reward_funcs=key_repeated, args=grpo_args(out, per_device, **(overrides or {})),
                      train_dataset=prompts(32), eval_dataset=prompts(12, 1) if evaluate else None,
                      processing_class=word_tokenizer(), **kw)
        generate = trainer._generate_and_score_completions

        def record(inputs):
            batch = generate(inputs)
            drawn.append(torch.cat([batch["completion_ids"], batch["completion_mask"]], 1).cpu())
            return batch

        trainer._generate_and_score_completions = record
        trainer.train()
        if evaluate:
            trainer.evaluate()
    history = [{k: v for k, v in h.items() if k not in _TIMING + ("cp_imbalance",)} for h in trainer.state.log_history]
    ref_model, state = getattr(trainer, "ref_model", None), cp_state(trainer.model)
    return {"history": history, "imbalance": [h.get("cp_imbalance") for h in trainer.state.log_history if "loss" in h],
            "completions": drawn, "widest": max(widths), "reward_calls": REWARD_CALLS[0],
            "reference": None if ref_model is None else ("patched" if cp_state(ref_model) else "unpatched"),
            "strategy": state.settings.strategy if state is not None else None}


def grpo_table(per_device: int, hfcp: bool, cases: list[dict], cp_size=None):
    """grpo_run of each case ({"overrides": {...}, "lora": ..., "reference": ..., "evaluate": ..., "strategy": ...})
    in one call."""
    return [grpo_run(per_device, hfcp, cp_size, c.get("overrides"), c.get("lora", False), c.get("reference", False),
                     c.get("evaluate", False), c.get("strategy", "ring"))
            for c in cases]


REFUSED = {  # GRPOConfig overrides HfcpGRPOTrainer refuses, with a word its message must hold
    "vllm": ({"use_vllm": True}, "use_vllm"),
    "entropy bonus": ({"entropy_coef": 0.01}, "entropy_coef"),
    "eval groups": ({"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 2},
                    "per_device_eval_batch_size"),  # GRPOConfig counts 2 x 2 processes, whole groups of 4
    "fp32 head": ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32"),
    "find unused": ({"ddp_find_unused_parameters": True}, "ddp_find_unused_parameters"),
    "split groups": ({"per_device_train_batch_size": 2}, "num_generations"),  # 2 per DP group, groups of 4
}


def broken_reward(prompts, completions, **kwargs):
    raise KeyError("no such column")


def grpo_refused(kind: str) -> str:
    """What HfcpGRPOTrainer raised (type: message) for one of REFUSED, or for a reward function that raises
    ("reward error": during the first step)."""
    from hfcp.integrations import HfcpGRPOTrainer

    _reset_accelerate()
    overrides, reward = (REFUSED[kind][0], key_repeated) if kind in REFUSED else ({}, broken_reward)
    with tempfile.TemporaryDirectory() as out:
        try:
            trainer = HfcpGRPOTrainer(model=tiny_llama(), reward_funcs=reward, args=grpo_args(out, 8, **overrides),
                                      train_dataset=prompts(32), eval_dataset=prompts(8, 1),
                                      processing_class=word_tokenizer())
            trainer.train()
        except Exception as e:  # noqa: BLE001 - the test reads it
            return f"{type(e).__name__}: {e}"
    return "nothing raised"


def grpo_generation_batch(overrides: dict) -> tuple[int, int, str]:
    """(generation_batch_size, steps_per_generation, what hfcp logged) of an HfcpGRPOTrainer built with these
    GRPOConfig overrides (per_device 4, groups of 4)."""
    import logging

    from hfcp.integrations import HfcpGRPOTrainer

    _reset_accelerate()
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("hfcp").addHandler(handler)
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = HfcpGRPOTrainer(model=tiny_llama(), reward_funcs=key_repeated,
                                      args=grpo_args(out, 4, **overrides), train_dataset=prompts(32),
                                      processing_class=word_tokenizer())
    finally:
        logging.getLogger("hfcp").removeHandler(handler)
    return trainer.args.generation_batch_size, trainer.args.steps_per_generation, "\n".join(logged)
