"""FSDP2 x CP (issue 12, first slice): hfcp.patch before or after torch's fully_shard, exact."""
import pytest

import workers_fsdp as W


@pytest.mark.parametrize("order", ["patch_first", "shard_first"])
def test_fsdp2_cp2(pool2, order):
    for r in pool2.run(W.fsdp_step, order, 2):
        assert r["class"] == "FSDPLlamaForCausalLM" and r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r


@pytest.mark.parametrize("order", ["patch_first", "shard_first"])
def test_fsdp2_over_dp2_x_cp2(pool4, order):
    for r in pool4.run(W.fsdp_step, order, 2):
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r


@pytest.mark.parametrize("order, family", [("patch_first", "llama"), ("shard_first", "llama"),
                                           ("shard_first", "qwen2_moe")])
def test_fsdp2_cp2_with_tiled_mlp_and_offloaded_checkpoints(pool2, order, family):
    # issue 44: the MLPs (Qwen2-MoE: the experts, 30 rows, and the shared expert) in tiles of 4 of the rank's tokens,
    # the checkpointed layers' inputs in host memory
    for r in pool2.run(W.fsdp_step, order, 2, {"tiled_mlp": 4, "offload_checkpoints": True}, family):
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r
