"""Recurrent layers under CP (patches/recurrent.py, minimax.py, recurrent_gemma.py): gated delta nets (Qwen3-Next,
Qwen3.5, Qwen3.5-MoE, OLMo-hybrid, Lara-mini), Kimi delta attention (Kimi-Linear, Bailing-hybrid), Mamba-2 (mamba2,
Bamba, Falcon-H1, Granite-4.0-H, Zamba2, Nemotron-H), Mamba 1 (mamba, Falcon-Mamba, Jamba, Zamba), MiniMax's
lightning attention and RecurrentGemma's RG-LRU:
each recurrent layer's convolution takes its halo from the rank before, and its scan runs on each run of this rank's
tokens from the state folded over the runs before it (hfcp/mixers/state_fold.py); the attention layers run the chosen
strategy.

The engine's fold is exact in fp64 (1e-16). The families' kernel computes in fp32 whatever the model's dtype, and
the decay parameters' (A_log, dt_bias) gradients are sums with cancellation, so the model-level comparisons hold
hfcp to the kernel's own fp32 noise on one device: the same model with the kernel's chunks of 16 tokens instead
of its default differs from itself by up to 3e-4 (the "noise" each run measures)."""
import pytest
import torch

import workers_mixers as W


def _exact(r, chunked: bool = True):
    # a chunked kernel: hfcp's error within twice the kernel's own noise (measured with other chunks); Mamba 1's
    # kernel has no chunks: within float tolerance
    tolerance = 2 * r["noise"] + 1e-5 if chunked else 1e-5
    assert (r["noise"] > 0) == chunked and r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < tolerance, r
    assert r["conv_params"] and r["conv_grad_err"] < tolerance, r  # conv and decay parameters: the states came back


@pytest.mark.parametrize("zigzag", [True, False])
def test_state_fold_is_exact_in_fp64(pool2, pool4, zigzag):
    # the gated delta rule token by token over the whole sequence against runs of it on 2 and 4 ranks, folded
    for pool in (pool2, pool4):
        for r in pool.run(W.fold_exact, zigzag):
            assert r["out_err"] < 1e-12 and r["grad_err"] < 1e-12, r


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("fold", ["scalar_fold_exact", "channel_fold_exact", "gated_fold_exact"])
def test_decay_folds_are_exact_in_fp64(pool2, pool4, zigzag, fold):
    # Mamba-2's scan (a scalar decay per head), Mamba 1's (a decay per channel and state index) and RG-LRU's (a gate
    # per channel, with a reset) token by token over the whole sequence, against runs of it on 2 and 4 ranks, folded
    for pool in (pool2, pool4):
        for r in pool.run(getattr(W, fold), zigzag):
            assert r["out_err"] < 1e-12 and r["grad_err"] < 1e-12, r


# every recorded family is also in the family sweep (tests/sweeps/test_families.py): cp 2, ring, allgather and
# ulysses, with
# padding and mask holes, to the same bound; these cases add the test's own GQA shapes (2 key heads, 4 value heads)
@pytest.mark.parametrize("kind, case, strategy", [("qwen3_next", "plain", "ring"),
                                                  ("qwen3_5_text", "padding", "ulysses"),
                                                  ("lara_mini", "padding", "allgather")])  # lara_mini: sliding windows
def test_gated_delta_hybrids_equal_the_unpatched_model(pool2, kind, case, strategy):
    for r in pool2.run(W.compare, kind, case, strategy):
        _exact(r)
        assert r["restored"], r


def test_gated_delta_at_cp4(pool4):  # (KDA's fold is the same function: at cp 4 in fp64 above)
    for r in pool4.run(W.compare, "qwen3_next", "padding"):  # chunks of 5 tokens: states and a halo of 3 cross ranks
        _exact(r)


def test_gated_delta_under_gradient_checkpointing(pool2):
    for r in pool2.run(W.compare, "qwen3_5_text", "padding", "ring", "checkpointing"):
        _exact(r)


# A's forward, B's forward under torch.no_grad() (an evaluation, DPO's reference pass), then A's backward: the
# recomputed layers must use A's step, not B's (other padding, or another length). Models built from their configs.
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", ["mamba2", "jamba", "lfm2", "zamba", "llama"])
def test_a_no_grad_forward_before_backward_keeps_each_recompute_on_its_step(pool2, kind, reentrant):
    for r in pool2.run(W.interleaved, kind, reentrant, True, 24):  # A row 0 padded by 3, B row 1 by 9
        assert "error" not in r and r["grad_err"] < 1e-5 and r["restored"], r


@pytest.mark.parametrize("kind, reentrant, a_padded, b_length", [
    ("mamba2", False, False, 24), ("jamba", True, False, 24), ("lfm2", True, False, 24),  # A unpadded, B padded
    ("mamba2", False, True, 16), ("jamba", True, True, 16), ("zamba", True, True, 16)])  # B of another length
def test_a_no_grad_forward_of_other_padding_or_length_before_backward_is_exact(pool2, kind, reentrant, a_padded,
                                                                               b_length):
    for r in pool2.run(W.interleaved, kind, reentrant, a_padded, b_length):
        assert "error" not in r and r["grad_err"] < 1e-5 and r["restored"], r


@pytest.mark.parametrize("kind, reentrant", [("lfm2", False), ("jamba", True)])
def test_gradient_checkpointing_enabled_after_patch_recomputes_each_layer_on_its_step(pool2, kind, reentrant):
    # (the Trainer enables it on a model hfcp patched before): the checkpoint functions are wrapped at the next forward
    for r in pool2.run(W.interleaved, kind, reentrant, True, 16, "transformers_after"):
        assert "error" not in r and r["grad_err"] < 1e-5 and r["restored"], r


@pytest.mark.parametrize("kind, reentrant", [("mamba2", False), ("zamba", True)])
def test_checkpoint_wrapper_recomputes_each_layer_on_its_step(pool2, kind, reentrant):
    # torch's checkpoint_wrapper (FSDP activation checkpointing) applied after hfcp.patch: its checkpoint_fn carries
    # the step too (Zamba's mask is positional, detached by the reentrant recompute: attention takes the carried step)
    for r in pool2.run(W.interleaved, kind, reentrant, True, 16, "wrapper"):
        assert "error" not in r and r["grad_err"] < 1e-5 and r["restored"], r


def test_a_recompute_by_a_checkpoint_hfcp_does_not_know_is_refused(pool2):
    # torch's composable checkpoint recomputes the layer in backward without a checkpoint function hfcp can wrap
    for r in pool2.run(W.interleaved, "jamba", False, True, 24, "composable"):
        assert "recomputed in backward by a checkpoint function hfcp does not know" in r.get("error", ""), r


def test_gated_delta_packed_rows_are_refused(pool2):
    for r in pool2.run(W.compare, "qwen3_next", "packed"):
        assert "packed rows" in r.get("refused", "") and "recurrent scan crosses document boundaries" in r["refused"], r


def test_gated_delta_single_row_with_padding(pool2):
    for r in pool2.run(W.compare, "qwen3_next", "one_row_padding"):
        _exact(r)


def test_gated_delta_cache_is_refused(pool2):
    for r in pool2.run(W.cached_forward, "qwen3_next"):
        assert "recurrent layers do not carry their states" in r, r  # before any layer runs (hfcp.inference.generate)


@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2", "mamba"])  # the delta rule's fold, the decay ones
def test_state_exchange_volume_matches_what_is_sent(pool2, kind):
    # hfcp.attention.volume's conv halo and state fold bytes (forward half) against what the forward all-gathered
    for r in pool2.run(W.gathered_bytes, kind):
        assert r["conv_sent"] > 0 and r["conv_sent"] == r["conv_formula"], r
        assert r["fold_sent"] > 0 and r["fold_sent"] == r["fold_formula"], r


def test_a_delta_rule_layer_of_another_form_is_refused(pool2):
    # a transformers version (or a user's subclass) whose layer mixes tokens in code hfcp does not reproduce
    for r in pool2.run(W.changed_form):
        assert "is not the code hfcp verified" in r, r


@pytest.mark.parametrize("kind, strategy", [("mamba2", "allgather")])  # no attention layer at all
def test_mamba2_layers_equal_the_unpatched_model(pool2, kind, strategy):
    # Mamba-2's scan (state head_dim x state, a scalar decay per head) through the same fold; mamba2 has no attention
    for r in pool2.run(W.compare, kind, "padding", strategy):
        _exact(r)
        assert r["restored"], r


def test_mamba2_at_cp4_under_gradient_checkpointing(pool4):
    for r in pool4.run(W.compare, "bamba", "padding", "ring", "checkpointing"):
        _exact(r)


def test_mamba1_layers_equal_the_unpatched_model(pool2):
    # Mamba 1's selective scan (state channels x state size, a decay per channel and state index, the gate z applied
    # after the correction); mamba has no attention
    for r in pool2.run(W.compare, "mamba", "padding", "allgather"):
        _exact(r, chunked=False)
        assert r["restored"], r


def test_mamba1_hybrid_at_cp4_under_gradient_checkpointing(pool4):
    for r in pool4.run(W.compare, "jamba", "padding", "ring", "checkpointing"):  # Mamba 1 beside attention and MoE
        _exact(r, chunked=False)


@pytest.mark.parametrize("kind, strategy", [("minimax", "ulysses"), ("recurrent_gemma", "ring")])
def test_lightning_attention_and_rg_lru_equal_the_unpatched_model(pool2, kind, strategy):
    # MiniMax's lightning attention (blocks of 8 tokens, cut by the runs) beside softmax attention and MoE; RG-LRU
    # blocks beside sliding-window attention
    for r in pool2.run(W.compare, kind, "padding", strategy):
        _exact(r, chunked=False)
        assert r["restored"], r


@pytest.mark.parametrize("kind", ["minimax", "recurrent_gemma"])
def test_lightning_attention_and_rg_lru_at_cp4_under_gradient_checkpointing(pool4, kind):
    for r in pool4.run(W.compare, kind, "padding", "ring", "checkpointing"):
        _exact(r, chunked=False)


def test_a_family_whose_code_hfcp_has_not_seen_is_refused():
    # the layers whose code hfcp runs on views (RecurrentGemma) or reproduces (MiniMax) are fingerprinted: a class of
    # the same name with other code (a newer transformers, a user's subclass) is refused before anything is bound
    from hfcp.patches import minimax, recurrent_gemma

    for name, make in [("MiniMaxLightningAttention", minimax.lightning_forward),
                       ("RecurrentGemmaRglru", recurrent_gemma.rg_lru_forward),
                       ("RecurrentGemmaRecurrentBlock", recurrent_gemma.block_forward)]:
        other = type(name, (torch.nn.Module,), {"forward": lambda self, x: x.flip(1)})
        with pytest.raises(ValueError, match="is not the code hfcp verified"):
            make(None, other(), None)


def test_a_scan_kernel_hfcp_has_not_seen_is_refused(monkeypatch):
    # a recurrent record fingerprints the scan kernel its forward calls too (hfcp runs that kernel per run and folds
    # the states): a changed kernel in the family module is refused, as is a changed forward (changed_form)
    import sys

    from hfcp.families.registry import REGISTRY
    from hfcp.testing.tiny import tiny_model

    model = tiny_model("qwen3_next")
    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet")
    (_, make_forward), = REGISTRY.get("qwen3_next").mixers
    family = sys.modules[type(layer).__module__]
    kernel = family.torch_chunk_gated_delta_rule
    monkeypatch.setattr(family, "torch_chunk_gated_delta_rule", lambda *a, **k: kernel(*a, **k))
    with pytest.raises(ValueError, match="Qwen3NextGatedDeltaNet.torch_chunk_gated_delta_rule is not the code hfcp "
                                         "verified"):
        make_forward(None, layer, None)


def test_a_layer_without_a_mixer_needs_its_record_to_vouch_for_it():
    # Nemotron-H's MLP / MoE layers hold no mixer: its record names their classes as token-wise; without them (a
    # record that does not know the family) the model is refused by name
    from hfcp.families.introspect import other_mixers
    from hfcp.testing.tiny import tiny_model

    model = tiny_model("nemotron_h")
    kinds = ("NemotronHAttention",), ("NemotronHMamba2Mixer",)
    assert "mixes tokens without attention" in other_mixers(model, *kinds)
    assert other_mixers(model, *kinds, ("NemotronHMLP", "NemotronHMoE")) is None
    assert "mixes tokens without attention" in other_mixers(model, *kinds, ("NemotronHMLP",))  # the MoE layer


def test_a_scan_tensor_argument_hfcp_does_not_split_is_refused():
    import torch

    from hfcp.mixers.scans import refuse_unknown_tensors

    refuse_unknown_tensors({"D": torch.ones(4), "dt_limit": (0.0, 1.0), "z": None}, ("D", "dt_bias"))  # known: fine
    with pytest.raises(ValueError, match=r"tensor arguments \['z'\]"):  # a per-token gate the runs would not cut
        refuse_unknown_tensors({"D": torch.ones(4), "z": torch.ones(2, 8, 4, 6)}, ("D", "dt_bias"))


def test_a_kernel_whose_state_is_not_the_folded_form_is_refused():
    import torch

    from hfcp.layout import Layout, build_step_batch
    from hfcp.mixers.state_fold import chunked_rule_over_ranks

    def rule(q, k, v, g, initial_state, output_final_state):  # a state of another layout: (B, H, dv + dk, dk)
        return v, initial_state.transpose(-1, -2)

    step = build_step_batch(Layout(16, 2, True), 0, 1, None, None, torch.device("cpu"))
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(RuntimeError, match="not the form hfcp folds"):  # raised before any collective
        chunked_rule_over_ranks(rule, q, q, torch.randn(1, 8, 2, 3), {"g": torch.zeros(1, 8, 2)}, step, None)



def test_gated_delta_fp32_rounding_is_the_kernels_own(pool2):
    """Against a float64 truth whose gated delta kernel runs in float64 too (transformers' torch kernel computes in
    fp32 whatever the model's dtype), hfcp's fp32 gradients are as close as the one-device fp32 model's whose kernel
    chunks are hfcp's runs (the fold adds no rounding of its own: with its states rounded through bf16, 1.4x), and
    closer than the one-device model's at its default chunks of 64: the kernel's rounding of the decay gradients
    (A_log, dt_bias) grows with its chunk. Lara-mini at 64 tokens (runs of 16): hfcp 3.3e-4, one device 1.5e-3 (3.4e-4
    with chunks of 16). The float64 model with the kernel in fp32 (hfcp verify's reference) is 1.4e-3 off the truth:
    it shares the one-device kernel's rounding, so it sees hfcp 1.3e-3 off and the fp32 model only 2.7e-4."""
    r = pool2.run(W.kernel_precision, "lara_mini", 64)[0]
    assert r["hfcp"] < 1.2 * r["one_device_run_chunks"] and r["hfcp"] < 0.5 * r["one_device"], r
    assert r["verify_reference"] > 0.5 * r["one_device"], r  # the kernel in fp32 inside a float64 model
