"""Inference calls on a patched model (issue 20): the logits of the last positions (`logits_to_keep`), the
commonest inference call, the same on every rank."""
import pytest

import workers_inference as W


@pytest.mark.parametrize("kind, keep", [("llama", 1), ("mistral", 3), ("gemma2", 1), ("llama", 100)])
def test_logits_to_keep_gives_the_last_positions_on_every_rank(pool2, kind, keep):
    # under zigzag the last positions are rank 0's; every rank gets them, and the gradients of their sum are exact
    # (mistral: a sliding window; gemma2: softcapping after the head; 100 > the 37 tokens: every position)
    for r in pool2.run(W.last_logits, kind, keep):
        assert r["shape"] == r["want_shape"] and r["err"] < 1e-5 and r["grad_err"] < 1e-4, r
        assert not r["stamped"], r  # not a local sequence: hfcp.gather_sequence and the Trainer leave it as it is


def test_logits_to_keep_at_cp4(pool4):
    for r in pool4.run(W.last_logits, "llama", 2):
        assert r["shape"] == r["want_shape"] and r["err"] < 1e-5 and r["grad_err"] < 1e-4, r


@pytest.mark.parametrize("call, message", [("with_labels", "logits_to_keep=1 with labels"),
                                           ("negative", "logits_to_keep=-1 is not supported")])
def test_logits_to_keep_hfcp_cannot_honour_is_refused(pool2, call, message):
    for msg in pool2.run(W.refusal, call):
        assert message in msg, msg
