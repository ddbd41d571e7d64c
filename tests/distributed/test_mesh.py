"""One device mesh (issue 21): CP groups from a torch DeviceMesh or any process groups, tensor parallelism x CP,
FSDP2 over accelerate's ParallelismConfig mesh; 4 gloo processes."""
import pytest

import workers_tp as W


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Llama checkpoints for transformers' tensor-parallel loading: 4 heads / 2 KV heads, and 8 / 4."""
    from hfcp.testing.tiny import tiny_model

    paths = {}
    for heads, kv in [(4, 2), (8, 4)]:
        paths[heads] = str(tmp_path_factory.mktemp(f"llama{heads}"))
        W.save_tiny_llama(paths[heads], heads, kv)
    for family in ("mixtral", "qwen3_next"):  # MoE with router logits; a hybrid with gated delta-rule layers
        paths[family] = str(tmp_path_factory.mktemp(family))
        tiny_model(family).save_pretrained(paths[family])
    return paths


@pytest.mark.parametrize("kind, leaders", [("cp_outer", (0, 1)), ("dp_outer", (0, 2)), ("by_hand", (0, 1))])
def test_cp_groups_of_any_layout(pool4, kind, leaders):
    """A (cp, dp) mesh puts ranks {0,2} and {1,3} in one CP group each, hfcp's default layout {0,1} and {2,3}:
    both exact, with the data-parallel coordinates read from the groups (usp's sub-groups too)."""
    results = pool4.run(W.mesh_groups_step, kind)
    expected = [(0, 2), (1, 2), (0, 2), (1, 2)] if leaders == (0, 1) else [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r["dp"] for r in results] == expected, results
    for r in results:
        assert r["leaders"] == leaders and r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r


@pytest.mark.parametrize("strategy, heads", [("ring", 4), ("allgather", 4), ("ulysses", 8)])
@pytest.mark.parametrize("how", ["device_mesh", "cp_size"])
def test_tensor_parallel_x_cp(pool4, checkpoints, strategy, heads, how):
    """tp 2 x cp 2: transformers' TP over {0,1} and {2,3}, hfcp's CP over {0,2} and {1,3} (from mesh['cp'], or built
    by hfcp across the TP groups from cp_size); each rank's attention computes half the heads; exact."""
    results = pool4.run(W.tp_x_cp_step, checkpoints[heads], strategy, how)
    assert [r["cp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]], results
    for r in results:
        assert r["dp"] == (0, 1) and r["q_width"] == 16 and r["chunk"] is None, r
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r


def test_average_gradients_of_a_tensor_parallel_model(pool4, checkpoints):
    """hfcp.average_gradients on DTensor gradients (an all-reduce of the DTensor itself raised): their local shards,
    averaged over the CP group, still the one-process gradients."""
    for r in pool4.run(W.tp_x_cp_step, checkpoints[4], "ring", "cp_size", True):
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r


@pytest.mark.parametrize("kind, message", [
    ("cp_inside_tp", "shares ranks with the model's tensor-parallel group"),
    ("cp_mixes_tp_shards", "hold different tensor-parallel shards"),
    ("chunked_head", "sharded over the vocabulary"),
    ("cp_size", "cp_size=4 must divide 2 (the world size 4 over the model's tp_size=2)"),
])
def test_tensor_parallel_refusals(pool4, checkpoints, kind, message):
    for r in pool4.run(W.tp_refusals, checkpoints[4], kind):
        assert r and message in r, r


def test_tensor_parallel_x_cp_moe(pool4, checkpoints):
    """Mixtral (experts and router under transformers' TP plan): exact."""
    for r in pool4.run(W.tp_x_cp_step, checkpoints["mixtral"], "ring", "cp_size"):
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r


def test_tensor_parallel_hybrid_is_refused(pool4, checkpoints):
    for r in pool4.run(W.tp_refusals, checkpoints["qwen3_next"], "cp2"):
        assert r and "(it has recurrent or convolution layers) is loaded tensor-parallel" in r, r


def test_ulysses_heads_per_tensor_parallel_rank(pool4, checkpoints):
    with pytest.raises(Exception, match="num_attention_heads=2 and num_key_value_heads=1 .* tensor-parallel rank"):
        pool4.run(W.tp_x_cp_step, checkpoints[4], "ulysses", "cp_size")


def test_fsdp2_over_a_parallelism_config_mesh(pool4):
    """FSDP2 on dp_shard x cp, hfcp on cp, both from ParallelismConfig(dp_shard_size=2, cp_size=2).build_device_mesh:
    the gradient convention (mean over all ranks) holds."""
    results = pool4.run(W.parallelism_config_mesh_step)
    for r in results:
        assert r["dp"] == (r["mesh_dp"], 2) and r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, r


def test_trainer_refuses_a_tensor_parallel_model(pool4, checkpoints):
    for r in pool4.run(W.trainer_refuses_tp, checkpoints[4]):
        assert r and "cannot run a tensor-parallel model (tp_size=2)" in r, r


def test_tensor_parallel_x_cp_generation(pool4, checkpoints):
    for r in pool4.run(W.tp_x_cp_generate, checkpoints[4]):
        assert r == {"same": True, "kv_heads": 1}, r  # 2 KV heads over tp 2


@pytest.mark.parametrize("kind, message", [
    ("no_cp_dimension", "device_mesh has 2 dimensions ('dp', 'sp') and none named 'cp'"),
    ("not_a_mesh", "device_mesh='cp' must be a torch DeviceMesh"),
    ("both", "pass either process_group= or device_mesh="),
    ("tp_not_read", "device_mesh has a 'tp' dimension over ranks [0, 1]"),
    ("dp_dimension", "device_mesh is the mesh's 'dp' dimension, not its CP one"),
])
def test_device_mesh_refusals(pool2, kind, message):
    for r in pool2.run(W.device_mesh_refusals, kind):
        assert r and message in r, r


def test_unpatched_tensor_parallel_model_shards_data_by_tp_group(pool4, checkpoints):
    assert pool4.run(W.unpatched_tp_coordinates, checkpoints[4]) == [(0, 2), (0, 2), (1, 2), (1, 2)]


@pytest.mark.parametrize("model", [4, "mixtral"])
def test_the_plan_counts_what_a_tensor_parallel_rank_holds(pool4, checkpoints, model):
    """hfcp.plan's parameters of a TP rank (read from the model's tp_plan, the narrowed layers the dry run traces
    checked against it) are what transformers' tensor parallelism gives each rank, embedding and head included."""
    import importlib

    from transformers import AutoConfig

    from hfcp.planning.trace import Setup

    plan = importlib.import_module("hfcp.planning.plan")
    config = AutoConfig.from_pretrained(checkpoints[model])
    want = plan._params(config, Setup(2, dtype="fp32", tp=2)).total
    assert want < plan._params(config, Setup(2, dtype="fp32")).total
    assert pool4.run(W.rank_parameter_elements, checkpoints[model]) == [want] * 4
