"""Every script in scripts/ runs as the docs document it (tiny settings). finetune_lora.py: test_finetune.py;
bench/bench.py (and bench/step.py, which it launches): test_bench.py; smollm2_checkpoint.py: test_real_model.py."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launches import LAUNCH, ROOT, in_one_process, run_together, scripts_results

BENCH_VLM = ["scripts/bench/vlm.py", "--repeats", "1", "--width", "64", "--layers", "1"]
VLM_AT_CP2 = ["scripts/bench/vlm.py", "--one", "--both", "--cp", "2", "--repeats", "1", "--width", "64",
              "--layers", "1"]

# the scripts run under one accelerate launch (2 processes), one after the other in its processes
LAUNCHED = {
    "example_two": lambda tmp: ["scripts/examples/example_cp.py", "--seq-len", "128", "--steps", "2"],
    "video_long": lambda tmp: ["scripts/examples/video_long.py", "--frames", "16", "--image-size", "32"],
    "generate_long": lambda tmp: ["scripts/examples/generate_long.py", "--prompt-tokens", "600", "--max-new-tokens",
                                  "6", "--check", "--json", str(tmp / "summary.json")],
    "bench_packed": lambda tmp: ["scripts/bench/packed.py", "--length", "1024", "--workloads", "long-tail", "--rounds",
                                 "1", "--out", str(tmp / "packed.json")],
    "reach_phases": lambda tmp: ["scripts/bench/reach.py", "--arm", "hfcp_tiled", "--seq-len", "1024", "--phases",
                                 "--census"],
    "reach_saved": lambda tmp: ["scripts/bench/reach.py", "--arm", "hfcp_tiled", "--seq-len", "1024", "--saved"],
    # bench/vlm.py's measurement at cp 2 (what its --one-launch starts under torchrun): the split tower, then the whole
    "vlm_video": lambda tmp: [*VLM_AT_CP2, "--video", "8", "--images", "48"],
    "vlm_audio": lambda tmp: [*VLM_AT_CP2, "--audio", "3", "--images", "48"],
}
# the scripts run in one plain process, one after the other (one start, its imports, serves them all)
SINGLE = {
    "example_one": lambda tmp: ["scripts/examples/example_cp.py", "--seq-len", "128", "--steps", "2"],
    "vlm_images": lambda tmp: [*BENCH_VLM, "--images", "4", "--cps", "1"],
    "bench_generate": lambda tmp: ["scripts/bench/generate.py", "--lengths", "200", "--cps", "1", "--new-tokens", "3",
                                   "--width", "64", "--layers", "1", "--json", str(tmp / "rows.json")],
    "reach_time": lambda tmp: ["scripts/bench/reach_time.py", "--seq-len", "1024", "--rounds", "2"],
    "bench_dpo": lambda tmp: ["scripts/bench/dpo.py", "--lengths", "128", "--layers", "1", "--vocab", "512",
                              "--side-by-side", "--json", str(tmp / "bench_dpo.json")],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (CompletedProcess, the runs' temporary directory)} of SINGLE and LAUNCHED, their two processes started
    at the same time."""
    tmp = tmp_path_factory.mktemp("scripts")
    single, launched = ({n: cmd(tmp) for n, cmd in scripts.items()} for scripts in (SINGLE, LAUNCHED))
    done = run_together({"single": [sys.executable, *in_one_process(single, tmp, "single")],
                         "launched": [*LAUNCH, *in_one_process(launched, tmp, "launched")]}, tmp)
    done = scripts_results(single, tmp, done["single"]) | scripts_results(launched, tmp, done["launched"])
    return {name: (r, tmp) for name, r in done.items()}


def scripts() -> list[Path]:
    return sorted(p for p in (ROOT / "scripts").rglob("*") if p.suffix in (".py", ".sh"))


def test_every_script_is_listed_in_the_scripts_reference():
    page = (ROOT / "docs" / "reference" / "scripts.md").read_text()
    for script in scripts():
        name = script.relative_to(ROOT).as_posix()
        assert f"`{name}`" in page, f"docs/reference/scripts.md does not list {name}"


def test_scripts_are_sorted_by_kind_and_stand_alone():
    """The job and its modes at scripts/ (at most 10 Python files), the rest in examples/, bench/ and tools/; no script
    edits sys.path or imports the tests (what they share with the tests is in hfcp.testing)."""
    assert len(list((ROOT / "scripts").glob("*.py"))) <= 10
    assert {p.name for p in (ROOT / "scripts").iterdir() if p.is_dir()} <= {"bench", "examples", "tools", "configs"}
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}
    for script in scripts():
        text = script.read_text()
        assert "sys.path" not in text, f"{script.relative_to(ROOT)} edits sys.path"
        imported = set(re.findall(r"^\s*(?:from|import) (\w+)", text, flags=re.M))
        assert not imported & tests, f"{script.relative_to(ROOT)} imports the tests' {sorted(imported & tests)}"


def test_example_cp_under_accelerate_equals_one_process(runs):
    (one, _), (two, _) = runs["example_one"], runs["example_two"]
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    losses = [re.findall(r"step (\d): loss ([\d.]+)\s+local tokens (\d+) of 128", r.stdout) for r in (one, two)]
    assert len(losses[0]) == len(losses[1]) == 2, (one.stdout, two.stdout)
    assert [x[1] for x in losses[0]] == [x[1] for x in losses[1]], losses  # same loss to 5 decimals
    assert losses[0][0][2] == "128" and losses[1][0][2] == "64", losses


def test_video_long_runs_and_matches_the_unpatched_loss(runs):
    r, _ = runs["video_long"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loss" in r.stdout and "peak" in r.stdout, r.stdout


def test_generate_long_streams_the_tokens_of_one_process(runs):
    # cp 2 under accelerate: the prompt spread over both processes, the tokens streamed and those of the unpatched
    # model (--check), the time to first token, the decode speed and half the KV cache per rank reported
    r, tmp_path = runs["generate_long"]
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["same_as_unpatched"] and summary["new_tokens"] == 6 and summary["processes"] == 2, summary
    assert " ".join(map(str, summary["tokens"])) in r.stdout and "first token after" in r.stdout, r.stdout
    assert summary["time_to_first_token_s"] > 0 and summary["decode_tokens_per_s"] > 0, summary


def test_bench_generate_prints_a_row_per_run(runs):
    r, tmp_path = runs["bench_generate"]
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows) == 1 and rows[0]["prompt_tokens"] == 200 and len(rows[0]["tokens"]) == 3, rows
    assert "| 200 | 1 |" in r.stdout


def test_bench_packed_times_both_layouts_with_the_same_loss(runs):
    """cp 2: the balanced layout taken on a packed row, its counted work max / mean below zigzag's, both timed."""
    r, tmp_path = runs["bench_packed"]
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads((tmp_path / "packed.json").read_text())
    assert row["layout"] == "balanced" and row["cp"] == 2, row
    assert row["work_imbalance"]["auto"] <= 1.05 < row["work_imbalance"]["row"], row
    assert abs(row["loss"]["auto"] - row["loss"]["row"]) <= 1e-5 * row["loss"]["row"], row
    assert all(t > 0 for t in row["time_s"].values()) and "| 1024 tokens, long-tail |" in r.stdout, r.stdout


def test_gpu_check_is_valid_bash_and_refuses_without_a_gpu():
    script = str(ROOT / "scripts" / "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    r = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "",
                            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode != 0 and "no CUDA GPU here" in r.stderr, r.stderr[-2000:]


def _bench_vlm_rows(r):
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    return [row[2].strip() for row in rows], [float(row[8]) for row in rows], r.stdout


def test_bench_vlm_images_run_in_one_process(runs):
    """The images path of the script (one plain process: the tower's split is the video test's and test_vlm's)."""
    towers, losses, out = _bench_vlm_rows(runs["vlm_images"][0])
    assert towers == ["one process"] and "4 images" in out and losses[0] > 0, out


def _vlm_results(r) -> list[dict]:
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]


def test_bench_vlm_video_lora_step_keeps_the_loss(runs):
    """--video at cp 2: the tower's frames split over the ranks, then the whole tower on every rank; the same loss."""
    split, whole = _vlm_results(runs["vlm_video"][0])
    assert (split["cp"], split["split"], whole["split"]) == (2, True, False), (split, whole)
    assert abs(split["loss"] - whole["loss"]) <= 1e-5 * split["loss"], (split, whole)


def test_bench_vlm_audio_lora_step_keeps_the_loss(runs):
    """--audio at cp 2: the encoder's clips split over the ranks, then whole on every rank; the same loss."""
    split, whole = _vlm_results(runs["vlm_audio"][0])
    assert (split["cp"], split["split"], whole["split"]) == (2, True, False), (split, whole)
    assert abs(split["loss"] - whole["loss"]) <= 1e-5 * split["loss"], (split, whole)


def test_bench_dpo_measures_three_runs_of_the_same_loss(runs):
    """Stock DPOTrainer, DPOTrainer with hfcp's fused head, HfcpDPOTrainer at cp 2: the same DPO loss (the reference
    model differs from the policy), a memory figure per run and the table of the docs."""
    r, tmp = runs["bench_dpo"]
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp / "bench_dpo.json").read_text())
    assert [(x["cp"], x["head"]) for x in rows] == [(1, "trl"), (1, "hfcp"), (2, "hfcp")], rows
    assert all(x["peak_mem_mb"] > 0 for x in rows) and abs(rows[0]["loss"] - 0.693147) > 1e-4, rows
    assert max(x["loss"] for x in rows) - min(x["loss"] for x in rows) <= 2e-5 * rows[0]["loss"], rows
    assert "| 128 | cp 2 (HfcpDPOTrainer) |" in r.stdout, r.stdout


def test_bench_reach_phases_names_each_part_of_the_step(runs):
    """--phases: rank 0's peak per part of the step, one line each, the highest marked."""
    r, _ = runs["reach_phases"]
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.rstrip().endswith(("MB", "<- peak"))]
    parts = {tuple(line.split()[:3]) for line in lines}
    assert ("forward", "final", "norm") in parts and ("backward", "layer", "0") in parts, r.stdout
    assert sum("<- peak" in line for line in lines) == 1, r.stdout


def test_bench_reach_census_accounts_for_the_peak(runs):
    """--census (in the same run as --phases): the peak, and what is alive there by allocating operator, adding up to
    it; the layers' checkpointed inputs among them."""
    r, _ = runs["reach_phases"]
    assert r.returncode == 0, r.stderr[-3000:]
    peak = re.search(r"CENSUS peak ([\d.]+) hidden vectors per local token \(([\d.]+) MB\), allocating in \S", r.stdout)
    rows = [(float(m[0]), m[1]) for m in re.findall(r"CENSUS\s+([\d.]+) x\d+\s+(.+)", r.stdout)]
    assert peak and len(rows) >= 3, r.stdout
    assert abs(sum(v for v, _ in rows) - float(peak[1])) <= 0.01 * len(rows) + 0.01, r.stdout
    assert any(op.startswith("aten::add") for _, op in rows), r.stdout  # (the residual stream: each layer's output)


def test_bench_reach_saved_counts_what_each_layer_keeps(runs):
    """--saved: with tiled_mlp each decoder layer keeps its input, q, k, v, attention's output and the residual after
    attention (4.5 hidden vectors a token, and LoRA's and the softmax's small ones), not its norms' outputs (7)."""
    r, _ = runs["reach_saved"]
    assert r.returncode == 0, r.stderr[-3000:]
    kept = {m[0]: float(m[1]) for m in re.findall(r"SAVED (layer \d+)\s+([\d.]+) hidden vectors", r.stdout)}
    assert len(kept) == 8 and all(4.4 < v < 5.0 for k, v in kept.items() if k != "layer 0"), r.stdout


def test_bench_reach_time_alternates_the_arms_in_one_run(runs):
    """bench/reach_time.py: each arm's step times from one run, its mean against the first arm's, the same loss (at 1024
    tokens: 512 a rank, two tiles of hidden_size)."""
    r, _ = runs["reach_time"]
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"\| (hfcp\w*) \| ([\d., ]+) \| ([\d.]+) \| ([\d.]+)x \| ([\d.]+) \|", r.stdout)
    assert [row[0] for row in rows] == ["hfcp", "hfcp_tiled"], r.stdout
    assert all(len(row[1].split(", ")) == 2 for row in rows) and rows[0][3] == "1.000", r.stdout
    mean = [float(row[2]) for row in rows]
    assert abs(float(rows[1][3]) - mean[1] / mean[0]) < 0.01 + 0.01 * mean[1] / mean[0], r.stdout
    assert abs(float(rows[0][4]) - float(rows[1][4])) < 1e-5, r.stdout  # (the same model and batch: tiles or not)


def test_bench_reach_phases_refused_for_alst(monkeypatch):
    from launches import script_error

    assert "--phases and --saved need --arm hfcp, hfcp_tiled or hfcp_tiled_offload (got --arm alst)" in script_error(
        "bench/reach", ["--arm", "alst", "--seq-len", "512", "--phases"], monkeypatch)


def test_bench_reach_moe_refuses_the_alst_arm(monkeypatch):
    from launches import script_error

    assert "--model moe runs the hfcp arms only (DeepSpeed's TiledMLP is for dense MLPs)" in script_error(
        "bench/reach", ["--model", "moe"], monkeypatch)
