"""A VLM or audio-LM training step under CP: per-rank peak memory and step time, the encoder's part (its forward)
reported separately, with the encoder's work split over the CP group (hfcp's default) and with every rank encoding
every image or clip (as peers do), against one process.

    python scripts/bench/vlm.py                          # cp 1, 2, 4; 48 images of 64 x 64 (3072 image tokens)
    python scripts/bench/vlm.py --images 96 --cps 1 2
    python scripts/bench/vlm.py --video 512              # a LoRA step on a video of 512 frames of 32 x 32 (4096 tokens)
    python scripts/bench/vlm.py --audio 48               # a LoRA step on 48 audio clips (3072 audio tokens)

Images: a tiny-width LLaVA (SigLIP tower, Llama text model, random weights), forward + backward of every parameter,
so that the vision tower is a large part of the step. --video: a Qwen2-VL of the same widths (its tower takes two
raw frames per temporal patch and merges 2 x 2 patches: 16 tokens per temporal patch), LoRA (r 16) on the language
model's projections, as in long-video fine-tuning; the tower is frozen, so its part is its forward. --audio: a
Qwen2-Audio of the same widths, LoRA on the attention of its encoder and language model (the encoder's activations
are held for backward). Each
measurement runs in its own processes (torchrun for cp > 1); --one-launch measures the split and the whole tower in
the same torchrun, one after the other (a quicker check of the script: the second's memory growth is then measured in
processes that already ran the first).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(args):
    return build_audio(args) if args.audio else build_video(args) if args.video else build_images(args)


def build_audio(args):
    """A Qwen2-Audio (Whisper-style encoder, each clip 256 mel frames -> 64 audio tokens) with LoRA (r 16) on the
    attention projections of the encoder and the language model; one row: per clip 8 text tokens and its tokens."""
    import torch
    import transformers as T
    from peft import LoraConfig, get_peft_model

    w = args.width
    audio = dict(d_model=w, encoder_layers=args.layers, encoder_attention_heads=4, encoder_ffn_dim=4 * w,
                 num_mel_bins=32, max_source_positions=128, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    text = dict(model_type="qwen2", vocab_size=512, hidden_size=w, intermediate_size=4 * w,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1 << 16)
    cfg = T.Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_id=500)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.Qwen2AudioForConditionalGeneration(cfg).train()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "out_proj"]))
    per_clip = 64  # (256 frames -> 128 after the encoder's stride-2 convolution -> 64 after its pooling)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 400, (1, args.audio * (per_clip + 8)), generator=g)
    for i in range(args.audio):
        start = i * (per_clip + 8) + 8
        ids[0, start:start + per_clip] = 500
    return model, {"input_ids": ids, "labels": ids.masked_fill(ids == 500, -100),
                   "input_features": torch.randn(args.audio, 32, 256, generator=g),
                   "feature_attention_mask": torch.ones(args.audio, 256, dtype=torch.long)}


def build_video(args):
    """A Qwen2-VL with LoRA on its language model, one row: 8 text tokens, the video, 64 text tokens (the targets)."""
    import torch
    import transformers as T
    from peft import LoraConfig, get_peft_model

    heads = 4
    text = dict(model_type="qwen2_vl_text", vocab_size=512, hidden_size=args.width, intermediate_size=4 * args.width,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
                max_position_embeddings=1 << 16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": _mrope(args.width // heads)})
    vision = dict(depth=args.layers, embed_dim=args.width, num_heads=heads, hidden_size=args.width, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = T.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=501, video_token_id=500,
                          vision_start_token_id=502, vision_end_token_id=503)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.Qwen2VLForConditionalGeneration(cfg).train()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"))
    steps, side = args.video // 2, 32 // 4  # temporal patches, patches per side
    video = steps * (side // 2) ** 2
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 400, (1, 8 + 2 + video + 64), generator=g)
    ids[0, 8], ids[0, 9:9 + video], ids[0, 9 + video] = 502, 500, 503
    labels = torch.full_like(ids, -100)
    labels[0, -64:] = ids[0, -64:]
    return model, {"input_ids": ids, "labels": labels, "mm_token_type_ids": 2 * (ids == 500).int(),
                   "pixel_values_videos": torch.randn(steps * side * side, 3 * 2 * 4 * 4, generator=g),
                   "video_grid_thw": torch.tensor([[steps, side, side]])}


def _mrope(head_dim: int) -> list[int]:
    """Qwen2-VL's 3-D rope sections (time, height, width) over head_dim / 2 frequencies, in its 16:24:24 ratio."""
    half = head_dim // 2
    t = half // 4
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def tower(model):
    """The encoder module (LLaVA's vision_tower, Qwen2-VL's visual, Qwen2-Audio's audio_tower), under a PEFT
    wrapper or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (getattr(inner.model, "vision_tower", None) or getattr(inner.model, "audio_tower", None)
            or inner.model.visual)


def build_images(args):
    import torch
    import transformers as T

    vision = dict(model_type="siglip_vision_model", hidden_size=args.width, intermediate_size=4 * args.width,
                  num_hidden_layers=args.layers, num_attention_heads=4, image_size=64, patch_size=8)
    text = dict(model_type="llama", vocab_size=512, hidden_size=args.width, intermediate_size=4 * args.width,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1 << 16)
    cfg = T.LlavaConfig(vision_config=vision, text_config=text, image_token_index=500,
                        vision_feature_select_strategy="full", vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.LlavaForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(1)
    per_image = 64
    ids = torch.randint(3, 400, (1, args.images * (per_image + 8)), generator=g)
    for i in range(args.images):  # 8 text tokens, then the image's 64 placeholders
        start = i * (per_image + 8) + 8
        ids[0, start:start + per_image] = 500
    labels = ids.masked_fill(ids == 500, -100)
    return model, {"input_ids": ids, "labels": labels,
                   "pixel_values": torch.randn(args.images, 3, 64, 64, generator=g)}


def measure(args) -> None:
    """One configuration, in this process (and its torchrun peers): prints RESULT {json} on rank 0; with --both, the
    split tower's and then the whole tower's, one after the other."""
    import torch
    import torch.distributed as dist

    from hfcp.testing.memory import fix_mmap_threshold

    fix_mmap_threshold()
    torch.set_num_threads(1)
    if args.cp > 1 and not dist.is_initialized():  # (a launcher's harness running several scripts may have made it)
        dist.init_process_group("gloo")
    for split in ([True, False] if args.both else [args.split]):
        result = measure_one(args, split)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)


def measure_one(args, split: bool) -> dict | None:
    """The step's figures with the tower split over the ranks or not (the worst rank's; None on ranks other than 0)."""
    import torch
    import torch.distributed as dist
    from hfcp.testing.memory import PeakRSS

    import hfcp
    from hfcp.families.registry import REGISTRY

    model, batch = build(args)
    if args.cp > 1:
        if not split:  # every rank encodes every image or clip, as peers do
            import dataclasses

            kind = "qwen2_audio" if args.audio else "qwen2_vl" if args.video else "llava"
            REGISTRY._patchers[kind] = dataclasses.replace(REGISTRY.get(kind), vision_tower="", audio_tower="")
        hfcp.patch(model)
    vision = VisionPart(tower(model))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.item()

    loss = step()  # warm-up
    times, mems, vision_times, vision_mems = [], [], [], []
    for _ in range(args.repeats):
        with PeakRSS(torch.device("cpu")) as mem:
            t = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t)
        mems.append(mem.growth / 2**20)
        vision_times.append(vision.time_s)
        vision_mems.append(vision.mem_mb)
    result = {"cp": args.cp, "split": bool(split and args.cp > 1), "images": args.images, "frames": args.video,
              "clips": args.audio,
              "tokens": batch["input_ids"].shape[1], "time_s": sorted(times)[len(times) // 2],
              "vision_s": sorted(vision_times)[len(times) // 2], "peak_mem_mb": max(mems),
              "vision_mem_mb": max(vision_mems), "loss": loss}
    if args.cp > 1:
        for key in ("peak_mem_mb", "vision_mem_mb", "vision_s"):
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, result[key])
            result[key] = max(every)  # the worst rank
        if dist.get_rank() != 0:
            return None
    return result


class VisionPart:
    """The vision tower's forward in each step, timed and its peak memory growth sampled, by module hooks (with the
    tower split, the gather of its outputs over the CP group is part of it)."""

    def __init__(self, module):
        from hfcp.testing.memory import PeakRSS
        import torch

        self.time_s, self.mem_mb, self._mem, self._t = 0.0, 0.0, None, 0.0

        def start(*_):
            self._mem = PeakRSS(torch.device("cpu")).__enter__()
            self._t = time.perf_counter()

        def stop(*_):
            self.time_s = time.perf_counter() - self._t
            self._mem.__exit__(None, None, None)
            self.mem_mb = self._mem.growth / 2**20

        module.register_forward_pre_hook(start)
        module.register_forward_hook(stop)


def run(args, cp: int, split: bool | None) -> list[dict]:
    """The results of one launch: of the split tower or the whole one, or (split None) of both, split first."""
    own = [str(HERE / "vlm.py"), "--one", "--cp", str(cp), "--images", str(args.images), "--width",
           str(args.width), "--layers", str(args.layers), "--repeats", str(args.repeats), "--video", str(args.video),
           "--audio", str(args.audio)] + (
        ["--split"] if split else []) + (["--both"] if split is None else [])
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"] + own
           if cp > 1 else [sys.executable] + own)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if len(lines) < (2 if split is None else 1):
        print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
    return [json.loads(line[len("RESULT "):]) for line in lines]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--video", type=int, default=0, help="frames of one video (Qwen2-VL, LoRA) instead of images")
    ap.add_argument("--audio", type=int, default=0,
                    help="clips of a Qwen2-Audio (LoRA on the encoder and the language model) instead of images")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one-launch", action="store_true",
                    help="at each cp > 1, the split and the whole tower in one torchrun (a quicker check)")
    ap.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--both", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.video % 2 or args.video < 0:
        raise SystemExit(f"bench/vlm.py: --video {args.video}: give an even number of frames (two per temporal patch)")
    if args.one:
        return measure(args)
    rows = []
    for cp in args.cps:
        launches = [False] if cp == 1 else [None] if args.one_launch else [True, False]
        for split in launches:
            for r in run(args, cp, split):
                rows.append(r)
                print(json.dumps(r), flush=True)
    base = next((r for r in rows if r["cp"] == 1), None)
    what = (f"{args.audio} audio clips" if args.audio else f"a video of {args.video} frames" if args.video
            else f"{args.images} images")
    print(f"\n{what}, {rows[0]['tokens'] if rows else '?'} tokens\n")
    print("| cp | encoder | step (s) | encoder part (s) | peak memory per rank (MB) | x one process "
          "| encoder part's peak (MB) | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        where = "one process" if r["cp"] == 1 else ("split over the ranks" if r["split"] else "whole on every rank")
        ratio = f"{r['peak_mem_mb'] / base['peak_mem_mb']:.2f}" if base else "-"
        print(f"| {r['cp']} | {where} | {r['time_s']:.2f} | {r['vision_s']:.2f} | {r['peak_mem_mb']:.0f} | {ratio} "
              f"| {r['vision_mem_mb']:.0f} | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
