"""scripts/finetune_lora.py --full-finetune: every parameter trains, FSDP2 over 2 processes (accelerate launch) and
the sequence over the CP group, against one process: the same losses and the same trained model."""
import json

import pytest
import torch
from safetensors.torch import load_file

from launches import script_error
from test_finetune import ROOT, _losses

COMMON = ["--full-finetune", "--seq-len", "256", "--max-steps", "4", "--eval-docs", "1", "--grad-accum", "2",
          "--lr", "2e-3"]


@pytest.fixture(scope="module")
def runs(job_runs):
    """The job with --full-finetune in one process and under accelerate launch (2 processes), started with
    test_finetune.py's runs (test_finetune.run_the_jobs)."""
    d, done = job_runs
    single, fsdp = done["full_single"], done["full_fsdp"]
    assert single.returncode == 0, single.stderr[-3000:]
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "dp=1 x cp=2, parameters sharded over 2 (FSDP2)" in fsdp.stdout, fsdp.stdout[-2000:]
    return d / "full"


def test_losses_equal_single_process(runs):
    single, fsdp = _losses(runs / "single"), _losses(runs / "fsdp_cp2")
    assert len(single) == len(fsdp) == 4
    for a, b in zip(single, fsdp):
        assert abs(a - b) <= 1e-5 * abs(a), (single, fsdp)
    assert fsdp[-1] < fsdp[0], "loss did not fall"


def test_every_parameter_trained_and_the_saved_models_agree(runs):
    from transformers import LlamaConfig, LlamaForCausalLM

    single = load_file(runs / "single" / "model" / "model.safetensors")
    fsdp = load_file(runs / "fsdp_cp2" / "model" / "model.safetensors")
    assert single.keys() == fsdp.keys()
    torch.manual_seed(0)  # the job's initial weights (seed 0)
    init = LlamaForCausalLM(LlamaConfig(**json.loads((ROOT / "scripts" / "configs" / "tiny_llama.json").read_text())))
    for name, start in init.state_dict().items():
        if name not in single:
            continue
        assert not torch.equal(single[name], start), f"{name} did not train"
        err = float((single[name] - fsdp[name]).abs().max()) / float((single[name] - start).abs().max())
        assert err < 1e-3, (name, err)  # relative to the update: Adam's first steps amplify float noise a little


def test_state_per_rank_halves_over_two_ranks(runs):
    one = json.loads((runs / "single" / "summary.json").read_text())["state_mb_per_rank"]
    two = json.loads((runs / "fsdp_cp2" / "summary.json").read_text())["state_mb_per_rank"]
    assert abs(two - one / 2) <= 0.02 * one, (one, two)


def test_full_finetune_refuses_lora_checkpoint_options(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    message = script_error("finetune_lora", ["--full-finetune", "--save-every", "2", "--output-dir", str(tmp_path)],
                           monkeypatch)
    assert "--full-finetune saves the trained model once" in message
