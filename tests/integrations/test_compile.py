"""torch.compile on a patched model (issue 42): regional and whole-model compile at cp 2 equal the unpatched model,
eager, in one process (loss and every gradient, step after step); hfcp's own work runs between the graphs."""
import pytest

import workers_compile as W

CASES = [  # (family, how): a Llama, a sliding-window family, a hybrid with short convolutions, a VLM (a Llama whole:
    ("llama", "layers"), ("mistral", "regional"), ("lfm2", "whole"), ("llava", "regional"),  # with inductor below)
]


def assert_exact(runs):
    for got in runs:
        assert got["loss_err"] < 1e-5 and got["grad_err"] < 1e-4, got
        assert got["graphs"][-1] == got["graphs"][-2], got  # the last step compiled nothing new: no recompile per step
        assert got["hfcp_breaks"] > 0, got  # hfcp's work ran between the graphs (each break names hfcp's reason)


@pytest.mark.parametrize("kind, how", CASES)
def test_compiled_cp2_equals_eager_one_process(pool2, kind, how):
    runs = pool2.run(W.compiled_steps, kind, how, "aot_eager")
    assert_exact(runs)
    if how == "layers":  # each decoder layer: a graph before its attention, one after it
        assert runs[0]["graphs"][-1] == 2 * runs[0]["layers"], runs[0]


def test_inductor_whole_model_cp2_equals_eager_one_process(pool2):
    # one decoder layer: a graph before its attention, one after it (each compiled by a C++ compiler, forward and
    # backward, on a fresh machine)
    assert_exact(pool2.run(W.compiled_steps, "llama", "whole", "inductor", False, None, 1, timeout=600))


def test_compiled_with_checkpointing_cp2_equals_eager_one_process(pool2):
    # gradient checkpointing on (non-reentrant): each recompute must see its own step, the hybrid's states included
    for got in pool2.run(W.compiled_steps, "lfm2", "whole", "aot_eager", True):
        assert got["loss_err"] < 1e-5 and got["grad_err"] < 1e-4, got


def test_fullgraph_is_refused_with_hfcps_reason(pool2):
    for msg in pool2.run(W.fullgraph_refused):
        assert "hfcp's LossHook.pre_forward reads the step's layout" in msg and "without fullgraph=True" in msg, msg


def test_compiled_with_tiled_mlp_and_offloaded_checkpoints_cp2_equals_eager_one_process(pool2):
    # issue 44: the MLPs in tiles (hfcp's autograd function, run between graphs), checkpoints offloaded
    assert_exact(pool2.run(W.compiled_steps, "llama", "whole", "aot_eager", True,
                           {"tiled_mlp": 4, "offload_checkpoints": True}))
