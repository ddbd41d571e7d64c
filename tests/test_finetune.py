"""End-to-end: scripts/finetune_lora.py under accelerate launch (2 CPU processes) vs one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "scripts" / "finetune_lora.py")
COMMON = ["--seq-len", "256", "--max-steps", "4", "--save-every", "2", "--lora-r", "4", "--eval-docs", "1",
          "--grad-accum", "2"]


def _run(cmd, **env):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    return r


def _losses(out_dir):
    return [json.loads(line)["loss"] for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ft")
    single = _run([sys.executable, SCRIPT, *COMMON, "--output-dir", str(d / "single")])
    assert single.returncode == 0, single.stderr[-3000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    # cp 2 from an accelerate config file that sets FSDP2 and a ParallelismConfig (cp_size 2): accelerate alone would
    # refuse it on CPU (its ParallelismConfig needs FSDP2, which it enables only on accelerators); HfcpTrainer takes
    # the cp dimension and hands accelerate none
    config = str(ROOT / "scripts" / "configs" / "accelerate_fsdp2_cp2.yaml")
    cp = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, SCRIPT, *COMMON,
               "--output-dir", str(d / "cp2")])
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "dp=1 x cp=2" in cp.stdout, cp.stdout[-2000:]
    resumed = _run([*launch, SCRIPT, *COMMON, "--output-dir", str(d / "resumed"),
                    "--resume-from", str(d / "cp2" / "checkpoint-2")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return d


def test_cp2_losses_equal_single_process(runs):
    single, cp2 = _losses(runs / "single"), _losses(runs / "cp2")
    assert len(single) == len(cp2) == 4
    for a, b in zip(single, cp2):
        assert abs(a - b) <= 1e-5 * abs(a), (single, cp2)
    assert cp2[-1] < cp2[0], "loss did not fall"
    # the key accuracy is generated after each held-out document (hfcp's generation under cp 2): the same tokens
    summaries = [json.loads((runs / r / "summary.json").read_text()) for r in ("single", "cp2")]
    assert [s["key_accuracy_after"] for s in summaries][0] == summaries[1]["key_accuracy_after"], summaries


def test_metrics_fields(runs):
    rec = json.loads((runs / "cp2" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"step", "loss", "tokens_per_s", "peak_mem_mb"} <= rec.keys() and rec["step"] == 1
    assert (runs / "cp2" / "loss_curve.png").stat().st_size > 1000


def test_resume_reproduces_uninterrupted_losses(runs):
    resumed = json.loads("[" + ",".join((runs / "resumed" / "metrics.jsonl").read_text().splitlines()) + "]")
    assert [r["step"] for r in resumed] == [3, 4]  # nothing repeated, nothing lost
    full = _losses(runs / "cp2")
    for r, want in zip(resumed, full[2:]):
        assert abs(r["loss"] - want) <= 1e-5 * abs(want), (resumed, full)


def test_adapter_identical_on_every_rank(runs):
    summary = json.loads((runs / "cp2" / "summary.json").read_text())
    assert summary["adapter_identical_on_all_ranks"] is True


def test_saved_adapter_loads_with_peft(runs):
    import torch
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    cfg = transformers.LlamaConfig(**json.loads((ROOT / "scripts" / "configs" / "tiny_llama.json").read_text()))
    torch.manual_seed(0)
    model = PeftModel.from_pretrained(transformers.LlamaForCausalLM(cfg), str(runs / "cp2" / "adapter"))
    saved = load_file(str(runs / "cp2" / "adapter" / "adapter_model.safetensors"))
    lora_b = [v for k, v in saved.items() if "lora_B" in k]
    assert lora_b and any(float(v.abs().max()) > 0 for v in lora_b), "adapter was not trained"
    assert any("lora_A" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("args, env, message", [
    (["--model", "/nonexistent/ckpt"], {}, "--model /nonexistent/ckpt: no checkpoint directory"),
    (["--data", "{empty}"], {}, "found no text"),
    (["--seq-len", "100000"], {}, "--seq-len 100000 exceeds the model's max_position_embeddings=8192"),
    (["--cp-size", "3"], {"WORLD_SIZE": "2"}, "--cp-size 3 must divide the number of processes (2)"),
    (["--task", "video", "--seq-len", "512"], {}, "--seq-len: the video task runs the embedded tiny VLM"),
    (["--task", "video", "--frames", "0"], {}, "--frames 0 must be positive"),
])
def test_bad_input_one_line_error(tmp_path, args, env, message):
    args = [a.replace("{empty}", str(tmp_path)) for a in args]
    r = _run([sys.executable, SCRIPT, *args, "--output-dir", str(tmp_path / "out")], **env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert message in last and "Traceback" not in r.stderr, r.stderr[-2000:]


VIDEO = ["--task", "video", "--frames", "8", "--batch-size", "2", "--max-steps", "3", "--lora-r", "4",
         "--eval-docs", "2"]


def test_video_task_cp2_losses_equal_single_process(tmp_path):
    """--task video: a tiny Qwen2-VL on generated videos (the vision tower split over the CP group): the losses of
    2 processes (cp 2) are those of one process, and the summary reports the answer accuracy."""
    single = _run([sys.executable, SCRIPT, *VIDEO, "--output-dir", str(tmp_path / "single")])
    assert single.returncode == 0, single.stderr[-3000:]
    cp = _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", SCRIPT, *VIDEO,
               "--output-dir", str(tmp_path / "cp2")])
    assert cp.returncode == 0, cp.stderr[-3000:]
    a, b = _losses(tmp_path / "single"), _losses(tmp_path / "cp2")
    assert len(a) == len(b) == 3 and a[0] > 1.0, (a, b)  # the first answers are guesses
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)
    summary = json.loads((tmp_path / "cp2" / "summary.json").read_text())
    assert {"answer_accuracy_before", "answer_accuracy_after"} <= summary.keys()
    assert summary["adapter_identical_on_all_ranks"] is True
