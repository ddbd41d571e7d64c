"""Models built as a user builds them (transformers' config classes, a checkpoint's fields only), and call options
of a supported model that hfcp refuses by name."""
import re

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


@pytest.mark.parametrize("kind, reason", [
    # a causal convolution over the projected queries and keys inside its attention module: 46 of 65 gradients were
    # off at cp 2 (loss 6.555740 for 6.556238), silently
    ("zaya", r"ZayaForCausalLM \(model_type='zaya'\) is not supported by hfcp: "
             r"model\.layers\.0\.self_attn\.qkv_proj\.conv_qk_depthwise \(Conv1d, kernel_size=\(2,\)\) inside "
             r"ZayaCCAProjection convolves over neighbouring tokens"),
    # its attention extends the mask over compressed keys itself: a raw "Sizes of tensors must match" from torch.cat
    ("deepseek_v4", r"^ValueError: modeling_deepseek_v4\.py:\d+ \(forward\) computes a new tensor from its attention "
                    r"mask \(cat\); it failed on hfcp's stand-in: RuntimeError: Sizes of tensors must match.*"
                    r"not supported by hfcp"),
])
def test_user_records_of_families_hfcp_does_not_ship_are_refused_with_the_reason(pool2, kind, reason):
    # the record a user writes (the attention class named, nothing else) goes through the checks every record does
    for r in pool2.run(W.user_record, kind):
        assert re.search(reason, r.get("refused", "")), r


def test_the_convolution_check_is_what_keeps_zaya_exact_or_refused(pool2):
    # the same record opting out of the checks runs, and is wrong: the refusal above is not overcautious
    for r in pool2.run(W.user_record, "zaya", True):
        assert "refused" not in r and r["grad_err"] > 1e-2, r


def test_attention_over_more_keys_than_queries_is_refused_naming_the_class(pool2):
    for msg in pool2.run(W.extra_keys):
        assert msg.startswith("LlamaAttention attends 8 queries to 10 keys"), msg


def test_attention_keywords_hfcp_does_not_implement_are_refused_by_name(pool2):
    # s_aux is an attention sink (one logit per query head: implemented); any other keyword is refused by name
    for r in pool2.run(W.attention_keywords):
        assert r["position_bias"].startswith("LlamaAttention passes position_bias=tensor of shape (4, 16, 16) to its "
                                             "attention function, which hfcp's context-parallel attention does not "
                                             "implement"), r
        assert r["s_aux"].startswith("LlamaAttention passes s_aux of shape (3,); hfcp implements one sink logit per "
                                     "query head, shape (4,)"), r
        assert r["s_aux_per_head"] == "ran", r
