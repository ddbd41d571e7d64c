"""Data for finetune_lora.py: the embedded long-range corpus, a byte tokenizer, loading and packing."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

WORDS = ("the of and to in is was for on that with as by at from his her they which this be were are "
         "river stone field light north market winter garden letter signal").split()
KEY_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS=256, EOS=257 (vocab 260): needs nothing from the network."""

    bos_token_id, eos_token_id, vocab_size = 256, 257, 260

    def __call__(self, text: str) -> dict:
        """Like a transformers tokenizer: BOS + bytes (no EOS)."""
        return {"input_ids": [self.bos_token_id, *text.encode("utf-8")]}

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def key_document(rng: random.Random, length: int) -> tuple[str, str]:
    """A document whose last characters repeat a key given at its start: predicting them needs attention
    that reaches back across the whole document (and so across shard boundaries)."""
    key = "".join(rng.choice(KEY_CHARS) for _ in range(8))
    head, tail = f"key {key}. ", f" so the key is {key}."
    body, i = [], rng.randrange(len(WORDS))  # the filler cycles through WORDS: learnable, so what remains
    while sum(len(w) + 1 for w in body) < length - len(head) - len(tail):  # of the loss is the key
        body.append(WORDS[i % len(WORDS)])
        i += 1
    return head + " ".join(body) + tail, key


def encode_document(tok, text: str) -> list[int]:
    """Token ids of one training document, ended by EOS when the tokenizer has one."""
    ids = list(tok(text)["input_ids"])
    eos = getattr(tok, "eos_token_id", None)
    return ids + [eos] if eos is not None else ids


def key_span(tok, text: str, key: str) -> tuple[list[int], int, int]:
    """(ids, start, end): the tokens [start, end) of `ids` spell the final occurrence of `key`."""
    cut = text.rindex(key) - 1  # keep the space with the key, as BPE tokenizers do
    ids = list(tok(text)["input_ids"])
    start, end = len(tok(text[:cut])["input_ids"]), len(tok(text[:cut] + " " + key)["input_ids"])
    return ids, start, end


LONG_SHARE = 0.9  # of --seq-len: the longest documents of the embedded corpus, and the held-out ones
LONG_MIN_CHARS = 64  # the shortest long document
SHORT = (38, 70)  # characters of the short documents (the shortest key document has 38): ~38 keys a 2048 row
# the shortest row the text task fills: a long document (0.9 x seq_len characters, at least LONG_MIN_CHARS) whole,
# and a short one (up to 70 characters, BOS and EOS) unbroken
MIN_SEQ_LEN = max(math.ceil(LONG_MIN_CHARS / LONG_SHARE), SHORT[1] + 2)


def embedded_corpus(n_docs: int, max_chars: int, seed: int) -> list[str]:
    """Key documents of random lengths up to max_chars (at least LONG_MIN_CHARS): several per packed row, so each
    step has several keys to recall, many of them across shard boundaries."""
    if max_chars < LONG_MIN_CHARS:
        raise ValueError(f"max_chars={max_chars}: the embedded corpus's documents have at least {LONG_MIN_CHARS} "
                         f"characters (a row of at least {MIN_SEQ_LEN} tokens)")
    rng = random.Random(seed)
    return [key_document(rng, rng.randint(max(LONG_MIN_CHARS, max_chars // 8), max_chars))[0] for _ in range(n_docs)]



def curriculum_rows(tok, seq_len: int, short_rows: int, long_rows: int, seed: int) -> list:
    """The embedded corpus packed in training order: `short_rows` rows of short key documents (SHORT), where a tiny
    model from random weights first learns to copy a key (many keys a row, close to their copies), then at least
    `long_rows` rows of documents up to 0.9 x seq_len characters (embedded_corpus: the key far from its copy, across
    the shards of a CP group), where it learns to copy across the whole row."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < short_rows:  # (whole rows only: the last, partly filled one is dropped)
        docs = [encode_document(tok, key_document(rng, rng.randint(*SHORT))[0])
                for _ in range(max(1, (short_rows - len(rows)) * seq_len // 60))]
        rows += pack(docs, seq_len)[:-1]
    rows = rows[:short_rows]
    long, n_docs = [], 2000
    while len(long) < long_rows:
        long = pack([encode_document(tok, t) for t in embedded_corpus(n_docs, int(seq_len * LONG_SHARE), seed)],
                    seq_len)
        n_docs *= 2
    return rows + long


def load_texts(path: str) -> list[str]:
    """A directory of .txt files or a .jsonl file with a "text" field. Raises ValueError if no text."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--data {path}: no such file or directory")
    if p.is_dir():
        texts = [f.read_text(encoding="utf-8") for f in sorted(p.glob("*.txt"))]
    else:
        texts = [json.loads(line).get("text", "")
                 for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"--data {path}: found no text (expected *.txt files or a .jsonl with a 'text' field)")
    return texts


def pack(docs: list[list[int]], seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Pack token lists into (input_ids, position_ids, labels) rows of seq_len; documents keep their
    boundaries through position_ids resets (a document longer than seq_len is cut into pieces, each
    starting at position 0); the padding that fills the last row is ignored in the loss."""
    rows, ids, pos = [], [], []
    for doc in docs:
        for start in range(0, len(doc), seq_len):
            piece = doc[start : start + seq_len]
            if len(ids) + len(piece) > seq_len:
                rows.append((ids, pos))
                ids, pos = [], []
            ids += piece
            pos += list(range(len(piece)))
    if ids:
        rows.append((ids, pos))
    out = []
    for ids, pos in rows:
        pad = seq_len - len(ids)
        # a document's first token is no target of the previous document's last one (as transformers'
        # DataCollatorWithFlattening does): -100 where a position restarts at 0
        labels = [-100 if p == 0 and i > 0 else t for i, (t, p) in enumerate(zip(ids, pos))]
        out.append((torch.tensor(ids + [0] * pad), torch.tensor(pos + list(range(len(pos), len(pos) + pad))),
                    torch.tensor(labels + [-100] * pad)))
    return out
