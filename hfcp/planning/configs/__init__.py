"""Configs of well-known public checkpoints, shipped so that a plan needs no download (the fields of each
checkpoint's config.json that set its shapes; transformers fills in the rest), and how a plan reads a config."""
from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def shipped() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.json"))


def load_config(config):
    """(a transformers config, its name) from a config object, a config.json path, a model directory or a shipped
    name (case does not matter)."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return config, getattr(config, "name_or_path", "") or config.model_type
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config={config!r}: pass a transformers config, a config.json path, a model directory or "
                        f"one of {shipped()}")
    names = {name.lower(): name for name in shipped()}
    key = str(config).split("/")[-1].lower()
    if not os.path.exists(config) and key in names:
        loaded = transformers.AutoConfig.from_pretrained(str(HERE / f"{names[key]}.json"))
        loaded._name_or_path = names[key]  # (what a plan calls it)
        return loaded, names[key]
    if not os.path.exists(config):
        raise FileNotFoundError(f"config={str(config)!r} is neither a file, a directory nor a shipped config "
                                f"({', '.join(shipped())})")
    return transformers.AutoConfig.from_pretrained(str(config)), str(config)
