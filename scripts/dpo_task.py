"""The DPO task of finetune_lora.py (--task dpo): preference pairs on the embedded key documents, trained with
hfcp.integrations.HfcpDPOTrainer (TRL's DPOTrainer under CP) on the embedded tiny Llama.

Each pair's prompt is a key document up to its last words (" so the key is"); the chosen answer repeats the key
given at the document's start, the rejected one gives another key of the same alphabet. Preferring the chosen
answer needs attention from the document's end back to its start, across the shards of a CP group. The metric is
the preference accuracy: the share of held-out pairs whose chosen answer has the higher log-probability under the
policy (each answer's summed log-probs, computed exactly under CP by hfcp.sequence_logps).
"""
from __future__ import annotations

import random

import torch
from finetune_data import KEY_CHARS, ByteTokenizer, key_document

PAD = 258  # a byte tokenizer id (vocab 260) no document uses


def byte_tokenizer():
    """ByteTokenizer's ids (bytes 0..255, BOS 256, EOS 257) as a transformers tokenizer, which DPOTrainer needs to
    tokenize its prompts and answers; built offline, PAD 258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = _byte_level_chars()  # the printable stand-in of each byte, as the ByteLevel pre-tokenizer writes it
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet()), "tokenizers' byte-level alphabet changed"
    vocab = {c: b for b, c in enumerate(chars)} | {"<bos>": ByteTokenizer.bos_token_id,
                                                   "<eos>": ByteTokenizer.eos_token_id, "<pad>": PAD}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _byte_level_chars() -> list[str]:
    """The character GPT-2's byte-level encoding gives each byte 0..255 (printable bytes stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_pair(rng: random.Random, length: int) -> dict:
    """One preference pair on a key document of about `length` characters: prompt, chosen, rejected."""
    text, key = key_document(rng, length)
    wrong = key
    while wrong == key:
        wrong = "".join(rng.choice(KEY_CHARS) for _ in range(len(key)))
    cut = text.rindex(key) - 1  # the prompt ends with "so the key is"; the answer starts with its space
    return {"prompt": text[:cut], "chosen": f" {key}.", "rejected": f" {wrong}."}


def pairs(n: int, seq_len: int, seed: int):
    """n training pairs whose rows (BOS, the document, the answer, EOS) fit in seq_len tokens."""
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list([make_pair(rng, seq_len - 2) for _ in range(n)])


@torch.no_grad()
def preference_accuracy(model, tok, seq_len: int, n: int, seed: int, device) -> float:
    """Share of n held-out pairs where the policy's log-probability of the chosen answer (with its EOS, as DPOTrainer
    scores it) exceeds the rejected one's: both rows in one batch, their sums whole and identical on every rank."""
    import hfcp

    rng, correct = random.Random(30_000 + seed), 0
    model.eval()
    for _ in range(n):
        pair = make_pair(rng, seq_len - 2)
        prompt = tok(pair["prompt"])["input_ids"]
        rows = [tok(pair["prompt"] + pair[k] + tok.eos_token)["input_ids"] for k in ("chosen", "rejected")]
        width = max(map(len, rows))
        ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows], device=device)
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
        answer = attention.clone()
        answer[:, : len(prompt)] = 0  # the targets counted: the answer's tokens
        sums = hfcp.sequence_logps(model, ids, attention_mask=attention, mask=answer).sums
        correct += int(sums[0] > sums[1])
    model.train()
    return correct / max(n, 1)


def make_trainer(model, lora, training: dict, args, n_pairs: int, **hfcp_options):
    """HfcpDPOTrainer on the pairs: LoRA from `lora` (the reference is the policy with its adapter disabled), the
    Trainer settings of the other tasks, DPO's sigmoid loss (args.beta) plus args.rpo_alpha x the chosen answer's NLL
    (RPO, TRL's "sft" loss type). Returns (trainer, tokenizer)."""
    from trl import DPOConfig

    from hfcp.integrations import HfcpDPOTrainer

    tok = byte_tokenizer()
    losses = dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, args.rpo_alpha]) if args.rpo_alpha else {}
    config = DPOConfig(**training, beta=args.beta, **losses, max_length=None, bf16=False, dataset_num_proc=None,
                       gradient_checkpointing=args.gradient_checkpointing)
    trainer = HfcpDPOTrainer(model=model, args=config, processing_class=tok, peft_config=lora,
                             train_dataset=pairs(n_pairs, args.seq_len, args.seed), **hfcp_options)
    return trainer, tok
