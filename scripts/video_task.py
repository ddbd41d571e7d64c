"""The video task of finetune_lora.py (--task video): a tiny random-weights Qwen2-VL built from
configs/tiny_qwen2_vl.json, and generated videos with a question whose answer needs attention across distant
frames.

Each video is a run of frames, each a grey of its own brightness, except one frame, anywhere in the video, filled
with a colour from COLOURS. After the video the prompt asks for that colour; the answer is one colour word, the
only target of the row besides the closing EOS. A frame is one temporal patch of
the tower (two identical raw frames), 16 x 16 pixels: four merged video tokens per frame.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny_qwen2_vl.json"
COLOURS = {"red": (1, -1, -1), "green": (-1, 1, -1), "blue": (-1, -1, 1), "yellow": (1, 1, -1),
           "cyan": (-1, 1, 1), "magenta": (1, -1, 1)}
COLOUR_IDS = {name: 10 + i for i, name in enumerate(COLOURS)}  # the answer words
QUESTION = list(range(20, 26))  # "which colour had the coloured frame ?", one id per word
BOS, EOS, START, END, VIDEO = 1, 2, 60, 61, 62
SIZE = 16  # pixels per side of a frame


def load_config():
    import transformers

    return transformers.Qwen2VLConfig(**json.loads(CONFIG.read_text()))


def tokens_per_frame(config) -> int:
    v = config.vision_config
    return (SIZE // v.patch_size // v.spatial_merge_size) ** 2


def seq_len(config, frames: int) -> int:
    """Tokens of one row: BOS, vision start, the video, vision end, the question, the answer, EOS."""
    return 3 + frames * tokens_per_frame(config) + len(QUESTION) + 2


def patch_rows(frames: torch.Tensor, config) -> torch.Tensor:
    """(T, C, H, W) frames, each shown for one temporal patch, as the patch rows Qwen2-VL's tower reads: rows in
    (time, merge-block row, merge-block column, row in block, column in block) order, each row the pixels of one
    patch over the temporal patch's raw frames, (channel, time, y, x)."""
    v = config.vision_config
    p, m, tp = v.patch_size, v.spatial_merge_size, v.temporal_patch_size
    t, c, h, w = frames.shape
    raw = frames[:, None].expand(t, tp, c, h, w)  # a frame stays for the temporal patch
    x = raw.reshape(t, tp, c, h // (p * m), m, p, w // (p * m), m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * (h // p) * (w // p), c * tp * p * p).contiguous()


def make_example(rng: random.Random, config, frames: int) -> tuple[dict, int]:
    """One row: a video of `frames` frames (one of them coloured) and its question. Returns (row, answer id)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    colour = rng.choice(list(COLOURS))
    marked = rng.randrange(frames)
    grey = 0.2 * (torch.rand(frames, generator=g) - 0.5) # every frame a grey of its own brightness but one, coloured
    pixels = grey[:, None, None, None].expand(frames, 3, SIZE, SIZE).clone()
    pixels[marked] = torch.tensor(COLOURS[colour])[:, None, None]
    pixels += 0.05 * torch.randn(pixels.shape, generator=g)
    answer = COLOUR_IDS[colour]
    video = [VIDEO] * (frames * tokens_per_frame(config))
    ids = torch.tensor([BOS, START, *video, END, *QUESTION, answer, EOS])
    labels = torch.full_like(ids, -100)
    labels[-2:] = ids[-2:]
    grid = torch.tensor([[frames, SIZE // config.vision_config.patch_size, SIZE // config.vision_config.patch_size]])
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": 2 * (ids == VIDEO).int(),  # 2: a video token
            "pixel_values_videos": patch_rows(pixels, config),
            "video_grid_thw": grid}, answer


class Videos(torch.utils.data.Dataset):
    """n generated rows; row i is the same for every rank and every epoch (seeded by `seed` and i)."""

    def __init__(self, n: int, frames: int, seed: int, config):
        self.n, self.frames, self.seed, self.config = n, frames, seed, config

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return make_example(random.Random(self.seed * 1_000_003 + i), self.config, self.frames)[0]


def collate(rows: list[dict]) -> dict:
    """Rows of one length stacked; their videos' patch rows and grids concatenated, as Qwen2-VL's processor does."""
    out = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "mm_token_type_ids")}
    out["pixel_values_videos"] = torch.cat([r["pixel_values_videos"] for r in rows])
    out["video_grid_thw"] = torch.cat([r["video_grid_thw"] for r in rows])
    return out


@torch.no_grad()
def answer_accuracy(model, frames: int, n: int, seed: int, device) -> float:
    """Share of held-out videos whose answer is the colour word the model ranks first after the question (the
    greedy first token), the logits gathered over the CP group."""
    import hfcp

    config = load_config()
    rng, correct = random.Random(20_000 + seed), 0
    model.eval()
    for _ in range(n):
        row, answer = make_example(rng, config, frames)
        batch = {k: v[None].to(device) if k in ("input_ids", "labels", "mm_token_type_ids") else v.to(device)
                 for k, v in row.items()}
        batch.pop("labels")
        logits = hfcp.gather_sequence(model(**batch).logits, model)
        correct += int(logits[0, -3].argmax()) == answer
    model.train()
    return correct / max(n, 1)
