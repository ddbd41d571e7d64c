"""Tiny random audio-language models of transformers' multimodal-LM types that take audio, and batches for them
built by hand: what the audio sweep (hfcp/testing/sweeps/audio.py) runs. Text and audio configs are shrunk, placeholder
token ids put inside the tiny vocabulary, and the number of placeholder tokens of a clip is read from the features
the model returns for it (its own encoder and projector), so nothing per family is written here."""
from __future__ import annotations

import copy
import inspect
import warnings

import torch

from ..families.introspect import audio_config
from .tiny_vlm import VISION, build_perturbed, fit_text_config

AUDIO, AUDIO_START, AUDIO_END, VISION_START, IMAGE, VIDEO = 90, 91, 92, 93, 94, 95
TOKEN_IDS = {"audio_token_id": AUDIO, "audio_token_index": AUDIO, "audio_start_token_id": AUDIO_START,
             "audio_bos_token_id": AUDIO_START, "audio_end_token_id": AUDIO_END, "audio_eos_token_id": AUDIO_END}
# the audio encoder's sizes, under the names the encoders' configs use (only the fields a config has are set)
ENCODER = dict(num_mel_bins=8, encoder_layers=1, num_hidden_layers=1, encoder_attention_heads=2,
               num_attention_heads=2, num_key_value_heads=2, encoder_ffn_dim=32, intermediate_size=32, d_model=16,
               hidden_size=16, head_dim=8, max_source_positions=16, output_dim=32, downsample_hidden_size=8,
               n_window=8, input_dim=8, num_blocks=1, dim_head=8, hidden_dim=16, num_layers=1, num_heads=2,
               encoder_hidden_size=16, vocab_size=96,
               attention_dropout=0.0, dropout=0.0, activation_dropout=0.0, layerdrop=0.0, encoder_layerdrop=0.0)
FRAMES = 32  # mel frames per clip: 2 x max_source_positions for Whisper-style encoders


def audio_classes(model_type: str) -> str:
    """The class of `model_type` that trains on audio and text (transformers' multimodal-LM mapping)."""
    from transformers.models.auto import modeling_auto

    return modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[model_type]


def tiny_audio(model_type: str, seed: int = 0):
    """A tiny random audio-language model of `model_type` in train mode, weights perturbed away from their init."""
    import transformers

    from .tiny import tiny_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type)
        audio = audio_config(cfg)
        if audio is None:
            raise ValueError("no audio_config")
        for part in (audio, getattr(cfg, "adaptor_config", None), getattr(cfg, "projector_config", None)):
            for k, v in ENCODER.items() if part is not None else ():
                if hasattr(part, k) and getattr(getattr(type(part), k, None), "fset", True) is not None:
                    setattr(part, k, v)  # (a property without a setter keeps its own value)
        for part in (audio, getattr(cfg, "adaptor_config", None), getattr(cfg, "projector_config", None)):
            for k, v in list(vars(part).items()) if part is not None else ():  # training noise off (a rank
                if isinstance(v, float) and any(x in k for x in ("dropout", "drop_prob", "layerdrop")):  # draws
                    setattr(part, k, 0.0)  # other noise than one device), as tiny_config does for the text
        adaptor = getattr(cfg, "adaptor_config", None)
        if adaptor is not None and hasattr(adaptor, "hidden_size"):  # it maps the encoder's output to the text width
            adaptor.hidden_size = cfg.get_text_config().hidden_size
        vision = getattr(cfg, "vision_config", None)  # an omni model's vision tower, as the VLM sweep shrinks it
        for k, v in VISION.items() if vision is not None else ():
            if hasattr(vision, k):
                setattr(vision, k, copy.copy(v))
        for k, v in TOKEN_IDS.items():
            if hasattr(cfg, k):
                setattr(cfg, k, v)
        fit_text_config(cfg.get_text_config())
        if vision is not None:  # an omni thinker's rope index reads it (a checkpoint's thinker config carries it)
            cfg.vision_start_token_id = VISION_START
            for k, v in (("image_token_id", IMAGE), ("video_token_id", VIDEO)):  # in the tiny vocabulary
                if hasattr(cfg, k):
                    setattr(cfg, k, v)
        return build_perturbed(getattr(transformers, audio_classes(model_type)), cfg, seed)


def audio_types() -> list[str]:
    """The multimodal-LM types with an audio encoder, an omni model replaced by its thinker."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    found = []
    for t in sorted(modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cfg = CONFIG_MAPPING[t]()
            except Exception:  # noqa: BLE001 - a config that needs arguments: not an audio type here
                continue
        if getattr(cfg, "thinker_config", None) is not None:
            continue  # the thinker (its own type, in this mapping too) is what trains
        if audio_config(cfg) is not None:
            found.append(t)
    return found


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _mask_name(model) -> str | None:
    return next((n for n in ("feature_attention_mask", "input_features_mask") if _accepts(model, n)), None)


def _clip_variants(model, clips: int, valid=None) -> list[dict]:
    """`clips` clips as forwards take them: (clips, mel bins, FRAMES) input_features, or (clips, FRAMES, feature
    dims); without a mask (every frame valid), then with the mask of each clip's valid frames where the forward
    takes one (valid: the valid frames of each clip, the rest masked at the end: only the forms with a mask)."""
    g = torch.Generator().manual_seed(4 + clips)
    audio = audio_config(model.config)
    mels = getattr(audio, "num_mel_bins", None) or getattr(audio, "input_dim", None) or audio.input_size
    mask = (torch.arange(FRAMES)[None] < torch.tensor(valid or [FRAMES] * clips)[:, None]).long()
    masks = {n: mask for n in ("feature_attention_mask", "input_features_mask", "padding_mask") if _accepts(model, n)}
    feats = torch.randn(clips, mels, FRAMES, generator=g)
    stacked = torch.randn(clips, FRAMES, mels * getattr(audio, "num_stacked_frames", 1), generator=g)  # (frames
    # stacked into one feature vector, as low-frame-rate features are)
    forms = [feats, feats.transpose(1, 2).contiguous(), stacked]
    bare = [{"input_features": f} for f in forms] if valid is None else []
    return bare + [{"input_features": f, **masks} for f in forms if masks]


def _clip_inputs(model, clips: int, valid=None) -> tuple[dict, list[int]]:
    """The first form of `clips` clips that the model's audio features accept, and each clip's token count."""
    errors = []
    for inputs in _clip_variants(model, clips, valid):
        try:
            return inputs, clip_tokens(model, inputs)
        except Exception as e:  # noqa: BLE001 - try the next form
            errors.append(f"{type(e).__name__}: {str(e)[:80]}")
    raise ValueError(f"no audio input built ({'; '.join(errors)})")


def clip_tokens(model, inputs: dict) -> list[int]:
    """How many placeholder tokens each clip's features fill, read from the model's own audio features."""
    inner = getattr(model, "model", model)
    get = getattr(inner, "get_audio_features", None) or getattr(model, "get_audio_features", None)
    if get is None:  # (Qwen2-Audio: tokens per clip from its encoder's own length rule, then the valid frames)
        lengths = getattr(getattr(inner, "audio_tower", None), "_get_feat_extract_output_lengths", None)
        name = _mask_name(model)
        if lengths is None or name not in inputs:
            raise ValueError(f"{type(model).__name__} has no get_audio_features")
        return [int(n) for n in lengths(inputs[name].sum(-1))[-1]]
    kwargs = {k: v for k, v in inputs.items() if k in inspect.signature(get).parameters}
    with torch.no_grad():
        feats = get(**kwargs, return_dict=True) if "return_dict" in inspect.signature(get).parameters else get(**kwargs)
    feats = getattr(feats, "pooler_output", feats)
    clips = inputs["input_features"].shape[0]
    if isinstance(feats, torch.Tensor) and feats.dim() == 3 and feats.shape[0] == clips:
        return [feats.shape[1]] * clips  # (every frame of every clip is valid)
    if isinstance(feats, torch.Tensor) and clips > 1:  # (total tokens, hidden): each clip's from it alone
        return [clip_tokens(model, {k: v[i:i + 1] for k, v in inputs.items()})[0] for i in range(clips)]
    if isinstance(feats, torch.Tensor):
        return [feats.reshape(-1, feats.shape[-1]).shape[0]]
    return [f.reshape(-1, f.shape[-1]).shape[0] for f in feats]


def text_batch(model, length: int = 48, rows: int = 2) -> dict:
    """Random text ids (below the placeholder ids) and labels."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 88, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def audio_batch(model, length: int = 48, valid=None) -> dict:
    """Two rows of text, one clip in row 0 early and two in row 1, the second across the middle (where the zigzag
    layout cuts); the rows grow to fit the clips' tokens, read from the model. valid: each clip's valid frames (of
    FRAMES), the rest masked at its end, as a processor pads clips of different lengths.

    Raises:
        ValueError: the model's audio features do not take such clips (or no frame mask where `valid` is given).
    """
    inputs, n = _clip_inputs(model, 3, valid)
    L = max(length, 2 * n[1] + n[2] + 12)
    out = text_batch(model, L)
    ids = out["input_ids"]
    starts = ((0, 4), (1, 4), (1, L // 2 - n[2] // 2))
    marks = [getattr(model.config, k, None) for k in ("audio_start_token_id", "audio_end_token_id")]
    for (row, at), count in zip(starts, n):
        ids[row, at:at + count] = AUDIO
        if marks[0] is not None:  # each clip between its start and end tokens, where the model has them
            ids[row, at - 1], ids[row, at + count] = (marks[0],
                                                      marks[1] if marks[1] is not None else ids[row, at + count])
    if (ids == AUDIO).sum() != sum(n):
        raise ValueError(f"clips of {n} tokens overlap in rows of {L}")
    out["labels"] = ids.masked_fill(ids == AUDIO, -100)
    out["labels"][:, :3] = -100
    return {**out, **inputs}


def omni_batch(model, length: int = 48) -> dict:
    """audio_batch with an image too in each row (an omni model: Qwen-VL patch rows and grids, each image after its
    vision start token): row 0's after its clip, row 1's between its two clips; the rows grow to fit.

    Raises:
        ValueError: the model takes no image_grid_thw images.
    """
    from .tiny_vlm import _pixels

    if not _accepts(model, "image_grid_thw"):
        raise ValueError(f"{model.config.model_type} takes no Qwen-VL images")
    pixels, rows = _pixels(model)
    out = audio_batch(model, length)
    clips = (out["input_ids"] == AUDIO).sum(1).tolist()  # (1 clip in row 0, 2 in row 1)
    extra = max(rows) + 4
    for k in ("input_ids", "labels", "attention_mask"):  # the image's room at the end of each row, then moved in
        out[k] = torch.cat([out[k], out[k][:, -extra:]], 1)
    ids = out["input_ids"]
    L = ids.shape[1]
    for row, (at, n) in enumerate(zip((L - extra + 1, 4 + clips[1] // 2 + 2), rows)):
        if row == 1:  # between the clips: the text after the first clip moves right by the image's tokens
            ids[row, at + n + 1:] = ids[row, at:L - n - 1].clone()
        ids[row, at - 1], ids[row, at:at + n] = VISION_START, IMAGE
    out["labels"] = ids.masked_fill((ids == AUDIO) | (ids == IMAGE), -100)
    out["labels"][:, :3] = -100
    if (ids == IMAGE).sum() != sum(rows) or (ids == AUDIO).sum() != sum(clips):
        raise ValueError(f"images of {rows} and clips of {clips} tokens overlap in rows of {L}")
    return {**out, **pixels}


def mixed_audio_batch(model, length: int = 48, side: str = "left") -> dict:
    """audio_batch with its first row's clip gone (a text-only row beside a row of two clips; the clip dropped from
    the inputs), and padding: side "left", the text-only row padded on the left; "right", the row of clips padded
    on the right (its last 6 tokens, after its clips)."""
    out = audio_batch(model, length)
    ids, first = out["input_ids"], out["input_ids"][0] == AUDIO
    n = int(first.sum())
    ids[0, first] = 5  # text where the clip was
    if side == "left":
        out["attention_mask"][0, :n] = 0  # left padding as long as the clip was
    else:
        out["attention_mask"][1, -6:] = 0
    out["labels"] = ids.masked_fill((ids == AUDIO) | (out["attention_mask"] == 0), -100)
    for k, v in list(out.items()):
        if k not in ("input_ids", "labels", "attention_mask"):
            out[k] = v[1:]  # clips are listed row by row: the first row's one is the first
    return out
