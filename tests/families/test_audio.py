"""Audio-language and omni models: the audio sweep over every multimodal-LM type of transformers with an audio
encoder (exact or refused, never silently wrong; every type with a record exact) and its matrix in the docs; a
text-only, left-padded row beside a row of two clips at cp 2 with allgather and at cp 4."""
import pytest

import support_matrix

from hfcp.testing.sweeps import audio as S

SWEEP = S.sweep  # what the `sweep` fixture (tests/conftest.py) runs


def test_no_audio_model_is_silently_wrong_or_crashes(sweep):
    from hfcp.patches import audio

    bad = [r for r in sweep if r["result"] in ("mismatch", "error")]
    assert not bad, bad
    exact = {r["type"] for r in sweep if r["result"] == "exact"}
    assert set(audio.AUDIO_TYPES) <= exact and len(exact) >= 8, exact  # every record shown exact by the sweep


def test_audio_matrix_is_current(sweep):
    page = support_matrix.MATRIX_PAGE.read_text()
    assert support_matrix.render_audio_table(sweep) in page, (
        "docs' audio matrix is stale: run scripts/tools/support_matrix.py")


@pytest.mark.parametrize("model_type, side", [("qwen2_audio", "left"), ("qwen2_5_omni_thinker", "left"),
                                              ("voxtral", "right")])
def test_text_row_beside_clips_cp2_allgather(pool2, model_type, side):
    for r in pool2.run(S.compare_mixed, model_type, "allgather", side, timeout=300):
        assert r["result"] == "exact", r


@pytest.mark.parametrize("model_type", ["voxtral", "qwen2_5_omni_thinker"])
def test_text_row_beside_clips_cp4(pool4, model_type):
    """Two clips over four ranks: the ranks without a clip of their own encode a stand-in and keep none of it."""
    for r in pool4.run(S.compare_mixed, model_type, "ring", timeout=300):
        assert r["result"] == "exact", r


@pytest.mark.parametrize("model_type", ["qwen2_audio", "fun_asr_nano", "qwen2_5_omni_thinker"])
def test_clips_of_different_lengths_cp2(pool2, model_type):
    """Clips padded to one length with frames masked at the end of two of them: each rank's share of the per-clip
    masks (Qwen2-Audio's 4-D one, Fun-ASR-Nano's frame mask) goes with its clips; Qwen2.5-Omni's valid frames are
    concatenated with one length per clip."""
    for r in pool2.run(S.compare_valid, model_type, "ring", timeout=300):
        assert r["result"] == "exact", r


def test_clips_of_different_lengths_cp4(pool4):
    """Three clips of different lengths over four ranks (Qwen2.5-Omni: rank 3 encodes a stand-in)."""
    for r in pool4.run(S.compare_valid, "qwen2_5_omni_thinker", "allgather", timeout=300):
        assert r["result"] == "exact", r


@pytest.mark.parametrize("model_type, shares", [
    ("qwen2_audio", [[0, 1], [2, 0]]),  # clips along dim 0: ceil(3 / 2) each, the last share padded with clip 0
    ("fun_asr_nano", [[0, 1], [2, 0]]),
    ("qwen2_5_omni_thinker", [[0, 1], [2]]),  # clips concatenated in time: whole clips, as even as can be
])
def test_each_rank_encodes_its_share_of_the_clips(pool2, model_type, shares):
    assert pool2.run(S.encoder_shares, model_type, timeout=300) == shares


@pytest.mark.parametrize("model_type", ["fun_asr_nano", "qwen2_5_omni_thinker"])
def test_encoder_called_alone_with_positional_inputs(pool2, model_type):
    """The encoder called by itself (not through the outer forward) on every rank, its second input positional:
    Fun-ASR-Nano's frame mask is not taken for a Qwen-VL grid_thw, Qwen2.5-Omni's feature_lens is found; the output
    and every layer's hidden states are the unpatched ones, and so is the output of an encoder that returns a bare
    tensor."""
    for error in pool2.run(S.encoder_called_alone, model_type, timeout=300):
        assert error < 1e-5, error


def test_encoder_with_outputs_unlike_over_ranks_raises_on_every_rank(pool2):
    """An encoder registered for splitting whose output's shape depends on the other clips of its call (trimmed to
    the longest valid one): each rank's differs, and the gather would abort gloo (read past the data on NCCL);
    hfcp compares the shapes first and raises on every rank."""
    for message in pool2.run(S.unlike_outputs_refused, timeout=300):
        assert "FunAsrNanoEncoder returned tensors of shapes" in message and "without splitting" in message, message


@pytest.mark.parametrize("model_type, name", [("qwen2_audio", "input_features"),
                                              ("qwen2_5_omni_thinker", "feature_attention_mask"),
                                              ("fun_asr_nano", "input_features_mask")])
def test_ranks_with_other_clips_are_refused(pool2, model_type, name):
    """Every rank of a CP group must get the same batch: clips or frame masks that differ on one rank (each rank
    would encode its share of its own clips, and merge a mixture) are refused on every rank, as other pixels are."""
    for message in pool2.run(S.other_clips_refused, model_type, name, timeout=300):
        assert f"got different batches ({name})" in message, message


def test_encoder_with_batch_norm_is_not_split_unless_registered_so(pool2):
    """Batch norm's training statistics are over every clip of the call: a record that splits such an encoder
    without saying so (register_per_clip_encoder(..., batch_norm=True)) is refused at patch time, on every rank."""
    for message in pool2.run(S.batch_norm_encoder_refused, timeout=300):
        assert "BatchNorm1d" in message and "model.encoder" in message and "batch_norm=True" in message, message


@pytest.mark.parametrize("model_type, mixed", [("granite_speech", False), ("granite_speech_plus", True)])
def test_batch_norm_encoder_split_with_the_groups_statistics_cp2(pool2, model_type, mixed):
    """Granite Speech's Conformer split over the ranks, its BatchNorm1d statistics summed over the group (the copy
    that pads a share counted for nothing): loss, every gradient, the running statistics and the eval loss of one
    process; each rank's encoder took its share of the clips."""
    for r in pool2.run(S.batch_norm_split, model_type, mixed, timeout=300):
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["same_keys"], r
        assert r["stats_err"] < 1e-5 and r["eval_err"] < 1e-5 and r["norms"] >= 1 and r["tracked"] == [2], r
        assert r["took"] == [1, 1] if mixed else r["took"] == [2, 2], r  # (a forward in training, one in eval)


def test_synced_batch_norm_keeps_bf16_statistics_in_fp32(pool1):
    r = pool1.run(S.synced_batch_norm_bf16)[0]
    assert r["dtype"] == "torch.bfloat16" and r["ours"] <= 2 * r["torch"], r  # (in bf16 itself: 35x torch's error)


def test_batch_norm_encoder_split_cp4(pool4):
    """Three clips over four ranks: rank 3's share is only the copy that pads it, which counts for nothing."""
    for r in pool4.run(S.batch_norm_split, "granite_speech", False, timeout=300):
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["stats_err"] < 1e-5 and r["eval_err"] < 1e-5, r


def test_images_and_clips_in_one_row_cp2(pool2):
    """Qwen2.5-Omni's thinker: an image and clips in each row (time-aligned 3-D RoPE over both), the vision tower's
    images and the audio encoder's clips split over the ranks."""
    for r in pool2.run(S.compare_omni, "ring", timeout=300):
        assert r["result"] == "exact", r
        assert r["patch_rows"][-2:] == [32, 16], r  # two images of 16 patch rows: one per rank when patched


@pytest.mark.parametrize("model_type", ["voxtral", "qwen2_audio"])
def test_placeholder_mismatch_raises_the_models_error_on_every_rank(pool2, model_type):
    """One placeholder too few for the clips' features: the model's own error, on every rank, after the encoder's
    split exchanged the features (Qwen2.5-Omni's thinker raises none unpatched: it scatters the first features)."""
    messages = pool2.run(S.placeholder_mismatch_raised, model_type, timeout=300)
    assert messages[0] == messages[1] and "Audio features and audio tokens do not match" in messages[0], messages


def test_legacy_placeholders_refused_on_every_rank(pool2):
    """One placeholder per clip (expanded inside the model) changes the sequence's length after hfcp split it."""
    for message in pool2.run(S.legacy_placeholders_refused, timeout=300):
        assert "merged sequence has" in message and "tokens but input_ids had 48" in message, message


@pytest.mark.parametrize("model_type, lora", [("voxtral", False), ("qwen2_audio", False), ("qwen2_audio", True),
                                              ("qwen2_5_omni_thinker", False)])
def test_generate_after_an_audio_prompt(pool2, model_type, lora):
    """Greedy tokens of the unpatched model, the clips split over the ranks in the prefill. Qwen2-Audio's and
    Qwen2.5-Omni's thinker's forwards take no logits_to_keep: generate()'s prefill keeps the global last position
    (also under PEFT, whose generate() swaps the model's prepare_inputs_for_generation around hfcp's)."""
    assert pool2.run(S.generate_after_clips, model_type, lora, timeout=300) == ["same tokens"] * 2


def test_cached_forward_without_logits_to_keep_refused(pool2):
    """A forward with a cache outside generate() on Qwen2-Audio would return each rank's shard of the prompt's
    logits: refused on every rank, with generate() named."""
    for message in pool2.run(S.cached_forward_raised, "qwen2_audio", timeout=300):
        assert "takes no logits_to_keep" in message and "call generate()" in message, message


@pytest.mark.parametrize("model_type", ["voxtral", "fun_asr_nano", "qwen2_audio"])
def test_generate_with_the_cache_after_an_audio_prompt(pool2, model_type):
    """With the cache (hfcp's, sharded): the unpatched model's tokens, and the encoder runs once, in the prefill
    (its clips split there), never in the decode steps."""
    assert pool2.run(S.generate_with_cache_after_clips, model_type, timeout=300) == [(True, 1)] * 2
