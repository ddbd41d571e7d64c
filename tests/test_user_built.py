"""Models built as a user builds them (transformers' config classes, a checkpoint's fields only), and call options
of a supported model that hfcp refuses by name."""
import pytest

import workers_user_built as W


def test_the_tiny_builder_sets_only_the_fields_a_config_has():
    from hfcp.testing.tiny import tiny_config

    # MambaConfig has no attention heads: the builder added num_attention_heads, which hid hfcp reading it (issue 30)
    assert not hasattr(tiny_config("mamba"), "num_attention_heads")
    assert tiny_config("llama").num_attention_heads == 4


@pytest.mark.parametrize("kind, strategy", [("mamba", "ulysses"), ("mamba2", "usp"), ("falcon_mamba", "ring")])
def test_pure_mamba_models_built_from_their_configs_are_exact(pool2, kind, strategy):
    # hfcp.patch read num_attention_heads of every model: AttributeError on MambaConfig, Mamba2Config, FalconMambaConfig
    for r in pool2.run(W.mamba_exact, kind, strategy):
        assert not r["has_heads"] and r["same_keys"], r
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


def test_output_options_are_honoured_or_refused_by_name(pool2):
    for r in pool2.run(W.output_options):
        assert r["layers"][0] == r["layers"][1] and r["hidden_err"] < 1e-5, r  # local, gathered equal
        assert r["attentions"].startswith("output_attentions=True on a hfcp-patched model"), r
        assert "not supported by hfcp" not in r["attentions"], r
        assert "generate(output_hidden_states=True)" in r["generate"], r
