"""Inference calls on a patched model (issue 20): the logits of the last positions (`logits_to_keep`), the
commonest inference call, the same on every rank."""
import pytest

import workers_inference as W


@pytest.mark.parametrize("kind, keep", [("llama", 1), ("mistral", 3), ("gemma2", 1), ("llama", 20), ("llama", 100)])
def test_logits_to_keep_gives_the_last_positions_on_every_rank(pool2, kind, keep):
    # under zigzag the last positions are rank 0's; every rank gets them, and the gradients of their sum are exact
    # (mistral: a sliding window; gemma2: softcapping after the head; 20: the local length; 100 > the 37 tokens: all)
    for r in pool2.run(W.last_logits, kind, keep):
        assert r["shape"] == r["want_shape"] and r["err"] < 1e-5 and r["grad_err"] < 1e-4, r
        assert not r["stamped"] and r["whole"], r  # not a local sequence: gather_sequence and the Trainer leave it


def test_logits_to_keep_at_cp4(pool4):
    for r in pool4.run(W.last_logits, "llama", 2):
        assert r["shape"] == r["want_shape"] and r["err"] < 1e-5 and r["grad_err"] < 1e-4, r


@pytest.mark.parametrize("call, message", [("with_labels", "logits_to_keep=1 with labels"),
                                           ("negative", "logits_to_keep=-1 is not supported"),
                                           ("base_model", "whose forward has no logits_to_keep of its own"),
                                           ("head_by_hand", "did not call its output head module")])
def test_logits_to_keep_hfcp_cannot_honour_is_refused(pool2, call, message):
    for msg in pool2.run(W.refusal, call):
        assert message in msg, msg


# model.generate on a patched model (issue 20): the prompt prefilled over the CP group, each rank keeping its tokens'
# keys and values (hfcp/inference/kv_cache.py), each decode step merged over the ranks (hfcp/attention/decode.py); two
# prompts, one left-padded; against the unpatched model's generate in the same process: the same tokens on every rank,
# and every step's logits within fp32 tolerance
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss", "mixtral", "llama_dynamic"])
def test_greedy_generation_equals_the_unpatched_model(pool2, kind):
    # mistral: a window of 7 over 300 columns; gemma2: attention and final softcaps, sliding layers; gpt_oss: sinks;
    # mixtral: MoE with output_router_logits on; llama_dynamic: dynamic NTK RoPE, whose frequencies change past 64,
    # during the decode steps of a 60-token prompt
    for r in pool2.run(W.generated, kind, 60 if kind == "llama_dynamic" else 300):
        assert r["same_tokens"] and r["new_tokens"] == 8 and r["logit_err"] < 1e-5, r
        # each rank holds half of what transformers' cache holds (sliding layers: their window only, as there)
        assert r["cache"] == "ShardedKVCache" and r["kv_bytes"] <= r["ref_kv_bytes"] / 2 * 1.05, r  # (+ an odd token)


@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
def test_generation_after_a_prefill_of_another_strategy(pool2, strategy):
    for r in pool2.run(W.generated, "mistral", 300, 8, 5, False, False, strategy):
        assert r["same_tokens"] and r["logit_err"] < 1e-5, r


def test_generation_of_a_long_prompt_at_cp4_keeps_a_quarter_of_the_cache(pool4):
    for r in pool4.run(W.generated, "llama", 2000):
        assert r["same_tokens"] and r["logit_err"] < 1e-5, r
        assert r["kv_bytes"] <= r["ref_kv_bytes"] / 4 * 1.01, r  # each rank: its prompt tokens, and every 4th new one


def test_sampling_with_a_seed_shared_over_the_group_and_eos_stopping(pool2):
    for r in pool2.run(W.generated, "qwen2", 300, 8, 5, True):
        assert r["same_tokens"] and r["logit_err"] < 1e-5, r
    for r in pool2.run(W.generated, "llama", 300, 8, 5, False, True):
        assert r["same_tokens"] and r["logit_err"] < 1e-5, r


def test_a_cached_forward_then_decode_steps_by_hand(pool2):
    # use_cache=True returns hfcp's cache (the prompt's logits a local sequence, whole through gather_sequence); two
    # decode forwards with it give the unpatched model's logits
    for r in pool2.run(W.manual_steps):
        assert max(r["errs"]) < 1e-5 and r["columns"] == 47, r


def test_a_generation_continued_from_its_cache(pool2):
    # the returned cache fed back with more tokens: only the new ones run (transformers reads the cache's layers)
    for r in pool2.run(W.continued):
        assert r["same_tokens"] and r["logit_err"] < 1e-5 and r["columns"] == r["ref_columns"], r


@pytest.mark.parametrize("case, message", [
    ("beam_search", "beam search rewrites the KV cache"),
    ("prompt_lookup", "requires a cache that can be cropped"),  # transformers refuses it: not croppable
    ("static_cache", "a StaticCache holding 0 tokens on a patched model"),
    ("differing_prompts", "ranks of one CP group got different batches (input_ids)"),
    ("max_time", "would stop each rank of a CP group by its own clock"),
    ("unshared_seed", "the ranks of a CP group chose different tokens"),
    ("packed_prompt", "a prompt of packed documents (position_ids that restart inside a row) with a KV cache")])
def test_generation_hfcp_cannot_do_is_refused_on_every_rank(pool2, case, message):
    for msg in pool2.run(W.generate_refusal, case):
        assert message in msg, msg


@pytest.mark.parametrize("kind, message", [("qwen3_next", "recurrent layers do not carry their states")])
def test_generation_of_models_hfcp_does_not_generate_with_is_refused(pool2, kind, message):
    for msg in pool2.run(W.refused_generation, kind):
        assert message in msg, msg


# ---- vision-language models ------------------------------------------------------------------------------------
import workers_vlm_generate as G  # noqa: E402


@pytest.mark.parametrize("kind, case", [("llava", "one_image"), ("qwen2_vl", "two_images"), ("qwen2_vl", "video"),
                                        ("qwen3_vl", "one_image"), ("internvl", "one_image"), ("idefics3", "one_image"),
                                        ("llava", "left_padding"), ("qwen2_vl", "text_only")])
def test_vlm_greedy_generation_equals_the_unpatched_model(pool2, kind, case):
    """The merged prompt (image or video features scattered in) prefilled over the CP group with the tower split,
    mRoPE positions continued from the rope index (Qwen-VL), deepstack side inputs (Qwen3-VL): the same tokens,
    each rank caching its half of the prompt."""
    for r in pool2.run(G.vlm_generated, kind, case):
        assert r["same"] and r["new"] == 6, r
        assert r["here"] <= (40 + 1) // 2 + 3, r  # about half the 40-token prompt, plus its share of new tokens
        assert r["columns"] == 40 + 5, r  # the last chosen token is not run


@pytest.mark.parametrize("kind", ["gemma3", "paligemma"])
def test_vlm_generation_with_bidirectional_blocks_is_refused(pool2, kind):
    for msg in pool2.run(G.vlm_refused, kind, "one_image"):
        assert "generate() with token_type_ids" in msg, msg


# ---- models whose cache transformers handles in its own way (tests/inference/workers_generate.py)
import workers_generate as GEN  # noqa: E402


@pytest.mark.parametrize("kind, is_decoder, pad", [("bert", False, 0), ("electra", False, 3),
                                                   ("bert_generation", False, 0), ("bert", True, 3)])
def test_bert_family_decoders_generate_as_the_unpatched_model(pool2, kind, is_decoder, pad):
    """BertLMHeadModel, ElectraForCausalLM, BertGenerationDecoder as causal LMs: without config.is_decoder they attend
    bidirectionally and fill the cache generate() passes but return none; each decode step's one token attends to
    every cached key. hfcp returns its own cache, so the steps are decode steps over it (they were fresh one-token
    prompts): the same tokens and scores."""
    for r in pool2.run(GEN.generated, kind, 17, 6, pad, is_decoder):
        assert r["same_tokens"] and r["score_err"] < 1e-5, r
        assert r["cache"] == "ShardedKVCache" and r["columns"] == 17 + 5, r


def test_bert_decode_steps_by_hand_of_one_token_and_more_refused(pool2):
    for r in pool2.run(GEN.steps_by_hand, "bert", [1, 1]):
        assert max(r["errs"]) < 1e-5 and r["columns"] == 19, r
    for r in pool2.run(GEN.steps_by_hand, "bert", [3]):  # (the unpatched model fails on it too)
        assert "attends bidirectionally: a decode step of 3 new tokens" in r["refused"], r


@pytest.mark.parametrize("pad", [0, 3])
def test_moshi_generates_with_the_window_its_cache_keeps(pool2, pad):
    """Moshi's mask does not apply config.sliding_window (7), but transformers' cache keeps the last 6 keys of each
    layer only: the 17-token prompt's decode steps see those (hfcp kept every key: the unpatched uncached tokens)."""
    for r in pool2.run(GEN.generated, "moshi", 17, 6, pad):
        assert r["same_tokens"] and r["score_err"] < 1e-5, r


def test_moshi_decode_steps_by_hand_keep_the_window(pool2):
    # the model builds its cache from its config (no cache given); a 3-token step sees the 6 kept keys and its own
    for r in pool2.run(GEN.steps_by_hand, "moshi", [3, 1]):
        assert max(r["errs"]) < 1e-5 and r["columns"] == 21, r


def test_llava_onevision_generates_as_the_unpatched_model(pool2):
    """Its outer forward passes logits_to_keep down to Qwen2's attention in decode steps (refused before)."""
    for r in pool2.run(GEN.vlm_generated, "llava_onevision"):
        assert r["same_tokens"] and r["new"] == 6 and r["score_err"] < 1e-5, r
