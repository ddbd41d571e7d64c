"""Vision-language models under CP (issue 18, first slice): the whole VLM patched, the merged sequence (text
embeddings with image features scattered in, positions from the rope index over the whole input_ids) sharded at
its language model's input; loss and every gradient (vision tower included) equal the unpatched model."""
import pytest
import torch

import workers_vlm as W

CASES = ["one_image", "two_images", "left_padding"]  # text-only batches: the VLM sweep runs one for every type


KINDS = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "idefics3", "smolvlm", "gemma3", "paligemma")


@pytest.mark.parametrize("kind, case", [(k, c) for k in KINDS for c in CASES]
                         + [("qwen2_vl", "video"), ("qwen2_5_vl", "video"), ("qwen3_vl", "video")])
def test_vlm_loss_and_every_gradient_equal_the_unpatched_model(pool2, kind, case):
    for r in pool2.run(W.compare, kind, case):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r
        assert r["vision_grad_err"] is None or r["vision_grad_err"] < 1e-4, r
        assert r["vision_attn"] == r["vision_attn_unpatched"], r  # the tower never runs through hfcp's CP attention
        _split(r, kind, 2)


# towers that encode each image alone: split over the ranks
SPLIT = ("llava", "internvl", "idefics3", "smolvlm", "gemma3", "paligemma")


def _split(r, kind, cp):
    if kind in SPLIT and r["images"]:
        assert r["images_seen"] == [-(-r["images"] // cp)], r  # this rank encoded its share only
    if kind.startswith("qwen"):
        assert r["images_seen"] == r["qwen_rows"], r  # the patches of this rank's images (and videos) only


@pytest.mark.parametrize("kind", ["llava", "internvl", "qwen2_5_vl", "qwen3_vl"])
def test_vlm_vision_tower_split_with_an_image_count_that_does_not_divide(pool2, kind):
    for r in pool2.run(W.compare, kind, "three_images"):  # rank 1 pads its share with a copy, dropped after
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["vision_grad_err"] < 1e-4, r
        _split(r, kind, 2)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_vlm_one_video_split_by_frames(pool2, kind):
    """A single video is one grid row (4, 4, 4): the Qwen-VL towers encode each temporal frame alone, so each rank
    encodes 2 of its 4 frames (with the split by images, every rank encoded the whole video). Qwen3.5: its language
    model a gated delta net hybrid (patches/recurrent.py), its tower Qwen3-VL's without deepstack."""
    for r in pool2.run(W.compare, kind, "one_video"):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["vision_grad_err"] < 1e-4, r
        assert r["images_seen"] == r["qwen_rows"] == [32], r


def test_vlm_one_video_split_by_frames_at_cp4(pool4):
    for r in pool4.run(W.compare, "qwen2_5_vl", "one_video"):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["vision_grad_err"] < 1e-4, r
        assert r["images_seen"] == [16], r  # one frame per rank


@pytest.mark.parametrize("model_type", ["llava_next_video", "llava_onevision", "video_llava"])
def test_vlm_videos_of_frame_towers(pool2, model_type):
    """LLaVA-NeXT-Video, LLaVA-OneVision and Video-LLaVA encode a video's frames with their image tower (along dim 0,
    so split over the ranks) and pool or concatenate them: two rows with a video of 4 frames each, one straddling
    the zigzag cut (the tiny models of the VLM sweep)."""
    import functools

    from hfcp.testing.sweeps import vlms as sweep_vlms
    from hfcp.testing.tiny_vlm import tiny_vlm, video_batch

    for r in pool2.run(sweep_vlms._compare, functools.partial(tiny_vlm, model_type), video_batch):
        assert r["result"] == "exact", r


@pytest.mark.parametrize("kind, strategy", [("qwen2_vl", "allgather"), ("qwen2_vl", "ulysses"),
                                            ("gemma3", "ulysses"), ("paligemma", "allgather")])
def test_vlm_other_strategies(pool2, kind, strategy):
    for r in pool2.run(W.compare, kind, "two_images", strategy):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


@pytest.mark.parametrize("kind", ["gemma3", "paligemma"])
def test_vlm_bidirectional_blocks_at_cp4(pool4, kind):
    # Gemma 3's image blocks (16 tokens, sliding window 6) and PaliGemma's prefix span several of the eight zigzag
    # chunks: the ring computes the blocks it would skip for causality alone
    for r in pool4.run(W.compare, kind, "one_image"):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


def test_vlm_at_cp4(pool4):
    for r in pool4.run(W.compare, "llava", "one_image"):  # the image spans three of the eight zigzag chunks
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r
        _split(r, "llava", 4)  # 2 images over 4 ranks: one each, ranks 2 and 3 encode a copy that is dropped


def test_vlm_logits_path(pool2):
    for r in pool2.run(W.compare, "qwen2_vl", "one_image", "ring", None):
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


def test_vlm_image_token_mismatch_raises_on_every_rank(pool2):
    for msg in pool2.run(W.refused, "llava", "too_few_tokens"):
        assert msg.startswith("ValueError") and "Image features and image tokens do not match" in msg, msg


@pytest.mark.parametrize("after_failed_forward", [False, True])
def test_vlm_language_model_called_alone_is_refused(pool2, after_failed_forward):
    # after an outer forward that raised before its language model, no layout is left behind to run on
    for msg in pool2.run(W.language_model_called_alone, "llava", after_failed_forward):
        assert "call the patched outer model" in msg, msg


def test_vlm_text_model_with_dynamic_rope(pool2):
    # 40 tokens against a context of 32: the language model's rotary follows the whole sequence's largest position
    for r in pool2.run(W.compare, "llava", "one_image", "ring", "auto", "dynamic_rope"):
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


def test_vlm_takes_its_text_family_knowledge(pool2):
    # llama4_text's attention-temperature limit (floor_scale 4) applies inside a VLM as it does alone
    for msg in pool2.run(W.refused, "llava", "one_image", "llama4_temperature"):
        assert "attn_temperature_tuning" in msg, msg


def test_vlm_ranks_with_other_images_are_refused(pool2):
    for msg in pool2.run(W.refused, "llava", "other_image_on_rank_1"):
        assert "got different batches (pixel_values)" in msg, msg


def test_vlm_deepstack_side_inputs_at_cp4_and_with_ulysses(pool4, pool2):
    # Qwen3-VL: visual_pos_masks and the deepstack rows of each rank's visual tokens (rows in row-major order of
    # the local mask); rows given to the wrong tokens were 1.4 off in gradients
    for r in pool4.run(W.compare, "qwen3_vl", "two_images"):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r
    for r in pool2.run(W.compare, "qwen3_vl", "video", "ulysses"):
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


@pytest.mark.parametrize("kw, message", [
    (dict(visual_pos_masks=torch.ones(2, 8, dtype=torch.bool), deepstack_visual_embeds=[torch.zeros(15, 4)]),
     "for the 16 positions of visual_pos_masks"),
    (dict(visual_pos_masks=torch.ones(2, 8, dtype=torch.long)), "must be a bool tensor"),
    (dict(deepstack_visual_embeds=[torch.zeros(3, 4)]), "without visual_pos_masks"),
])
def test_vlm_side_inputs_that_do_not_match_the_sequence_are_refused(kw, message):
    from hfcp.hooks.side_inputs import check_side_inputs

    with pytest.raises(ValueError, match=message):
        check_side_inputs(torch.nn.Identity(), kw, (("visual_pos_masks", "deepstack_visual_embeds"),), (2, 8))


# the language model patched alone (hfcp.patch(model.model.language_model)), the outer model called with its vision
# tower whole on every rank: the loss from the gathered logits and every gradient equal the unpatched model's
INNER_CASES = [("qwen3_vl", "two_images"), ("qwen3_vl", "video"), ("qwen3_vl_moe", "two_images"),
               ("qwen3_5", "video"), ("llava", "one_image"), ("gemma3", "left_padding"), ("idefics3", "two_images")]


@pytest.mark.parametrize("kind, case", INNER_CASES)
def test_vlm_language_model_patched_alone_is_exact(pool2, kind, case):
    # Qwen3-VL: the outer model passes the whole sequence's visual_pos_masks and deepstack rows, split as on the
    # whole-model path (an IndexError in _deepstack_process before); the language model holds half the tokens
    import workers_vlm_inner as WI

    for r in pool2.run(WI.compare, kind, case):
        assert r["local_len"] == r["seq_len"] // 2, r
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["logits_err"] < 1e-5 and r["grad_err"] < 1e-4, r
        assert r["vision_grad_err"] < 1e-4, r


@pytest.mark.parametrize("kind, what, message", [
    # the outer model would compare this rank's shard of the logits with the whole labels (a raw batch-size
    # ValueError from torch's cross entropy before)
    ("qwen3_vl", "labels", "Qwen3VLForConditionalGeneration was called with labels, but only its Qwen3VLTextModel "
                           "is hfcp-patched"),
    ("llava", "labels", "call it with labels=None and compute the loss from the whole logits, "
                        "hfcp.gather_sequence(out.logits, language_model)"),
    # a whole-sequence tensor hfcp does not know how to split, by name: from the outer model, and passed directly
    ("qwen3_vl", "unknown_side_input", "Qwen3VLTextModel got ['visual_pos_masks'], tensors of the whole sequence "
                                       "(2, 40)"),
    ("llava", "direct_extra_tensor", "LlamaModel got ['extra_states'], tensors of the whole sequence (2, 40)"),
    # the outer model's MoE router aux loss would be taken over this rank's router logits (silently, before)
    ("qwen3_vl_moe", "router_logits", "it would compute the MoE router aux loss from this rank's tokens only. Pass "
                                      "output_router_logits=False"),
])
def test_vlm_language_model_patched_alone_refuses_what_it_cannot_split(pool2, kind, what, message):
    import workers_vlm_inner as WI

    for msg in pool2.run(WI.refused, kind, what):
        assert msg.startswith("ValueError") and message.lower() in msg.lower(), msg
