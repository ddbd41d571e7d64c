"""What `hfcp verify` builds from its arguments: the model (a checkpoint directory or a model_type's tiny random
model, causal LM, vision-language or audio-language model, or sequence or token classifier) and its batch (the user's
text, random ids, images, audio clips)."""
from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch


def is_checkpoint(model: str) -> bool:
    return Path(model, "config.json").is_file()


@functools.lru_cache(maxsize=1)
def VLM_TYPES():  # noqa: N802 - a constant of the installed transformers
    """The image-text-to-text model_types of transformers, verified as VLMs (with images): those that are not also
    causal-LM types, and those that are but whose config has a vision part (Gemma 3, Qwen3.5: a checkpoint of them
    is the VLM; verified as a text model, the tiny builder would shrink the text part only)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM

    def has_vision(model_type: str) -> bool:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return getattr(CONFIG_MAPPING[model_type](), "vision_config", None) is not None
        except Exception:  # noqa: BLE001 - a config without defaults: verified as a text model, as before
            return False

    return tuple(t for t in VLM if t not in CAUSAL_LM or has_vision(t))


@functools.lru_cache(maxsize=1)
def AUDIO_TYPES():  # noqa: N802 - a constant of the installed transformers
    """The multimodal-LM model_types with an audio encoder (an omni model's thinker in its place), verified with
    audio clips."""
    from ..testing.tiny_audio import audio_types

    return tuple(audio_types())


# --head -> (the end of its class names, hfcp's head kind)
HEADS = {"sequence-classification": ("ForSequenceClassification", "sequence_classification"),
         "token-classification": ("ForTokenClassification", "token_classification")}


def checkpoint_head(config) -> str | None:
    """The --head a checkpoint's config names (its `architectures`, as save_pretrained writes them: a reward model,
    a classifier), None for another class."""
    names = getattr(config, "architectures", None) or ()
    return next((head for head, (end, _) in HEADS.items() if any(n.endswith(end) for n in names)), None)


def model_head(model) -> str | None:
    """The --head of a built model, from its class: None for a causal LM or a vision-language model."""
    return next((head for head, (end, _) in HEADS.items() if type(model).__name__.endswith(end)), None)


def auto_class(model_type: str, config=None):
    """The auto class of a checkpoint's config (a sequence or token classifier when its architectures name one),
    else of the model_type: a vision-language model or a causal LM."""
    import transformers

    head = checkpoint_head(config) if config is not None else None
    if head == "sequence-classification":
        return transformers.AutoModelForSequenceClassification
    if head == "token-classification":
        return transformers.AutoModelForTokenClassification
    if model_type in AUDIO_TYPES():
        return transformers.AutoModelForMultimodalLM
    vlm = model_type in VLM_TYPES()
    return transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM


def load_model(model: str, dtype=torch.float32, head: str | None = None):
    """A checkpoint directory (its own class), or a model_type: a tiny random model of it, with `head` (a key of
    HEADS) the family's class of that head."""
    if is_checkpoint(model):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        cls = auto_class(config.model_type, config)
        return cls.from_pretrained(model, dtype=dtype, attn_implementation=reference_attention(cls, config)).train()
    if model in AUDIO_TYPES() and head is None:
        from ..testing.tiny_audio import tiny_audio

        return tiny_audio(model).to(dtype)
    if model in VLM_TYPES() and head is None:
        from ..testing.tiny_vlm import tiny_vlm

        return tiny_vlm(model).to(dtype)
    from ..testing.tiny import tiny_model

    return tiny_model(model, head=head).to(dtype)


def reference_attention(auto_cls, config) -> str:
    """The attention of the unpatched reference: "sdpa", or "eager" for a class that transformers builds without SDPA
    (Gemma 2's: asked for "sdpa", it raises; hfcp's attention replaces either once patched)."""
    cls = auto_cls._model_mapping.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def _is_vlm(model) -> bool:
    return model.config.model_type in VLM_TYPES() and model_head(model) is None


def _is_audio(model) -> bool:
    return model.config.model_type in AUDIO_TYPES() and model_head(model) is None


def sequence_labels(config) -> torch.Tensor:
    """(1, ...) labels of a sequence classifier's check, of its problem type (as transformers reads it: regression
    for one label, single-label classes otherwise, unless config.problem_type says)."""
    g = torch.Generator().manual_seed(0)
    n, problem = config.num_labels, config.problem_type
    if problem == "regression" or (problem is None and n == 1):
        return torch.randn(1, n, generator=g) if n > 1 else torch.randn(1, generator=g)
    if problem == "multi_label_classification":
        return torch.randint(0, 2, (1, n), generator=g).float()
    return torch.randint(0, n, (1,), generator=g)


def make_batch(model, seq_len: int, data: str | None) -> dict:
    """The inputs of the check: (1, seq_len) token ids (token_ids) as input_ids and labels (a sequence classifier's
    checkpoint or --head: labels of its problem type, sequence_labels; a token classifier's: a seeded class per token);
    for an audio-language model, two rows with three clips (hfcp.testing.tiny_audio.audio_batch); for a
    vision-language model, two rows with an image
    each, built by hand (hfcp.testing.tiny_vlm.image_batch; a checkpoint's ids then come from the tiny vocabulary of
    placeholders, so a text-only check of its text with --data stays the causal-LM one)."""
    if _is_audio(model) and data is None:
        from ..testing.tiny_audio import audio_batch

        return audio_batch(model, seq_len)
    if _is_vlm(model) and data is None:
        from ..testing.tiny_vlm import image_batch

        return image_batch(model, seq_len)
    ids = token_ids(model, seq_len, data)
    head = model_head(model)
    if head == "sequence-classification":  # a reward model / classifier: its score at the last token
        return {"input_ids": ids, "labels": sequence_labels(model.config)}
    if head == "token-classification":  # a class per token, seeded
        labels = torch.randint(0, model.config.num_labels, ids.shape, generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids}


def token_ids(model, seq_len: int, data: str | None) -> torch.Tensor:
    """(1, seq_len) ids: the start of `data` (a text file, tokenized with the checkpoint's tokenizer), repeated to
    length, or seeded random ids."""
    vocab = model.config.get_text_config().vocab_size
    if data is None:
        return torch.randint(3, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
    ids = tok(Path(data).read_text(encoding="utf-8"))["input_ids"]
    if not ids:
        raise ValueError(f"--data {data}: no tokens")
    return torch.tensor((ids * (seq_len // len(ids) + 1))[:seq_len])[None]
