"""Workers for HfcpRewardTrainer tests: the same reward-model training with 1 process (stock RewardTrainer), 2 (cp 2)
or 4 (dp 2 x cp 2) processes; each returns what the Trainer logged per step and the evaluation's metrics."""
from __future__ import annotations

import tempfile

import torch
import transformers

from workers_trainer import _reset_accelerate, word_tokenizer

PAD = 60  # word_tokenizer's <pad>; the documents use ids 0..59 only
METRICS = ("loss", "grad_norm", "learning_rate", "accuracy", "margin", "min_reward", "mean_reward", "max_reward",
           "num_tokens", "num_input_tokens_seen")


def reward_model(seed: int = 0):
    """A tiny Llama reward model (one score) built from its config as transformers builds it."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256, num_labels=1, pad_token_id=PAD)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForSequenceClassification(cfg).float()


def preference_rows(n: int, seed: int, margin: bool = False, streamed: bool = False):
    """n tokenized pairs of 5..40 tokens: under cp 2 (zigzag, 4 chunks of the batch's padded length) the last
    token of a row lands on either rank, depending on the row's length."""
    import datasets

    g = torch.Generator().manual_seed(seed)

    def doc():
        return torch.randint(0, 60, (int(torch.randint(5, 41, (1,), generator=g)),), generator=g).tolist()

    rows = [{"chosen_ids": doc(), "rejected_ids": doc()} for _ in range(n)]
    if margin:
        for row in rows:
            row["margin"] = float(torch.rand((), generator=g))
    if streamed:  # a datasets.IterableDataset without a length (one shard)
        return datasets.IterableDataset.from_generator(lambda: iter(rows))
    return datasets.Dataset.from_list(rows)


class LeftPaddingCollator:
    """TRL's DataCollatorForPreference with the padding on the left (the last token is each row's last)."""

    def __call__(self, examples):
        from trl.trainer.utils import pad

        ids = [torch.tensor(e["chosen_ids"]) for e in examples] + [torch.tensor(e["rejected_ids"]) for e in examples]
        batch = {"input_ids": pad(ids, padding_value=PAD, padding_side="left"),
                 "attention_mask": pad([torch.ones_like(i) for i in ids], padding_value=0, padding_side="left")}
        if "margin" in examples[0]:
            batch["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float)
        return batch


class LastTokenRanks:
    """Wraps a collator and records which rank of a CP group of 2 holds each row's last non-pad token (the zigzag
    layout of the batch's length), to show that the scores come from both ranks."""

    def __init__(self, collator):
        self.collator, self.ranks = collator, set()

    def __call__(self, examples):
        from hfcp.layout import Layout

        batch = self.collator(examples)
        ids = batch["input_ids"]
        layout = Layout(seq_len=ids.shape[1], cp_size=2, zigzag=True)
        last = (torch.arange(ids.shape[1]) * (ids != PAD)).argmax(-1)  # as transformers finds the score's token
        for rank in range(2):
            held = layout.local_index(rank)
            self.ranks |= {rank} if bool(torch.isin(last, held).any()) else set()
        return batch


def reward_run(per_device: int, cp_size=None, overrides=None, left_padding=False, lora=False, margin=False,
               streamed_eval=False):
    """Train 3 steps on 12 pairs (per_device: the batch of each DP group), evaluate on 6 pairs (their last batch
    is partial: at dp 2, accelerate repeats pairs to fill it). cp_size None and one process: the stock
    RewardTrainer (the reference)."""
    import torch.distributed as dist
    from trl import RewardConfig, RewardTrainer

    from hfcp.integrations import HfcpRewardTrainer

    _reset_accelerate()
    extra = {}
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                          init_lora_weights=False)
    if left_padding:
        collator = LastTokenRanks(LeftPaddingCollator())
    else:
        from trl.trainer.reward_trainer import DataCollatorForPreference

        collator = LastTokenRanks(DataCollatorForPreference(pad_token_id=PAD))
    if dist.get_world_size() > 1:
        extra["cp_size"] = cp_size
    cls = HfcpRewardTrainer if dist.get_world_size() > 1 else RewardTrainer
    with tempfile.TemporaryDirectory() as out:
        kw = dict(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                  max_steps=3, learning_rate=3e-3, warmup_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                  seed=0, data_seed=0, bf16=False, use_cpu=True, disable_tqdm=True, center_rewards_coefficient=0.01,
                  dataloader_drop_last=False, include_num_input_tokens_seen="non_padding")
        kw.update(overrides or {})
        trainer = cls(model=reward_model(), args=RewardConfig(**kw), processing_class=word_tokenizer(),
                      train_dataset=preference_rows(12, 0, margin),
                      eval_dataset=preference_rows(6, 1, margin, streamed_eval),
                      data_collator=collator, **extra)
        trainer.train()
        metrics = trainer.evaluate()
    history = [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]
    imbalance = [h.get("cp_imbalance") for h in trainer.state.log_history if "loss" in h]
    evaluated = {k: v for k, v in metrics.items() if k.startswith("eval_") and k[5:] in METRICS}
    return {"history": history, "imbalance": imbalance, "eval": evaluated, "last_token_ranks": collator.ranks}


def refused_causal_lm() -> str:
    """A causal LM given as the reward model (num_labels=1 in its config, so RewardTrainer takes it): refused by
    name on every rank before hfcp patches anything."""
    from trl import RewardConfig

    from hfcp.integrations import HfcpRewardTrainer
    from hfcp.state import cp_state
    from workers_model import tiny_model

    _reset_accelerate()
    model = tiny_model("llama", num_labels=1, pad_token_id=PAD)
    with tempfile.TemporaryDirectory() as out:
        args = RewardConfig(output_dir=out, report_to=[], use_cpu=True, max_steps=1)
        try:
            HfcpRewardTrainer(model=model, args=args, processing_class=word_tokenizer(),
                              train_dataset=preference_rows(4, 0), cp_size=2)
        except ValueError as e:
            assert cp_state(model) is None, "refused after patching"
            return str(e)
    return "not refused"
