"""`hfcp verify`: the console command a user runs before trusting a family (it starts its own processes)."""
import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _verify(*args):
    cmd = [sys.executable, "-m", "hfcp.cli", "verify", *args, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_verify_a_checkpoint_directory_with_its_text(tmp_path):
    from workers_model import tiny_model

    tiny_model("mistral").save_pretrained(tmp_path / "ckpt")  # a sliding window of 7 over 80 tokens
    rc, report, err = _verify("--model", str(tmp_path / "ckpt"), "--seq-len", "80", "--cp-size", "2",
                              "--strategy", "allgather")
    assert rc == 0 and report["verdict"] == "exact", (report, err[-2000:])
    assert report["loss_err"] < 1e-5 and report["grad_err"] < 1e-4 and len(report["peak_mem_mb"]) == 2


def test_verify_a_model_type_that_hfcp_refuses_exits_nonzero():
    rc, report, _ = _verify("--model", "jamba", "--seq-len", "32", "--cp-size", "2")
    assert rc == 1 and report["verdict"] == "refused" and "jamba" in report["reason"], report


def test_verify_bad_arguments_exit_with_usage():
    r = subprocess.run([sys.executable, "-m", "hfcp.cli", "verify", "--model", "llama", "--cp-size", "1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--cp-size 1 at least 2" in r.stderr, r.stderr
