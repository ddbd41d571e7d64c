"""`hfcp verify`: the console command a user runs before trusting a family (it starts its own processes)."""
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # (the hfcp command in processes of its own: out of the quick loop)
ROOT = Path(__file__).resolve().parents[2]


def _verify(*args, report: bool = True):
    """(exit status, the JSON report, what was printed to stderr) of `hfcp verify ... --json`, through the console
    command's function in this process (its workers are processes of their own either way); report=False: no
    report is expected (a one-line error), None in its place."""
    from hfcp.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["verify", *args, "--json"])
    return rc, json.loads(out.getvalue().strip().splitlines()[-1]) if report else None, err.getvalue()


def _rank_reports(pool, model: str, seq_len: int, strategy: str = "ring", data=None, head=None) -> dict:
    """What `hfcp verify` reports, computed by its workers' function (verify.run_rank) on the test's pool of two
    ranks (as a dict, as --json prints it): the checks that do not depend on the command starting its own
    processes, without two process starts each. The command end to end: the checkpoint test below."""
    from dataclasses import asdict

    from hfcp.commands.verify import check_arguments, run_rank

    check_arguments(model, seq_len, data, head)
    reports = [asdict(r) for r in pool.run(run_rank, model, seq_len, strategy, data, head)]
    assert reports[0]["verdict"] == reports[1]["verdict"], reports
    return reports[0]


def test_verify_a_checkpoint_directory_with_its_text(tmp_path):
    from workers_model import tiny_model

    tiny_model("mistral").save_pretrained(tmp_path / "ckpt")  # a sliding window of 7 over 80 tokens
    rc, report, err = _verify("--model", str(tmp_path / "ckpt"), "--seq-len", "80", "--cp-size", "2",
                              "--strategy", "allgather")
    assert rc == 0 and report["verdict"] == "exact", (report, err[-2000:])
    assert report["loss_err"] < 1e-5 and report["grad_err"] < 1e-4 and len(report["peak_mem_mb"]) == 2


@pytest.mark.parametrize("family", ["llama", "gemma2", "biogpt"])
def test_verify_a_sequence_classifier_checkpoint(pool2, tmp_path, family):
    """A reward model's checkpoint is loaded as its sequence classifier and checked on its pooled score (Gemma 2's:
    transformers has no SDPA for it, its reference is eager); a class whose forward hfcp does not reproduce (BioGPT's)
    is reported refused."""
    from workers_heads import tiny_model

    cls = __import__("transformers").BioGptForSequenceClassification if family == "biogpt" else None
    tiny_model(family, "sequence", num_labels=1, cls=cls).save_pretrained(tmp_path / "ckpt")
    report = _rank_reports(pool2, str(tmp_path / "ckpt"), 40)
    if family == "biogpt":
        assert report["verdict"] == "refused" and report["reason"].startswith(
            "BioGptForSequenceClassification.forward is not transformers' GenericForSequenceClassification"), report
        return
    assert report["verdict"] == "exact" and report["loss_err"] < 1e-5 and report["logit_err"] < 1e-4, report


@pytest.mark.parametrize("family, head, strategy", [("llama", "sequence-classification", "ring"),
                                                     ("gpt2", "sequence-classification", "allgather"),
                                                     ("mistral", "token-classification", "ring")])
def test_verify_a_model_type_with_a_classification_head(pool2, family, head, strategy):
    """--head builds the family's *ForSequenceClassification / *ForTokenClassification of the tiny config and checks
    its loss, whole logits and every gradient (gpt2: a forward of its own that hfcp accepts by its fingerprint)."""
    report = _rank_reports(pool2, family, 40, strategy, head=head)
    assert report["verdict"] == "exact" and report["head"] == head, report
    assert report["loss_err"] < 1e-5 and report["grad_err"] < 1e-4 and report["logit_err"] < 1e-4, report


def test_verify_a_token_classifier_checkpoint_with_the_flag(pool2, tmp_path):
    """A token classifier's checkpoint is loaded as its class (a causal LM of it once: another model, its head
    random) and checked on its per-token logits; --head naming the checkpoint's own class is accepted."""
    from workers_heads import tiny_model

    from hfcp.commands.verify_inputs import load_model

    tiny_model("llama", "token").save_pretrained(tmp_path / "ckpt")
    assert type(load_model(str(tmp_path / "ckpt"))).__name__ == "LlamaForTokenClassification"
    report = _rank_reports(pool2, str(tmp_path / "ckpt"), 40, head="token-classification")
    assert report["verdict"] == "exact" and report["loss_err"] < 1e-5 and report["logit_err"] < 1e-4, report


def test_verify_builds_the_class_of_the_head_from_the_tiny_config():
    import transformers

    from hfcp.commands.verify_inputs import load_model, make_batch
    from hfcp.testing.tiny import tiny_config

    model = load_model("llama", head="sequence-classification")
    assert type(model) is transformers.LlamaForSequenceClassification, type(model)
    assert model.config.to_dict() == tiny_config("llama").to_dict() | {"architectures": None}
    batch = make_batch(model, 40, None)
    assert batch["labels"].shape == (1,) and model(**batch).logits.shape == (1, model.config.num_labels)
    token = load_model("llama", head="token-classification")
    assert (make_batch(token, 40, None)["labels"].shape == (1, 40)
            and token(**make_batch(token, 40, None)).logits.shape == (1, 40, 2))


def test_verify_a_recurrent_hybrid(pool2):
    # Qwen3-Next's tiny model: a gated delta net layer and an attention layer
    report = _rank_reports(pool2, "qwen3_next", 64)
    assert report["verdict"] == "exact", report
    assert report["loss_err"] < 1e-5 and report["grad_err"] < 1e-4 and report["logit_err"] < 1e-4, report


def test_the_float64_reference_of_a_mixture_of_experts_runs():
    """hfcp verify consults a float64 reference when fp32 differs: transformers' default grouped_mm experts have no
    float64 kernel (a raw RuntimeError once), so the reference runs its experts eagerly."""
    import torch

    from hfcp.commands.verify import _reference

    ids = torch.randint(3, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    loss, logits, grads = _reference("qwen3_next", {"input_ids": ids, "labels": ids}, torch.float64)
    assert logits.dtype == torch.float64 and loss > 0 and any("experts" in n for n in grads), list(grads)[:5]


def test_verify_a_model_type_that_hfcp_refuses_exits_nonzero(pool2, monkeypatch):
    from hfcp.commands import verify

    report = _rank_reports(pool2, "rwkv", 32)
    assert report["verdict"] == "refused" and "rwkv" in report["reason"], report
    # the command's exit status and JSON for that report (its workers' part is the pool's, above)
    monkeypatch.setattr(verify, "verify", lambda *args: verify.Report(**report))
    rc, printed, _ = _verify("--model", "rwkv", "--seq-len", "32", "--cp-size", "2")
    assert rc == 1 and printed == report


def test_verify_bad_arguments_exit_with_usage(capsys):
    from hfcp.commands.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--model", "llama", "--cp-size", "1"])
    assert exit_.value.code == 2 and "--cp-size 1 at least 2" in capsys.readouterr().err


def _console(*args):
    """The installed console command (`hfcp`, next to this interpreter), or the module where it is not installed."""
    script = Path(sys.executable).with_name("hfcp")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "hfcp.commands.cli"]
    return subprocess.run([*cmd, "verify", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _config_only(tmp_path):  # a checkpoint directory whose weights are missing: only loading the model finds that
    from hfcp.testing.tiny import tiny_config

    tiny_config("gpt2").save_pretrained(tmp_path / "ckpt")
    return str(tmp_path / "ckpt")


def _causal_lm_checkpoint(tmp_path):  # a config.json naming a causal LM's class (the flag's check reads no weights)
    from hfcp.testing.tiny import tiny_config

    config = tiny_config("llama")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path / "ckpt")
    return str(tmp_path / "ckpt")


# (arguments, exit status, the line's start, whether the parent refuses before starting any worker)
BAD_INVOCATIONS = {
    "seq_len_beyond_the_tiny_models_positions": (
        lambda tmp: ["--model", "gpt2"], 2,
        "hfcp verify: error: --seq-len 512 is more than the 256 positions of the tiny random gpt2 of hfcp.testing.tiny "
        "(its position table transformer.wpe, max_position_embeddings=256): pass --seq-len 256 or less", True),
    "unknown_model_type": (
        lambda tmp: ["--model", "not_a_type"], 2,
        "hfcp verify: error: --model not_a_type: no such directory, and not a causal-LM, image-text-to-text or "
        "audio-language model_type of transformers",
        True),
    "directory_without_config_json": (
        lambda tmp: ["--model", str(tmp)], 2,
        "hfcp verify: error: --model {tmp}: a directory without config.json, and not a causal-LM, "
        "image-text-to-text or audio-language model_type", True),
    "type_of_which_no_tiny_model_is_built": (
        lambda tmp: ["--model", "bart", "--seq-len", "32"], 1,
        "hfcp verify: ValueError: the tiny config still has 3.3M parameters (hfcp.testing.tiny builds no tiny random "
        "model of bart: verify a checkpoint directory of it instead)", True),
    "data_with_a_model_type": (
        lambda tmp: ["--model", "gpt2", "--seq-len", "32", "--data", str(ROOT / "README.md")], 2,
        "hfcp verify: error: --data {root}/README.md needs a checkpoint directory (its tokenizer): the tiny random "
        "gpt2 has a random vocabulary of 96 ids and no tokenizer", True),
    "head_that_transformers_lacks_for_the_type": (
        lambda tmp: ["--model", "codegen", "--head", "sequence-classification"], 2,
        "hfcp verify: error: --model codegen --head sequence-classification: transformers "
        f"{__import__('transformers').__version__} has no sequence-classification class of model_type 'codegen': "
        "pass one of the", True),
    "head_hfcp_does_not_run_for_the_family": (
        lambda tmp: ["--model", "biogpt", "--seq-len", "32", "--head", "sequence-classification"], 2,
        "hfcp verify: error: --model biogpt --head sequence-classification: hfcp does not run this head of biogpt "
        "(BioGptForSequenceClassification.forward is not transformers' GenericForSequenceClassification.forward", True),
    "head_of_a_vision_language_model_type": (
        lambda tmp: ["--model", "gemma3", "--seq-len", "32", "--head", "sequence-classification"], 2,
        "hfcp verify: error: --model gemma3 --head sequence-classification: gemma3 is a vision-language model, and "
        "hfcp runs classification heads of language models only", True),
    "head_other_than_the_checkpoints_class": (
        lambda tmp: ["--model", _causal_lm_checkpoint(tmp), "--seq-len", "32", "--head", "token-classification"], 2,
        "hfcp verify: error: --head token-classification with the checkpoint {tmp}/ckpt, whose config.json names "
        "['LlamaForCausalLM'], not a *ForTokenClassification class: leave out --head", True),
    "error_raised_in_the_workers": (
        lambda tmp: ["--model", _config_only(tmp), "--seq-len", "32"], 1,
        "hfcp verify: OSError: Error no file named model.safetensors, or pytorch_model.bin, found in directory "
        "{tmp}/ckpt", False),
}


@pytest.mark.parametrize("case", list(BAD_INVOCATIONS))
def test_verify_bad_invocations_print_one_line_and_exit_nonzero(case, tmp_path, capfd):
    """Each prints one line (`hfcp verify: error: ...` for bad arguments, exit 2; `hfcp verify: Type: message`, exit
    1, for what was raised building or running the model), never a traceback; the parent finds bad arguments before
    starting any worker. Those are checked in this process (hfcp.commands.cli.main, the console command's function: what
    a worker printed would reach the captured file descriptors too); the worker's error through the console command."""
    args, status, line, in_parent = BAD_INVOCATIONS[case]
    if in_parent:
        from hfcp.commands.cli import main

        rc = main(["verify", *args(tmp_path)])
        stdout, stderr = capfd.readouterr()
    else:
        r = _console(*args(tmp_path))
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    out = stdout + stderr
    assert "Traceback" not in out, out[-3000:]
    assert rc == status, (rc, out[-3000:])
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(line.format(tmp=tmp_path, root=ROOT)), last
    if in_parent:  # nothing else printed: no worker started
        assert stdout == "" and stderr.strip() == last, out[-3000:]


@pytest.mark.parametrize("model, strategy", [("qwen2_vl", "ulysses"), ("gemma3", "allgather"), ("checkpoint", "ring")])
def test_verify_a_vision_language_model_with_images(pool2, tmp_path, model, strategy):
    # a VLM model_type (a tiny random one) or checkpoint directory: two rows with an image each, built by hand;
    # gemma3 is a causal-LM type too (built as a text model it had 92.9M parameters, and verify exited 1)
    if model == "checkpoint":
        from hfcp.testing.tiny_vlm import tiny_vlm

        tiny_vlm("gemma3").save_pretrained(tmp_path / "ckpt")  # image blocks bidirectional, sliding layers
        model = str(tmp_path / "ckpt")
    report = _rank_reports(pool2, model, 48, strategy)
    assert report["verdict"] == "exact", report
    assert report["loss_err"] < 1e-5 and report["grad_err"] < 1e-4 and report["logit_err"] < 1e-4, report


def test_verify_an_moe_vision_language_model_and_one_it_cannot_fill(pool2):
    # Qwen3-VL-MoE with its router aux loss on (refused until hfcp computed a VLM's aux loss over the CP group)
    report = _rank_reports(pool2, "qwen3_vl_moe", 48)
    assert report["verdict"] == "exact" and report["loss_err"] < 1e-5 and report["grad_err"] < 1e-4, report
    rc, _, err = _verify("--model", "llava", "--seq-len", "20", "--cp-size", "2", report=False)  # in the parent
    assert rc == 1 and "16 tokens per image do not fit 20" in err and "longer --seq-len" in err, err


@pytest.mark.parametrize("model", ["voxtral", "checkpoint"])
def test_verify_an_audio_language_model_with_clips(pool2, tmp_path, model):
    # an audio model_type (a tiny random one) or checkpoint directory (loaded as a multimodal LM): two rows with
    # three clips, built by hand
    if model == "checkpoint":
        from hfcp.testing.tiny_audio import tiny_audio

        tiny_audio("qwen2_audio").save_pretrained(tmp_path / "ckpt")
        model = str(tmp_path / "ckpt")
    report = _rank_reports(pool2, model, 48)
    assert report["verdict"] == "exact", report
    assert report["loss_err"] < 1e-5 and report["grad_err"] < 1e-4 and report["logit_err"] < 1e-4, report
