"""Per-token inputs a family reads, exact under CP (issue 22, item 3): positions OPT derives from the attention mask
(left padding, mask holes), RoPE whose frequencies follow the largest position (longrope, dynamic NTK: the whole
sequence decides, not a rank's shard; lengths crossing the original context over three steps), token_type_ids
split like the tokens."""
import pytest

import workers_positions as W

LONGROPE = {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                "long_factor": [4.0] * 4, "original_max_position_embeddings": 32},
            "original_max_position_embeddings": 32}
DYNAMIC = {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
           "max_position_embeddings": 32}


def _exact(result):
    for step in result["steps"]:
        assert step["loss_err"] < 1e-5 and step["grad_err"] < 1e-4, result


@pytest.mark.parametrize("kind", ["left_padding", "holes"])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_opt_positions_from_the_whole_mask(pool2, kind, strategy):
    for r in pool2.run(W.run, "opt", kind, strategy):
        _exact(r)


@pytest.mark.parametrize("model_type, config", [("phi3", LONGROPE), ("llama", DYNAMIC)])
def test_rope_that_follows_the_largest_position_uses_the_whole_sequence(pool2, model_type, config):
    # lengths 24, 32, 40 against an original context of 32: at 40 one device switches frequencies; under zigzag
    # rank 1 holds positions 10..29 only, so its own maximum would keep the short ones
    for r in pool2.run(W.run, model_type, "plain", "ring", config, 3):
        _exact(r)


@pytest.mark.parametrize("model_type", ["gpt2", "bert"])
def test_token_type_ids_are_split_like_the_tokens(pool2, model_type):
    for r in pool2.run(W.run, model_type, "token_types"):
        _exact(r)
