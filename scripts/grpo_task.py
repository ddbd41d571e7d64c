"""The GRPO task of finetune_lora.py (--task grpo): a rule-based reward for repeating a document's key, trained with
hfcp.integrations.HfcpGRPOTrainer (TRL's GRPOTrainer under CP, completions from the policy's own generate()) on the
embedded tiny Llama.

Each prompt is a key document up to its last words (" so the key is"), as in the dpo task; the policy completes it
and the reward is rule-based: the share of the key's characters that the completion repeats in their places
(key_reward). A random tiny model never repeats a key, so every completion would score 0 and GRPO would have no
signal; the task therefore starts with a short supervised warm-up (--sft-steps, HfcpTrainer under the same CP
groups) on the same documents, the loss on the answer only, and GRPO then trains the warmed-up policy. The metrics,
before and after GRPO: the mean reward and the exact-key accuracy of greedy completions after held-out prompts.
"""
from __future__ import annotations

import random

import torch
from dpo_task import PAD, byte_tokenizer
from finetune_data import ByteTokenizer, key_document

BOS, EOS = ByteTokenizer.bos_token_id, ByteTokenizer.eos_token_id
WARMUP_LR = 5e-3  # the warm-up's peak learning rate (the text and dpo tasks'); --lr is GRPO's
SLACK = 10  # a document of seq_len - SLACK characters (its last word runs over), with BOS and EOS, fits in seq_len


def make_prompt(rng: random.Random, seq_len: int) -> dict:
    """One prompt on a key document of about seq_len - SLACK characters: prompt (up to "so the key is"), key, and
    the answer the document gives (" KEY.")."""
    text, key = key_document(rng, seq_len - SLACK)
    cut = text.rindex(key) - 1  # the prompt ends with "so the key is"; the answer starts with its space
    return {"prompt": text[:cut], "key": key, "answer": text[cut:]}


def key_reward(completions: list[str], key: list[str], **kwargs) -> list[float]:
    """The rule-based reward of each completion: the number of the key's characters it repeats in their places (after
    one leading space), over the key's length. 1: the whole key; 0.75: the key with two characters wrong. Each
    character counts on its own: a reward for the leading characters only would penalise the right characters after
    a wrong first one, teaching a policy that copies imperfectly not to copy."""
    rewards = []
    for completion, k in zip(completions, key):
        said = completion.removeprefix(" ")
        rewards.append(sum(a == b for a, b in zip(said, k)) / len(k))
    return rewards


class AnswerRows(torch.utils.data.Dataset):
    """The warm-up's rows: BOS, a key document, EOS, padded to seq_len; the labels are the answer's tokens (" KEY."
    and EOS), the rest -100."""

    def __init__(self, n: int, seq_len: int, seed: int):
        rng, self.rows = random.Random(seed), []
        for _ in range(n):
            p = make_prompt(rng, seq_len)
            prompt, answer = list(p["prompt"].encode()), [*p["answer"].encode(), EOS]
            ids = [BOS, *prompt, *answer]
            assert len(ids) <= seq_len, (len(ids), seq_len)
            labels = [-100] * (1 + len(prompt)) + answer + [-100] * (seq_len - len(ids))
            self.rows.append((torch.tensor(ids + [PAD] * (seq_len - len(ids))), torch.tensor(labels)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return dict(zip(("input_ids", "labels"), self.rows[i]))


def prompts(n: int, seq_len: int, seed: int):
    """n GRPO prompts (a datasets.Dataset with "prompt" and "key"; TRL hands "key" to the reward function)."""
    import datasets

    rng = random.Random(20_000 + seed)
    return datasets.Dataset.from_list([{k: v for k, v in make_prompt(rng, seq_len).items() if k != "answer"}
                                       for _ in range(n)])


@torch.no_grad()
def key_scores(model, tok, seq_len: int, n: int, seed: int, device) -> dict:
    """The mean reward and the exact-key accuracy of greedy completions after n held-out prompts, generated in one
    left-padded batch (under CP: the prompts prefilled over the group, the KV cache spread over it)."""
    rng = random.Random(40_000 + seed)
    held_out = [make_prompt(rng, seq_len) for _ in range(n)]
    rows = [tok(p["prompt"])["input_ids"] for p in held_out]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows], device=device)
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=attention, do_sample=False, pad_token_id=PAD, eos_token_id=EOS,
                         max_new_tokens=len(held_out[0]["answer"]))
    model.train()
    rewards = key_reward(tok.batch_decode(out[:, width:], skip_special_tokens=True), [p["key"] for p in held_out])
    return {"reward": sum(rewards) / n, "exact_key_accuracy": sum(r == 1.0 for r in rewards) / n}


def warm_up(model, tok, training: dict, args, job, **hfcp_options):
    """The supervised warm-up: args.sft_steps steps of HfcpTrainer on AnswerRows (the answer's NLL), args.batch_size
    rows a step, peak learning rate WARMUP_LR; its records in warmup_metrics.jsonl. Returns the trainer and the
    key_scores before the warm-up."""
    from pathlib import Path

    from transformers import TrainingArguments
    from transformers.trainer_callback import ProgressCallback

    import hfcp
    from hfcp.integrations import HfcpTrainer

    out_dir = Path(training["output_dir"])
    settings = {**training, "max_steps": args.sft_steps, "save_strategy": "no", "learning_rate": WARMUP_LR,
                "warmup_steps": max(1, args.sft_steps // 10)}  # (it saves nothing: its records only)
    n = max(64, args.sft_steps * args.batch_size * args.grad_accum)  # the same rows for any layout
    trainer = HfcpTrainer(model=model, args=TrainingArguments(**settings),
                          train_dataset=AnswerRows(n, args.seq_len, 10_000 + args.seed), **hfcp_options)
    acc = trainer.accelerator
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    acc.wait_for_everyone()
    trainer.remove_callback(ProgressCallback)
    tokens_per_step = args.seq_len * args.batch_size * args.grad_accum * hfcp.data_parallel_rank_and_size(model)[1]
    trainer.add_callback(job.make_recorder(out_dir, 0, tokens_per_step, trainer.args.device, acc.is_main_process,
                                           name="warmup_metrics.jsonl", desc="warm-up"))
    first = key_scores(trainer.model, tok, args.seq_len, args.eval_docs, args.seed, trainer.args.device)
    acc.print(f"hfcp: the random model, before a warm-up of {args.sft_steps} steps: mean reward {first['reward']:.3f}, "
              f"exact key accuracy {first['exact_key_accuracy']:.3f}")
    trainer.train()
    return trainer, first


def make_trainer(model, lora, training: dict, args, job, **hfcp_options):
    """The LoRA policy warmed up (warm_up), then HfcpGRPOTrainer on the prompts with key_reward: args.num_generations
    completions of each prompt (sampled at temperature 1, up to the answer's length and EOS), args.batch_size
    completions a step, TRL's default loss (dapo) without KL (beta 0). Returns (trainer, tokenizer, key_scores
    before the warm-up)."""
    from peft import get_peft_model
    from trl import GRPOConfig

    from hfcp.integrations import HfcpGRPOTrainer

    tok = byte_tokenizer()
    for config in (model.config, model.generation_config):  # the byte tokenizer's (the config's defaults are others)
        config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS, EOS, PAD
    torch.manual_seed(args.seed)
    model = get_peft_model(model, lora)
    warm, first = warm_up(model, tok, training, args, job, **hfcp_options)
    answer = len(make_prompt(random.Random(0), args.seq_len)["answer"])  # " KEY.": the same length for every key
    config = GRPOConfig(**training, num_generations=args.num_generations, max_completion_length=answer + 1,
                        temperature=1.0, beta=0.0, bf16=False, gradient_checkpointing=args.gradient_checkpointing)
    n = max(64, args.max_steps * args.batch_size * args.grad_accum // args.num_generations)  # the same for any layout
    trainer = HfcpGRPOTrainer(model=warm.model, reward_funcs=key_reward, args=config, processing_class=tok,
                              train_dataset=prompts(n, args.seq_len, args.seed), **hfcp_options)
    return trainer, tok, first
