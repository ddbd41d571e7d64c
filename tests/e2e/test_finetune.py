"""End-to-end: scripts/finetune_lora.py under accelerate launch (2 CPU processes) vs one process."""
import json
import math
import sys
from pathlib import Path

import pytest
from launches import LAUNCH, finish, in_one_process, script_error, scripts_results, start_together

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "finetune_lora.py")
COMMON = ["--seq-len", "256", "--max-steps", "4", "--save-every", "2", "--lora-r", "4", "--eval-docs", "1",
          "--grad-accum", "2"]

VIDEO = ["--task", "video", "--frames", "8", "--batch-size", "2", "--max-steps", "3", "--lora-r", "4",
         "--eval-docs", "2"]
DPO = ["--task", "dpo", "--seq-len", "256", "--batch-size", "2", "--max-steps", "3", "--lora-r", "4",
       "--eval-docs", "4", "--beta", "0.2", "--rpo-alpha", "0.5"]  # RPO: DPO's sigmoid loss + 0.5 x the chosen NLL
GRPO = ["--task", "grpo", "--sft-steps", "3", "--max-steps", "2", "--batch-size", "8", "--num-generations", "4",
        "--lora-r", "4", "--eval-docs", "4", "--lr", "5e-3"]


def _losses(out_dir):
    return [json.loads(line)["loss"] for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def run_the_jobs(d: Path) -> dict:
    """{name: CompletedProcess} of the job's runs, outputs under `d`: the LoRA job in one process and at cp 2, the
    video and dpo tasks likewise, and test_full_finetune.py's --full-finetune runs (one process and FSDP2 at cp 2, in
    d / "full"), all at the same time (the single-process runs one after the other in one process, the cp 2 runs
    of DDP and of the full fine-tune in one launch); once the first cp 2 run has ended, a cp 2 run resumed from its
    checkpoint. Started once for both files (conftest.py's job_runs)."""
    from test_full_finetune import COMMON as FULL

    # cp 2 from an accelerate config file that sets FSDP2 and a ParallelismConfig (cp_size 2): accelerate alone would
    # refuse it on CPU (its ParallelismConfig needs FSDP2, which it enables only on accelerators); HfcpTrainer takes
    # the cp dimension and hands accelerate none
    config = str(ROOT / "scripts" / "configs" / "accelerate_fsdp2_cp2.yaml")
    singles = {"single": [SCRIPT, *COMMON, "--output-dir", str(d / "single")],
               "video_single": [SCRIPT, *VIDEO, "--output-dir", str(d / "video_single")],
               "dpo_single": [SCRIPT, *DPO, "--output-dir", str(d / "dpo_single")],
               "full_single": [SCRIPT, *FULL, "--output-dir", str(d / "full" / "single")]}
    launched = {"video_cp2": [SCRIPT, *VIDEO, "--output-dir", str(d / "video_cp2")],
                "dpo_cp2": [SCRIPT, *DPO, "--output-dir", str(d / "dpo_cp2")],
                "full_fsdp": [SCRIPT, *FULL, "--output-dir", str(d / "full" / "fsdp_cp2")]}
    started = start_together({
        "singles": [sys.executable, *in_one_process(singles, d, "singles")],
        "cp2": [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port",
                "0", SCRIPT, *COMMON, "--output-dir", str(d / "cp2")],
        "launched": [*LAUNCH, *in_one_process(launched, d, "launched")],
    }, d)
    done = {"cp2": finish(started.pop("cp2"))}
    resumed = start_together({"resumed": [*LAUNCH, SCRIPT, *COMMON, "--output-dir", str(d / "resumed"),
                                          "--resume-from", str(d / "cp2" / "checkpoint-2")]}, d)["resumed"] \
        if done["cp2"].returncode == 0 else None
    done |= scripts_results(singles, d, finish(started["singles"]))
    done |= scripts_results(launched, d, finish(started["launched"]))
    if resumed is not None:
        done["resumed"] = finish(resumed, timeout=300)
    return done


@pytest.fixture(scope="module")
def runs(job_runs):
    """The LoRA job in one process and at cp 2, the video and dpo tasks likewise, and a cp 2 run resumed from the first
    one's checkpoint (run_the_jobs)."""
    d, done = job_runs
    for name in ("single", "cp2", "video_single", "video_cp2", "dpo_single", "dpo_cp2"):
        assert done[name].returncode == 0, (name, done[name].stderr[-3000:])
    assert "dp=1 x cp=2" in done["cp2"].stdout, done["cp2"].stdout[-2000:]
    assert done["resumed"].returncode == 0, done["resumed"].stderr[-3000:]
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
    assert rec["cp_imbalance"] >= 1.0, rec  # under CP only
    assert "cp_imbalance" not in json.loads((runs / "single" / "metrics.jsonl").read_text().splitlines()[0])
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


BAD_INPUTS = {
    "model": (["--model", "/nonexistent/ckpt"], {}, "--model /nonexistent/ckpt: no checkpoint directory"),
    "data": (["--data", "{empty}"], {}, "found no text"),
    "seq_len": (["--seq-len", "100000"], {}, "--seq-len 100000 exceeds the model's max_position_embeddings=8192"),
    "cp_size": (["--cp-size", "3"], {"WORLD_SIZE": "2"}, "--cp-size 3 must divide the number of processes (2)"),
    "video_seq_len": (["--task", "video", "--seq-len", "512"], {},
                      "--seq-len: the video task runs the embedded tiny VLM"),
    "video_frames": (["--task", "video", "--frames", "0"], {}, "--frames 0 must be positive"),
    "dpo_data": (["--task", "dpo", "--data", "{empty}"], {}, "--data: the dpo task trains the embedded tiny Llama"),
    "dpo_model": (["--task", "dpo", "--model", "/nonexistent/ckpt"], {}, "--model: the dpo task trains"),
    "dpo_full": (["--task", "dpo", "--full-finetune"], {}, "--full-finetune: the dpo task trains"),
    "dpo_beta": (["--task", "dpo", "--beta", "0"], {}, "--beta 0.0 must be positive and --rpo-alpha 1.0 at least 0"),
    "dpo_option_elsewhere": (["--rpo-alpha", "1"], {}, "--rpo-alpha: options of --task dpo (the task is text)"),
    "dpo_seq_len": (["--task", "dpo", "--seq-len", "64"], {}, "--seq-len 64 must be at least 128 (a key document"),
    "text_seq_len": (["--seq-len", "64"], {}, "--seq-len 64 must be at least 72 (a row that holds one of the embedded"),
    "pp_seq_len": (["--pp", "2", "--seq-len", "64"], {}, "--seq-len 64 must be at least 72"),
    "grpo_dpo_option": (["--task", "grpo", "--beta", "0.1"], {}, "--beta: options of --task dpo (the task is grpo)"),
    "grpo_option_elsewhere": (["--task", "dpo", "--sft-steps", "5"], {},
                              "--sft-steps: options of --task grpo (the task is dpo)"),
    "grpo_model": (["--task", "grpo", "--model", "/nonexistent/ckpt"], {},
                   "--model: the grpo task warms up and trains"),
    "grpo_resume": (["--task", "grpo", "--resume-from", "/nonexistent"], {}, "--resume-from: the grpo task warms up"),
    "grpo_groups": (["--task", "grpo", "--batch-size", "10"], {},
                    "--batch-size 10 must be a multiple of --num-generations 4"),
    "grpo_one_generation": (["--task", "grpo", "--num-generations", "1"], {},
                            "--num-generations 1 must be at least 2 (GRPO's advantages compare"),
    "grpo_no_warm_up": (["--task", "grpo", "--sft-steps", "0"], {}, "--sft-steps 0 must be positive (the random model"),
    "grpo_seq_len": (["--task", "grpo", "--seq-len", "100"], {}, "--seq-len 100 must be at least 128"),
    "pp_task": (["--task", "dpo", "--pp", "2"], {}, "--task: --pp runs the text task's LoRA fine-tune in one go"),
    "pp_resume": (["--pp", "2", "--save-every", "2"], {}, "--save-every: --pp runs the text task's LoRA fine-tune"),
    "pp_world": (["--pp", "3"], {"WORLD_SIZE": "4"}, "--pp 3 x cp 1 must divide the number of processes (4)"),
    "pp_microbatches": (["--pp", "2", "--batch-size", "3", "--microbatches", "2"], {},
                        "the microbatches must divide --batch-size 3"),
    "microbatches_without_pp": (["--microbatches", "2"], {}, "--microbatches 2: an option of --pp"),
    "offload_without_checkpointing": (["--offload-checkpoints"], {}, "--offload-checkpoints holds the checkpoints of "
                                                                     "--gradient-checkpointing in host memory"),
    "tiled_mlp_negative": (["--tiled-mlp", "-1"], {}, "--tiled-mlp -1 must be a number of tokens per tile"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_one_line_error(case, tmp_path, monkeypatch):
    args, env, message = BAD_INPUTS[case]
    (tmp_path / "empty").mkdir()
    for name, value in {"WORLD_SIZE": "1", **env}.items():
        monkeypatch.setenv(name, value)
    argv = [a.replace("{empty}", str(tmp_path / "empty")) for a in args] + ["--output-dir", str(tmp_path / "out")]
    assert message in script_error("finetune_lora", argv, monkeypatch)


def test_video_task_cp2_losses_equal_single_process(runs):
    """--task video: a tiny Qwen2-VL on generated videos (the vision tower split over the CP group): the losses of
    2 processes (cp 2) are those of one process, and the summary reports the answer accuracy."""
    a, b = _losses(runs / "video_single"), _losses(runs / "video_cp2")
    assert len(a) == len(b) == 3 and a[0] > 1.0, (a, b)  # the first answers are guesses
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)
    summary = json.loads((runs / "video_cp2" / "summary.json").read_text())
    assert {"answer_accuracy_before", "answer_accuracy_after"} <= summary.keys()
    assert summary["adapter_identical_on_all_ranks"] is True


def test_dpo_task_cp2_losses_equal_single_process(runs):
    """--task dpo: HfcpDPOTrainer on preference pairs after key documents (the right key chosen, a wrong one
    rejected): the losses of 2 processes (cp 2) are those of one process, and so is the preference accuracy (each
    answer's log-probability summed over the CP group)."""
    a, b = _losses(runs / "dpo_single"), _losses(runs / "dpo_cp2")
    assert len(a) == len(b) == 3 and a[0] > math.log(2) and a[-1] < a[0], (a, b)  # RPO's NLL term; it falls
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)
    summaries = [json.loads((runs / r / "summary.json").read_text()) for r in ("dpo_single", "dpo_cp2")]
    for key in ("preference_accuracy_before", "preference_accuracy_after"):
        assert summaries[0][key] == summaries[1][key], summaries
    assert summaries[1]["adapter_identical_on_all_ranks"] is True
    rec = json.loads((runs / "dpo_cp2" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"step", "loss", "tokens_per_s", "peak_mem_mb", "lr"} <= rec.keys() and rec["step"] == 3, rec
    assert (runs / "dpo_cp2" / "loss_curve.png").stat().st_size > 1000
    assert (runs / "dpo_cp2" / "adapter" / "adapter_model.safetensors").is_file()


def test_dpo_tokenizer_gives_the_byte_tokenizer_ids(monkeypatch):
    """--task dpo hands DPOTrainer a transformers tokenizer: its ids are the embedded byte tokenizer's (BOS first,
    every byte, the EOS token as text), so the pairs are the key documents the model reads in the text task."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import dpo_task
    from finetune_data import ByteTokenizer

    tok, text = dpo_task.byte_tokenizer(), "key ABC. the river \n\t é ü \x01\x7f so the key is ABC."
    assert tok(text)["input_ids"] == ByteTokenizer()(text)["input_ids"]
    assert tok(text + tok.eos_token)["input_ids"][-1] == ByteTokenizer.eos_token_id == tok.eos_token_id
    assert tok.pad_token_id == dpo_task.PAD and tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_grpo_task_cp2_equals_single_process(pool1, pool2, tmp_path):
    """--task grpo, run in the test pools' workers (no process start of its own): the supervised warm-up, then GRPO
    steps whose completions the policy samples under CP and key_reward scores. At cp 2 the warm-up's losses, each
    step's mean reward and loss, and the greedy scores before and after equal one process's."""
    import workers_finetune

    for pool, name in ((pool1, "single"), (pool2, "cp2")):
        pool.run(workers_finetune.finetune_main, [*GRPO, "--output-dir", str(tmp_path / name)])
    runs = [tmp_path / r for r in ("single", "cp2")]
    warm = [[json.loads(line)["loss"] for line in (r / "warmup_metrics.jsonl").read_text().splitlines()] for r in runs]
    steps = [[json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    assert len(warm[0]) == len(warm[1]) == 3 and warm[0][-1] < warm[0][0], warm
    for a, b in zip(*warm):
        assert abs(a - b) <= 1e-5 * abs(a), warm
    assert len(steps[0]) == len(steps[1]) == 2, steps
    for a, b in zip(*steps):  # the same completions drawn at cp 2: the same rewards
        assert a["reward"] == b["reward"] and abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), steps
    summaries = [json.loads((r / "summary.json").read_text()) for r in runs]
    assert summaries[0] == summaries[1], summaries
    assert {f"{k}_{when}" for k in ("reward", "exact_key_accuracy") for when in ("before_warmup", "before", "after")} \
        | {"adapter_identical_on_all_ranks"} == summaries[1].keys() and summaries[1]["adapter_identical_on_all_ranks"]
    assert (runs[1] / "loss_curve.png").stat().st_size > 1000
    assert (runs[1] / "adapter" / "adapter_model.safetensors").is_file()


def test_grpo_key_reward_counts_key_characters_in_place(monkeypatch):
    """The task's rule-based reward: the share of the key's characters the completion repeats in their places (one
    leading space allowed); a wrong character costs its own share only."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import grpo_task

    completions = [" ABCDEFGH.", "ABCDEFGH", " ABCDXFGH.", " XBCDEFGH", "", " ABC"]
    assert grpo_task.key_reward(completions, ["ABCDEFGH"] * 6) == [1.0, 1.0, 0.875, 0.875, 0.0, 0.375]


def test_embedded_corpus_is_a_curriculum_read_in_order(monkeypatch):
    """The text task's embedded rows: the first half of the steps' rows hold short key documents only (many keys a
    row), the rest long ones; --data rows are not a curriculum (read in a seeded shuffle)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import finetune_data
    import finetune_lora

    args = finetune_lora.parse_args(["--seq-len", "512", "--max-steps", "10", "--batch-size", "2"])
    rows = finetune_lora.training_rows(args, finetune_data.ByteTokenizer(), None, world=1)
    assert args.curriculum and len(rows) >= 20

    def documents(row):  # token counts of a packed row's documents but its last (a position 0 starts one)
        starts = (row[1] == 0).nonzero().flatten().tolist()
        return [b - a for a, b in zip(starts, starts[1:])] or [len(row[1])]

    short, long = [documents(r) for r in rows[:10]], [documents(r) for r in rows[10:20]]
    assert all(max(d) <= finetune_data.SHORT[1] + 12 and len(d) >= 5 for d in short), short  # (a word over)
    assert max(max(d) for d in long) > 2 * finetune_data.SHORT[1], long
    args = finetune_lora.parse_args(["--seq-len", "512"])
    finetune_lora.training_rows(args, finetune_data.ByteTokenizer(), ["a text"] * 3, world=1)
    assert not args.curriculum
