"""HfcpSFTTrainer (TRL): 1 process (stock SFTTrainer, fused LM head) vs cp 2 and dp 2 x cp 2."""
import pytest

import workers_trainer as W

pytest.importorskip("trl")  # the optional extra hfcp[trl]; CI installs it


def assert_same(got, ref, tol=2e-5):
    assert len(got["history"]) == len(ref["history"]) == 4, (got, ref)
    for g, r in zip(got["history"], ref["history"]):
        assert g.keys() == r.keys() and {"mean_token_accuracy", "entropy", "num_tokens"} <= g.keys(), (g, r)
        for k in g:
            assert abs(g[k] - r[k]) <= tol * max(1.0, abs(r[k])), (k, g, r)
    assert got["eval"].keys() == ref["eval"].keys() and len(ref["eval"]) == 3, (got["eval"], ref["eval"])
    for k in ref["eval"]:
        assert abs(got["eval"][k] - ref["eval"][k]) <= tol * max(1.0, abs(ref["eval"][k])), (k, got, ref)


@pytest.fixture(scope="module")
def sft_reference(pool1):
    return pool1.run(W.sft_run, 4)[0]


def test_sft_cp2_equals_one_process(pool2, sft_reference):
    for got in pool2.run(W.sft_run, 4):
        assert_same(got, sft_reference)
        # the same batches as one process (dp 1), so the same padding: predictions compare as arrays
        assert got["predictions"].shape == sft_reference["predictions"].shape
        assert float((got["predictions"] - sft_reference["predictions"]).abs().max()) < 1e-4
        assert (got["label_ids"] == sft_reference["label_ids"]).all()


def test_sft_packing_cp2_equals_one_process(pool1, pool2):
    ref = pool1.run(W.sft_run, 2, None, {"packing": True, "max_length": 48})[0]
    for got in pool2.run(W.sft_run, 2, None, {"packing": True, "max_length": 48}):
        assert_same(got, ref)


def test_sft_dp2_cp2_equals_one_process(pool4, sft_reference):
    for got in pool4.run(W.sft_run, 2, 2):
        assert_same(got, sft_reference)
