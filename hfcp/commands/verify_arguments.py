"""`hfcp verify`'s arguments checked in the caller, before any process starts (`check_arguments`): each bad one is a
`VerifyError` of one line, exit status 2 as argparse's, or 1 where the model cannot be built."""
from __future__ import annotations

import difflib
from pathlib import Path

import torch

from .verify_inputs import AUDIO_TYPES, HEADS, VLM_TYPES, auto_class, checkpoint_head, is_checkpoint, load_model


class VerifyError(Exception):
    """`hfcp verify` gave no verdict. `exit_status`: 2 for bad arguments (found before any process starts), 1 where
    no tiny random model of the type could be built or a worker raised (the message is then "Type: message")."""

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def position_limit(model) -> tuple[int, str] | None:
    """The longest sequence `model`'s learned position table holds, and the table's name; None without one (rotary,
    ALiBi, no positions: any length runs). A table: an embedding other than the input embeddings with
    max_position_embeddings rows (up to 2 more: OPT's offset). Works on a model on the meta device. (Fixed tables held
    in buffers are not looked for: XGLM's grows with the sequence, CTRL's does not; the worker then says so.)"""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    try:
        inputs = model.get_input_embeddings()
    except NotImplementedError:
        inputs = None
    tables = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Embedding) and m is not inputs and limit <= m.num_embeddings <= limit + 2]
    return (limit, tables[0]) if tables else None


def check_arguments(model: str, seq_len: int, data: str | None = None, head: str | None = None) -> None:
    """Check in the calling process what needs no worker: `model` is a checkpoint directory (config.json of a causal
    LM, or of a classifier whose class is of `head` when given) or a model_type (whose tiny random model is built
    here: its causal LM, or with `head` its class of that head, one whose head hfcp runs), `data` goes with a
    checkpoint and gives tokens, and `seq_len` fits the model's position table where it has one.

    Raises:
        VerifyError: exit_status 2 for bad arguments; 1 where hfcp.testing.tiny builds no tiny random model of the type.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    multimodal = model in AUDIO_TYPES() or model in VLM_TYPES()
    if not is_checkpoint(model) and multimodal and head is None:  # a tiny random VLM (images) or audio model (clips)
        _check_tiny_multimodal(model, seq_len, data)
        return
    if is_checkpoint(model):
        built = _check_checkpoint(model, seq_len, data, head)
        what = f"the checkpoint {model}"
    elif head is not None:
        built = _check_tiny_head(model, head, data)
        what = f"the tiny random {model} ({head}) of hfcp.testing.tiny"
    elif model in CAUSAL_LM:
        built = _check_tiny_model(model, data)
        what = f"the tiny random {model} of hfcp.testing.tiny"
    else:
        raise _unknown_model(model)
    table = position_limit(built) if built is not None else None
    if table is not None and seq_len > table[0]:
        raise VerifyError(f"--seq-len {seq_len} is more than the {table[0]} positions of {what} (its position table "
                          f"{table[1]}, max_position_embeddings={table[0]}): pass --seq-len {table[0]} or less", 2)


def _check_tiny_multimodal(model: str, seq_len: int, data: str | None) -> None:
    if data is not None:
        raise VerifyError(f"--data {data} needs a checkpoint directory (its tokenizer): the tiny random {model} "
                          "has no tokenizer; leave out --data", 2)
    audio = model in AUDIO_TYPES()
    try:
        built = load_model(model)
        from .verify_inputs import make_batch

        make_batch(built, seq_len, None)
    except Exception as e:
        builder, inputs = ("tiny_audio", "audio clips") if audio else ("tiny_vlm", "images")
        raise VerifyError(f"{one_line(e)} (hfcp.testing.{builder} builds no tiny random {model} with {inputs} of "
                          f"--seq-len {seq_len}: pass a longer --seq-len or a checkpoint directory)", 1) from e


def _check_checkpoint(model: str, seq_len: int, data: str | None, head: str | None = None):
    """The checkpoint's config and data checked; its modules on the meta device when seq_len passes the positions
    its config names (to look for a position table), else None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    try:
        config = transformers.AutoConfig.from_pretrained(model)
    except Exception as e:
        raise VerifyError(f"--model {model}: its config.json does not load ({one_line(e)})", 2) from e
    if config.model_type not in CAUSAL_LM and config.model_type not in VLM_TYPES() + AUDIO_TYPES():
        raise VerifyError(f"--model {model}: its config.json has model_type {config.model_type!r}, which has "
                          f"no causal-LM, image-text-to-text or audio-language class in transformers "
                          f"{transformers.__version__} (AutoModelForCausalLM, AutoModelForImageTextToText, "
                          "AutoModelForMultimodalLM): pass such a checkpoint", 2)
    if head is not None and checkpoint_head(config) != head:
        raise VerifyError(f"--head {head} with the checkpoint {model}, whose config.json names "
                          f"{config.architectures}, not a *{HEADS[head][0]} class: leave out --head (a checkpoint is "
                          f"verified as its own class) or pass a checkpoint of such a class", 2)
    if data is not None:
        _check_data(model, data, config.get_text_config().vocab_size)
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int) or seq_len <= limit:
        return None  # within the positions the config names, or none named: nothing to look for
    try:
        with torch.device("meta"):  # the model's modules, no weights: whether it has a position table
            return auto_class(config.model_type, config).from_config(config)
    except Exception:
        return None  # the workers will say what fails, one line


def _check_data(model: str, data: str, vocab: int) -> None:
    import transformers

    if not Path(data).is_file():
        raise VerifyError(f"--data {data}: no such file", 2)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(model)
        ids = tok(Path(data).read_text(encoding="utf-8"))["input_ids"]
    except Exception as e:
        why = f"not tokenized with {model}'s tokenizer ({one_line(e)})"
        raise VerifyError(f"--data {data}: {why}: save the checkpoint's tokenizer into it (save_pretrained), "
                          f"or leave out --data", 2) from e
    if not ids or max(ids) >= vocab:  # no tokenizer saved: transformers makes an empty one of the family
        got = "no tokens" if not ids else f"id {max(ids)}, beyond the model's vocab_size {vocab}"
        raise VerifyError(f"--data {data}: {model}'s tokenizer ({type(tok).__name__}, {len(tok)} entries) "
                          f"gives {got}: pass a text file with text, and save the checkpoint's own tokenizer "
                          f"into {model} (save_pretrained)", 2)


def _check_tiny_model(model: str, data: str | None, head: str | None = None):
    if data is not None:
        from ..testing.tiny import TINY

        raise VerifyError(f"--data {data} needs a checkpoint directory (its tokenizer): the tiny random {model} "
                          f"has a random vocabulary of {TINY['vocab_size']} ids and no tokenizer; leave out --data "
                          f"(seeded random ids) or pass a checkpoint directory", 2)
    try:
        return load_model(model, head=head)
    except Exception as e:
        raise VerifyError(f"{one_line(e)} (hfcp.testing.tiny builds no tiny random model of {model}: verify a "
                          f"checkpoint directory of it instead)", 1) from e


def _check_tiny_head(model: str, head: str, data: str | None):
    """A model_type with --head: transformers has a class of that head for it, of a language model, and hfcp runs
    that class's head (its pooling and loss: hfcp.families.heads.classification_head_name); the tiny model, built."""
    import transformers

    from ..families.registry import UnsupportedModelError
    from ..families.heads import classification_head_name
    from ..testing.tiny import HEAD_MAPPINGS, head_classes

    classes = head_classes(head)
    if model not in classes:
        from transformers import CONFIG_MAPPING

        where = ("" if model in CONFIG_MAPPING else "a directory without config.json, and " if Path(model).is_dir()
                 else "a file, not a directory, and " if Path(model).exists() else "no such directory, and ")
        close = difflib.get_close_matches(model, classes, n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise VerifyError(f"--model {model} --head {head}: {where}transformers {transformers.__version__} has "
                          f"no {head} class of model_type {model!r}{hint}: pass one of the {len(classes)} types of "
                          f"{HEAD_MAPPINGS[head]}, or leave out --head", 2)
    if model in VLM_TYPES():
        raise VerifyError(f"--model {model} --head {head}: {model} is a vision-language model, and hfcp runs "
                          f"classification heads of language models only: pass a language model's type, or leave "
                          f"out --head (verified with images)", 2)
    built = _check_tiny_model(model, data, head)
    try:
        classification_head_name(built, HEADS[head][1])
    except UnsupportedModelError as e:
        raise VerifyError(f"--model {model} --head {head}: hfcp does not run this head of {model} "
                          f"({' '.join(str(e).split())}): leave out --head (its causal LM), or pass a family whose "
                          f"{head} class uses transformers' generic head (as llama's does)", 2) from e
    return built


def _unknown_model(model: str) -> VerifyError:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    where = ("a directory without config.json" if Path(model).is_dir()
             else "a file, not a directory" if Path(model).exists() else "no such directory")
    close = difflib.get_close_matches(model, CAUSAL_LM, n=3)
    hint = f" (close: {', '.join(close)})" if close else ""
    return VerifyError(f"--model {model}: {where}, and not a causal-LM, image-text-to-text or audio-language "
                       f"model_type of transformers {transformers.__version__}{hint}: pass a checkpoint directory "
                       f"(with config.json, as save_pretrained writes) or one of the {len(CAUSAL_LM)} types of "
                       f"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, the {len(VLM_TYPES())} of "
                       f"MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or the {len(AUDIO_TYPES())} audio-language ones "
                       "of MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", 2)
