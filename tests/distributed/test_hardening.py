"""Regressions of the adversarial probe (issue 13): exact, or a clear error on every rank; never a hang."""
import datetime
import math

import pytest
import torch

import workers_hardening as W
from hfcp.distributed.input_checks import content_digest
from hfcp.distributed.mesh import as_timedelta


def _exact(r, loss_tol=1e-5, grad_tol=1e-5):
    assert r["same_keys"] and r["finite"], r
    assert r["nan"][0] == r["nan"][1] and r["loss_err"] < loss_tol and r["grad_err"] < grad_tol, r


@pytest.mark.parametrize("kind", ["all_ignored", "L1"])
@pytest.mark.parametrize("loss_chunk", ["auto", None])
def test_batch_without_targets_gives_nan_loss_and_the_same_finite_gradients(pool2, kind, loss_chunk):
    for r in pool2.run(W.no_target, kind, loss_chunk):
        assert r["nan"] == (True, True), r  # as transformers: mean over no target
        _exact(r)


@pytest.mark.parametrize("kind", ["ignore_index", "shift_labels", "num_items"])
@pytest.mark.parametrize("loss_chunk", ["auto", None])
def test_transformers_loss_keywords_are_honoured(pool2, kind, loss_chunk):
    for r in pool2.run(W.loss_keywords, kind, loss_chunk):
        _exact(r)


@pytest.mark.parametrize("kind, message", [
    ("label_too_big", "labels[:, 1:][1, 4] = 64 is outside the vocabulary [0, 64)"),
    ("label_negative", "= -5 is outside the vocabulary"),
    ("token_too_big", "input_ids[1, 5] = 1000 is outside the vocabulary [0, 64)"),
    ("label_minus_100_with_other_ignore_index",
     "= -100 is outside the vocabulary [0, 64) and is not the ignore_index -1"),
])
@pytest.mark.parametrize("loss_chunk", ["auto", None])
def test_a_bad_value_in_one_shard_raises_on_every_rank(pool2, kind, message, loss_chunk):
    for msg in pool2.run(W.bad_values_in_one_shard, kind, loss_chunk):
        assert msg and msg.startswith("ValueError") and message in msg, msg


@pytest.mark.parametrize("kind, names", [("swap_tokens", "input_ids"), ("compensating_mask", "attention_mask"),
                                         ("dtype", "attention_mask")])
def test_batch_check_sees_swaps_and_compensating_edits(pool2, kind, names):
    for msg in pool2.run(W.batch_differs, kind):
        assert msg and f"got different batches ({names}): global ranks [1] differ from rank 0" in msg, msg


def test_content_digest_changes_under_any_edit():
    g = torch.Generator().manual_seed(0)
    for t in (torch.randint(0, 50000, (3, 700), generator=g), torch.randn(2, 5, 33, generator=g),
              torch.randn(4, 300_000, generator=g).to(torch.bfloat16), torch.rand(3, 7, generator=g) > 0.5):
        base = int(content_digest(t))
        assert int(content_digest(t.clone())) == base
        flat = t.reshape(-1)
        for _ in range(20):
            i, j = (int(x) for x in torch.randint(0, flat.numel(), (2,), generator=g))
            if flat[i] == flat[j]:
                continue
            swapped = flat.clone()
            swapped[i], swapped[j] = flat[j], flat[i]
            assert int(content_digest(swapped.view_as(t))) != base, (t.dtype, i, j)
        if t.dtype == torch.int64:  # +1 at one position, -1 at the next: the sum stays the same
            edited = flat.clone()
            edited[10] += 1
            edited[11] -= 1
            assert int(content_digest(edited.view_as(t))) != base
    # non-contiguous input digests as its contiguous copy
    x = torch.randn(6, 8, generator=g)
    assert int(content_digest(x.t())) == int(content_digest(x.t().contiguous()))


@pytest.mark.parametrize("kind, message", [
    ("set_attn_implementation", "ran this forward without hfcp's attention (attn_implementation is now 'sdpa')"),
    ("inner_model", "a submodule such as model.model called directly"),
    ("gather_stale", "an output of an earlier forward"),
    ("gather_dim0", "its sequence dimension is 1"),
    ("gather_outputs_before_forward", "RuntimeError: gather_outputs needs the outputs of a forward"),
    ("gather_sequence_before_forward", "RuntimeError: gather_sequence needs the output of a forward"),
    ("logits_to_keep_tensor", "logits_to_keep=tensor("),
    ("input_ids_1d", "input_ids has shape (16,); hfcp needs (batch, seq)"),
    ("float_labels", "labels[:, 1:] has dtype torch.float32; pass integer token ids"),
    ("fused_lm_head", "train with hfcp.integrations.HfcpSFTTrainer"),
    ("cu_seq_lens_mismatch", "cu_seq_lens [0, 5, 16] and the position_ids resets describe different documents"),
])
def test_misuse_is_refused_on_every_rank(pool2, kind, message):
    for msg in pool2.run(W.misuse, kind):
        assert msg and message in msg, msg


def test_gather_of_the_latest_output_still_works(pool2):
    assert pool2.run(W.misuse, "gather_ok") == [(2, 16, 64)] * 2


@pytest.mark.parametrize("kind, message", [
    ("check_inputs_str", "check_inputs='no' must be True or False"),
    ("group_without_me", "which do not include rank 1"),  # refused on rank 0 too: it hears of it in the all-gather
    ("timeout_inf", "timeout=inf must be a positive, finite number"),
    ("timeout_zero", "timeout=datetime.timedelta(0) must be a positive"),
    ("timeout_negative", "timeout=-3 must be a positive"),
    ("timeout_nan", "timeout=nan must be a positive"),
])
def test_bad_patch_arguments(pool2, kind, message):
    results = pool2.run(W.patch_misuse, kind)
    for msg in results:
        assert msg and message in msg, msg


def test_repatch_with_another_timeout_is_refused(pool2):
    for same, msg in pool2.run(W.patch_misuse, "repatch_timeout"):
        assert same and msg and "timeout=datetime.timedelta(seconds=30), now datetime.timedelta(seconds=60)" in msg, msg


def test_timeout_values():
    assert as_timedelta(2) == datetime.timedelta(seconds=2) and as_timedelta(None) is None
    for bad in (math.inf, -1, 0, datetime.timedelta(seconds=-1), "5", True):
        with pytest.raises(ValueError):
            as_timedelta(bad)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_float64_model_trains_exactly(pool2, strategy):
    for r in pool2.run(W.precision, "float64", strategy):
        _exact(r, 1e-6, 1e-6)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_autocast_matches_the_unpatched_model_within_half_precision(pool2, kind, strategy):
    for r in pool2.run(W.precision, kind, strategy):
        _exact(r, 2e-3, 5e-2)


@pytest.mark.parametrize("world, seed", [(2, 0), (2, 1), (2, 2), (4, 3)])
def test_random_sweep_of_label_mask_and_position_oddities(pool2, pool4, world, seed):
    pool = pool2 if world == 2 else pool4
    for case, r in pool.run(W.odd_batches, 8, seed)[0]:
        assert r["same_keys"] and r["finite"], (case, r)
        assert r["nan"][0] == r["nan"][1] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5, (case, r)
