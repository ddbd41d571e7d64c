"""Bad input and faults: a clear error on every rank, nothing silently wrong, no hang."""
import pytest

import workers_faults as WF
import workers_reliability as W
from hfcp.testing.dist_pool import DistPool


@pytest.mark.parametrize("kind", ["content", "shape"])
def test_ranks_with_different_batches_are_reported_on_every_rank(pool2, kind):
    for msg in pool2.run(W.mismatched_batches, kind):
        assert msg and "global ranks [1] differ from rank 0" in msg and "check_inputs=False" in msg, msg


def test_batch_check_can_be_turned_off(pool2):
    assert pool2.run(W.mismatched_batches, "content", False) == [None, None]


@pytest.mark.parametrize("kind, message", [
    ("labels_shape", "labels has shape (2, 10) but the input is (batch=2, seq=16)"),
    ("position_shape", "position_ids has shape (1, 15) but the input is (batch=2, seq=16)"),
    ("mask_4d", "attention_mask of shape (2, 1, 16, 16)"),
    ("use_cache", "a KV cache with labels"),  # a training forward runs without a cache
    ("generate", "beam search rewrites the KV cache"),  # generation: tests/inference/test_inference.py
])
def test_bad_calls_raise_clear_errors_on_every_rank(pool2, kind, message):
    for msg in pool2.run(W.bad_call, kind):
        assert msg and message in msg, msg


@pytest.mark.parametrize("kind, message", [
    ("cp_too_big", "cp_size=4 must divide the world size 2"),
    ("ulysses_heads", "num_attention_heads=3 and num_key_value_heads=1 are not both divisible by cp_size=2"),
    ("usp_size", "ulysses_size=3 must divide cp_size=2, num_attention_heads=4 and num_key_value_heads=2; "
                 "choose one of [1, 2]"),
    ("usp_size_without_usp", "ulysses_size=2 applies to strategy='usp' only"),
])
def test_bad_patch_settings(pool2, kind, message):
    for msg in pool2.run(W.bad_patch, kind):
        assert msg and message in msg, msg


def test_same_seed_gives_bitwise_identical_losses(pool2):
    for (l1, g1), (l2, g2) in pool2.run(W.loss_twice):
        assert l1 == l2 and g1 == g2


@pytest.mark.parametrize("seed", [0, 1])
def test_random_sweep_equivalence(pool4, seed):
    for case, errs in pool4.run(W.random_draws, 6, seed)[0:1][0]:
        assert errs["loss"] < 1e-5 and errs["seq"] < 1e-5 and errs["grad"] < 1e-5, (case, errs)


def test_killed_rank_survivor_raises_within_timeout():
    pool = DistPool(2)
    try:
        r = pool.run(WF.one_rank_dies_mid_step, 5.0, timeout=120, expect=[0])[0]
    finally:
        pool.close(kill=True)
    # the 5 s bound, not gloo's 30 min (loose: CI load)
    assert r["raised"] == "CollectiveError" and r["after_s"] < 60, r
    assert "peer rank probably raised, died" in r["message"], r


def test_vision_attention_mask_is_refused_not_ignored(pool2):
    for msg in pool2.run(W.vision_attention_mask_refused):
        assert msg and "attention_mask is not supported by hfcp on ViTForImageClassification" in msg, msg


def test_deepcopy_of_a_patched_model_is_refused(pool2):
    for msg in pool2.run(W.deepcopy_refused):
        assert msg and "deepcopy before hfcp.patch" in msg, msg


def test_user_process_group_gives_data_parallel_coordinates(pool4):
    assert pool4.run(W.user_process_group, "ok") == [(0, 2), (0, 2), (1, 2), (1, 2)]


@pytest.mark.parametrize("kind, message", [
    ("timeout", "create your process_group with"),
    ("members_disagree", "rank 0 passes the CP group [0, 2] and its member rank 2 passes [1, 2]"),
])
def test_user_process_group_errors(pool4, kind, message):
    """Refused on every rank (groups that are not consecutive blocks are compared in one all-gather at patch time),
    so none is left waiting."""
    for r in pool4.run(W.user_process_group, kind):
        assert r and message in r, r


def test_failed_forward_does_not_leave_the_head_swapped(pool2):
    for r in pool2.run(W.head_restored_after_a_failed_forward):
        assert r["raised"] and r["logits_shape"] == (2, 8, 64) and r["tuple_second"], r


def test_average_gradients_helper(pool2):
    for err in pool2.run(W.average_gradients_matches_single_device):
        assert err < 1e-5


def test_unpatch_after_a_failed_chunked_forward_restores_the_head(pool2):
    for r in pool2.run(W.unpatch_after_a_failed_forward):
        assert r["logits_shape"] == (2, 16, 64) and r["loss"] > 0, r
