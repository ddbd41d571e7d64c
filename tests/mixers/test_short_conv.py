"""Gated short convolutions (LFM2, LFM3, LFM2-MoE) under CP: each conv layer's causal depthwise convolution takes
its halo (the kernel-1 inputs before each chunk) from the rank that holds them (hfcp/mixers/conv_halo.py); the attention
layers run the chosen strategy. Loss and every gradient equal the unpatched model."""
import pytest

import workers_mixers as W


@pytest.mark.parametrize("kind, case, strategy", [("lfm2", "plain", "ring"), ("lfm2", "padding", "allgather"),
                                                  ("lfm3", "padding", "ulysses"), ("lfm2_moe", "padding", "ring")])
def test_short_conv_hybrids_equal_the_unpatched_model(pool2, kind, case, strategy):
    for r in pool2.run(W.compare, kind, case, strategy):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r
        assert r["conv_params"] and r["conv_grad_err"] < 1e-4, r  # the halo's gradient reached its owner
        assert r["restored"], r  # unpatch gave every module its class's forward back


def test_short_conv_single_row_with_padding(pool2):
    # transformers zeroes the padded conv inputs for one row too: the left padding must not leak into the tokens after
    for r in pool2.run(W.compare, "lfm2", "one_row_padding"):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["conv_grad_err"] < 1e-4, r


def test_short_conv_under_gradient_checkpointing(pool2):
    for r in pool2.run(W.compare, "lfm2", "padding", "ring", "checkpointing"):  # conv layers recomputed in backward
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["conv_grad_err"] < 1e-4, r


def test_short_conv_forward_while_a_checkpointed_graph_is_alive_is_exact(pool2):
    # a second forward (other padding) before the first one's backward: the first forward's conv layers are
    # recomputed with their own step, carried by the checkpoint function (hfcp/mixers/binding.py)
    for r in pool2.run(W.compare, "lfm2", "padding", "ring", "two_forwards"):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["conv_grad_err"] < 1e-4, r


def test_short_conv_at_cp4(pool4):
    for r in pool4.run(W.compare, "lfm2", "padding"):  # chunks of 5 tokens, the halo of 2 from another rank
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r
        assert r["conv_grad_err"] < 1e-4 and r["restored"], r


def test_short_conv_kernel_longer_than_a_chunk_is_refused(pool4):
    for r in pool4.run(W.compare, "lfm3", "plain"):  # kernel 7: a halo of 6 over chunks of 5
        assert "needs chunks of at least 6 tokens" in r.get("refused", ""), r


def test_short_conv_packed_rows_are_refused(pool2):
    for r in pool2.run(W.compare, "lfm2", "packed"):
        assert "packed rows" in r.get("refused", "") and "crosses document boundaries" in r["refused"], r
