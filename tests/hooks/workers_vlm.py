"""Workers for vision-language models under CP (issue 18): tiny random VLMs with images built by hand, the whole
model patched (the merged sequence sharded at its language model's input) against the unpatched model."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.compare import grad_error

_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, image_size=16, patch_size=4)
IMAGE, VIDEO, START = 90, 91, 92  # token ids of the image / video placeholder and the vision start


TEXT_VARIANTS = {  # llava's text config: a family with knowledge of its own
    "dynamic_rope": dict(model_type="llama", max_position_embeddings=32,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
    "llama4_temperature": dict(model_type="llama4_text", no_rope_layers=[0, 1], floor_scale=4,
                               attn_temperature_tuning=True, intermediate_size_mlp=64, num_local_experts=2,
                               interleave_moe_layer_step=2, attention_chunk_size=None),
}


def tiny_vlm(kind: str, text: str | None = None):
    """A tiny random VLM in train mode, weights perturbed so that biases and norms matter; `text` names a variant
    of llava's text config (TEXT_VARIANTS)."""
    import transformers as T

    if kind == "llava":
        text_config = {**dict(model_type="llama", **_TEXT), **TEXT_VARIANTS.get(text, {})}
        cfg = T.LlavaConfig(vision_config=_SIGLIP, text_config=text_config, image_token_index=IMAGE,
                            vision_feature_select_strategy="full", vision_feature_layer=-1)
        cls = T.LlavaForConditionalGeneration
    elif kind == "llava_onevision":  # Qwen2 text; SigLIP, anyres of one 16 x 16 tile: base and tile features
        cfg = T.LlavaOnevisionConfig(vision_config=_SIGLIP, text_config=dict(model_type="qwen2", **_TEXT),
                                     image_token_index=IMAGE, video_token_index=VIDEO, image_grid_pinpoints=[[16, 16]],
                                     vision_feature_select_strategy="full", vision_feature_layer=-1)
        cls = T.LlavaOnevisionForConditionalGeneration
    elif kind == "internvl":  # InternViT (CLS dropped), pixel shuffle 0.5: 16 patches of a 16 x 16 tile -> 4 tokens
        cfg = T.InternVLConfig(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=[16, 16], patch_size=[4, 4]),
                               text_config=dict(model_type="qwen2", **_TEXT), image_token_id=IMAGE,
                               downsample_ratio=0.5)
        cls = T.InternVLForConditionalGeneration
    elif kind in ("idefics3", "smolvlm"):  # SigLIP-like tower, pixel shuffle (scale 2): 16 patches -> 4 tokens
        config_cls, cls = ((T.Idefics3Config, T.Idefics3ForConditionalGeneration) if kind == "idefics3"
                           else (T.SmolVLMConfig, T.SmolVLMForConditionalGeneration))
        cfg = config_cls(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=16, patch_size=4),
                         text_config=dict(model_type="llama", **_TEXT), image_token_id=IMAGE, scale_factor=2)
    elif kind == "gemma3":  # SigLIP, 4 x 4 patches pooled to 16 tokens; image blocks bidirectional, sliding layers
        text = dict(model_type="gemma3_text", **_TEXT, sliding_window=6, layer_types=["sliding_attention",
                                                                                     "full_attention"])
        cfg = T.Gemma3Config(vision_config=_SIGLIP, text_config=text, mm_tokens_per_image=16,
                             image_token_index=IMAGE, boi_token_index=START, eoi_token_index=93)
        cls = T.Gemma3ForConditionalGeneration
    elif kind == "paligemma":  # PaliGemma 2: a bidirectional prefix (image and prompt), Gemma 2's sliding layers
        text = dict(model_type="gemma2", **_TEXT, sliding_window=6, layer_types=["sliding_attention",
                                                                                "full_attention"])
        cfg = T.PaliGemmaConfig(vision_config=_SIGLIP, text_config=text, image_token_index=IMAGE, projection_dim=32)
        cls = T.PaliGemmaForConditionalGeneration
    elif kind == "qwen2_vl":
        text = dict(model_type="qwen2_vl_text", **_TEXT,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
        cfg = T.Qwen2VLConfig(vision_config=dict(depth=1, embed_dim=32, num_heads=2, hidden_size=32, patch_size=2,
                                                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
                              text_config=text, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START)
        cls = T.Qwen2VLForConditionalGeneration
    elif kind in ("qwen3_vl", "qwen3_vl_moe"):  # deepstack: features of vision layers 0 and 1 added to the first
        # text layers' tokens; the MoE variant's text layers route each token to 2 of 4 experts
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if kind == "qwen3_vl_moe" else {}
        text = dict(model_type=f"{kind}_text", **_TEXT, **moe,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                     "mrope_interleaved": True})
        cfg = (T.Qwen3VLMoeConfig if moe else T.Qwen3VLConfig)(
            vision_config=dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64,
                               num_heads=2, patch_size=2, spatial_merge_size=2,
                               temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                               deepstack_visual_indexes=[0, 1]),
            text_config=text, image_token_id=IMAGE, video_token_id=VIDEO,
            vision_start_token_id=START)
        cls = T.Qwen3VLMoeForConditionalGeneration if moe else T.Qwen3VLForConditionalGeneration
    elif kind == "qwen3_5":  # Qwen3-VL's tower without deepstack; text layers gated delta nets and attention
        # partial rotary as in Qwen3.5 (half of a 16 head dim rotates: 4 frequencies, the mRoPE sections' sum)
        text = dict(model_type="qwen3_5_text", **{**_TEXT, "head_dim": 16},
                    layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.5})
        cfg = T.Qwen3_5Config(vision_config=dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64,
                                                 num_heads=2, patch_size=2, spatial_merge_size=2,
                                                 temporal_patch_size=2, in_channels=3, num_position_embeddings=16),
                              text_config=text, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START)
        cls = T.Qwen3_5ForConditionalGeneration
    elif kind == "qwen2_5_vl":  # windowed vision attention (a 2 x 2 window of merged patches), one full-attention block
        text = dict(model_type="qwen2_5_vl_text", **_TEXT,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
        cfg = T.Qwen2_5_VLConfig(vision_config=dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64,
                                                    num_heads=2, patch_size=2, spatial_merge_size=2,
                                                    temporal_patch_size=2, window_size=4, fullatt_block_indexes=[1],
                                                    in_channels=3),
                                 text_config=text, image_token_id=IMAGE, video_token_id=VIDEO,
                                 vision_start_token_id=START)
        cls = T.Qwen2_5_VLForConditionalGeneration
    else:  # a kind without its own config here must not fall through to another model's
        raise ValueError(f"tiny_vlm has no config for kind {kind!r}")
    cfg._attn_implementation = "eager" if kind == "paligemma" else "sdpa"  # Gemma 2 has no sdpa path
    torch.manual_seed(0)
    model = cls(copy.deepcopy(cfg)).float().train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


SIXTEEN = ("llava", "gemma3", "paligemma")  # 16 image tokens per image (the others: 4)
FRAMES_APART = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")  # a timestamp token between a video's frames (the rope
# index splits them)


def vlm_batch(kind: str, case: str) -> dict:
    """Rows of 40 tokens. case: "one_image" (row 0 at 5, row 1 straddling the middle, where zigzag cuts), "two_images"
    (two per row), "left_padding" (one image, row 0 left-padded), "text_only" (no image), "video" (Qwen-VL: a video of
    4 frames, 2 temporal patches of 4 x 4, 8 merged tokens, per row, beside an image in row 0)."""
    g = torch.Generator().manual_seed(2)
    B, L = 2, 40
    ids = torch.randint(3, 88, (B, L), generator=g)
    per_image = 16 if kind in SIXTEEN else 4  # siglip 16x16 / 4: 16 patches; qwen2-vl 1x4x4 patches merged 2x2: 4
    if case == "video":
        return _video_batch(ids, frames_apart=kind in FRAMES_APART)
    if case == "one_video":
        return _one_video_batch(ids, frames_apart=kind in FRAMES_APART)
    two = [[2, 21], [4, 23]] if kind in SIXTEEN else [[3, 24], [10, 30]]
    starts = {"one_image": [[5], [18]], "two_images": two, "left_padding": [[12], [4]], "text_only": [[], []],
              "too_few_tokens": [[5], [18]], "other_image_on_rank_1": [[5], [18]], "three_images": [two[0], [18]]}[case]
    for row, at in enumerate(starts):
        for s in at:
            ids[row, s:s + per_image] = IMAGE
            if kind.startswith("qwen"):
                ids[row, s - 1] = START
    n = sum(len(a) for a in starts)
    if case == "too_few_tokens":  # one placeholder fewer than the image's features: the model's own check raises
        ids[0, 5] = 7
    out = {"input_ids": ids}
    if kind == "gemma3":  # image tokens attend bidirectionally within each image
        out["token_type_ids"] = (ids == IMAGE).long()
    if kind == "paligemma":  # the prefix (every image and the prompt after it) attends bidirectionally
        ends = [max(at) + per_image + 3 if at else 6 for at in starts]
        out["token_type_ids"] = (torch.arange(L)[None] >= torch.tensor(ends)[:, None]).long()
    labels = ids.masked_fill(ids == IMAGE, -100)
    if case == "left_padding":
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        labels[0, :7] = -100
        out["attention_mask"] = mask
    out["labels"] = labels
    if n:
        if kind in ("llava", "internvl", "gemma3", "paligemma"):
            out["pixel_values"] = torch.randn(n, 3, 16, 16, generator=g)
        elif kind in ("idefics3", "smolvlm"):  # (B, images per row, C, H, W)
            out["pixel_values"] = torch.randn(B, n // B, 3, 16, 16, generator=g)
        else:
            out["pixel_values"] = torch.randn(n * 16, 3 * 2 * 2 * 2, generator=g)
            out["image_grid_thw"] = torch.tensor([[1, 4, 4]] * n)
            out["mm_token_type_ids"] = (ids == IMAGE).int()
    elif kind.startswith("qwen"):
        out["mm_token_type_ids"] = torch.zeros_like(ids, dtype=torch.int)
    return out


def _video_batch(ids, frames_apart: bool = False) -> dict:
    """frames_apart: each temporal frame of a video its own span, a text token (Qwen3-VL's timestamp) between."""
    g = torch.Generator().manual_seed(3)
    ids[0, 4:8], ids[0, 3] = IMAGE, START
    for row, at in ((0, 20), (1, 9)):
        ids[row, at - 1] = START
        if frames_apart:
            ids[row, at:at + 4], ids[row, at + 5:at + 9], ids[row, at + 4] = VIDEO, VIDEO, 7
        else:
            ids[row, at:at + 8] = VIDEO
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    return {"input_ids": ids, "labels": ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100),
            "pixel_values": torch.randn(16, 24, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "pixel_values_videos": torch.randn(2 * 32, 24, generator=g),
            "video_grid_thw": torch.tensor([[2, 4, 4]] * 2), "mm_token_type_ids": types}


def _one_video_batch(ids, frames_apart: bool = False) -> dict:
    """One video of 4 temporal patches (8 frames) of 4 x 4, 16 merged tokens, in row 1 only: the tower splits its
    frames over the ranks."""
    g = torch.Generator().manual_seed(5)
    at = 10
    ids[1, at - 1] = START
    for frame in range(4):
        start = at + frame * (5 if frames_apart else 4)
        ids[1, start:start + 4] = VIDEO
        if frames_apart and frame < 3:
            ids[1, start + 4] = 7  # Qwen3-VL's timestamp token between frames
    return {"input_ids": ids, "labels": ids.masked_fill(ids == VIDEO, -100),
            "mm_token_type_ids": 2 * (ids == VIDEO).int(),
            "pixel_values_videos": torch.randn(4 * 16, 24, generator=g), "video_grid_thw": torch.tensor([[4, 4, 4]])}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(kind: str, case: str, strategy: str = "ring", loss_chunk="auto", text: str | None = None) -> dict:
    ref, model = tiny_vlm(kind, text), tiny_vlm(kind, text)
    batch = vlm_batch(kind, case)
    want = ref(**batch, use_cache=False).loss
    want.backward()
    hfcp.patch(model, strategy=strategy, loss_chunk=loss_chunk, timeout=30)
    seen = []  # images (Qwen-VL: patch rows) each call of the vision tower's embeddings saw on this rank
    tower = next((m for n, m in model.named_modules() if n in ("model.vision_tower", "model.vision_model",
                                                                "model.visual")), None)
    embeddings = next((m for n, m in tower.named_modules() if n.endswith("embeddings") or n == "patch_embed"),
                      None) if tower else None
    counter = embeddings.register_forward_pre_hook(
        lambda m, a, k: seen.append(int((a[0] if a else next(iter(k.values()))).shape[0])), with_kwargs=True) \
        if embeddings is not None else None
    try:
        got = model(**batch).loss
        got.backward()
        vision_attn = model.config.vision_config._attn_implementation
    finally:
        hfcp.unpatch(model)
        if counter is not None:
            counter.remove()
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    ref_grads = _grads(ref)
    vision = {n: g for n, g in grads.items() if "visual" in n or "vision" in n}
    return {"loss_err": abs(got.item() - want.item()) / want.item(), "grad_err": grad_error(grads, ref_grads),
            "vision_grad_err": grad_error(vision, {n: ref_grads[n] for n in vision}) if vision else None,
            "same_keys": grads.keys() == ref_grads.keys(), "vision_attn": vision_attn,
            "vision_attn_unpatched": ref.config.vision_config._attn_implementation, "loss": want.item(),
            "images_seen": seen, "images": _image_count(batch),
            "qwen_rows": (qwen_patch_rows(batch, dist.get_world_size(), dist.get_rank()) if kind.startswith("qwen")
                          else None)}


def _image_count(batch) -> int:
    pv = batch.get("pixel_values")
    return 0 if pv is None or pv.dim() < 4 else pv.shape[0] * (pv.shape[1] if pv.dim() == 5 else 1)


def qwen_patch_rows(batch, cp: int, rank: int) -> list[int]:
    """Patch rows the vision tower of a Qwen-VL should see on `rank` per call (images, then videos): each rank
    takes ceil(n / cp) of the n frames (a video of t temporal patches is t frames), a share past n padded with
    frame 0."""
    out = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = batch.get(key)
        if grid is None:
            continue
        sizes = [int(h * w) for t, h, w in grid.tolist() for _ in range(t)]
        k = -(-len(sizes) // cp)
        out.append(sum(sizes[i] if i < len(sizes) else sizes[0] for i in range(rank * k, (rank + 1) * k)))
    return out


def refused(kind: str, case: str, text: str | None = None) -> str:
    """The error every rank raises for a batch the model cannot take (no hang: check_inputs' collective ran)."""
    model = tiny_vlm(kind, text)
    hfcp.patch(model, timeout=30)
    try:
        batch = vlm_batch(kind, case)
        if case == "other_image_on_rank_1" and dist.get_rank() == 1:
            batch["pixel_values"] = batch["pixel_values"] + 1
        model(**batch).loss.backward()
        return "not refused"
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        hfcp.unpatch(model)


def language_model_called_alone(kind: str, after_failed_forward: bool = False) -> str:
    model = tiny_vlm(kind)
    hfcp.patch(model, timeout=30)
    if after_failed_forward:  # the outer forward raises before it reaches the language model
        try:
            model(**vlm_batch(kind, "too_few_tokens"))
        except ValueError:
            pass
    try:
        model.model.language_model(inputs_embeds=torch.randn(1, 8, 32))
        return "not refused"
    except RuntimeError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
