"""Masks built outside the patched model (issue 22, item 2): the natural workaround for a vision-language model,
patching its language model alone, is exact where the outer model's mask is one hfcp reproduces, and refused on
every rank with the reason where it is not (never silently wrong, never a raw error)."""
import pytest

import workers_outer_masks as W


@pytest.mark.parametrize("kind, token_types, padding", [
    ("llava_onevision", False, True),   # Qwen2 builds its own mask; logits_to_keep=0 reaches attention: accepted
    ("gemma3", False, True),            # a dict of full and sliding masks with key padding: exact
    ("gemma3", False, False),
    # bidirectional blocks (block_sequence_ids from token_type_ids): PaliGemma's prefix-LM block (silently wrong
    # before session 6, then refused), Gemma 3's image blocks with its sliding windows
    ("paligemma", True, False),
    ("paligemma", True, True),
    # PaliGemma's Gemma is built bidirectional (use_bidirectional_attention) but runs the causal mask it is given
    ("paligemma", False, True),
    ("gemma3", True, True),
])
def test_outer_mask_hfcp_reproduces_is_exact(pool2, kind, token_types, padding):
    for r in pool2.run(W.patched_language_model, kind, token_types, padding):
        assert r["error"] is None, r
        assert r["same_keys"] and r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


@pytest.mark.parametrize("kind, message", [
    ("float_4d", "attention_mask of shape (1, 1, 12, 12) cannot be split exactly"),
    ("custom_overlay", "a mask with overlays (bidirectional image or prefix blocks"),
    ("window_differs", "but the layer itself has sliding_window=None"),
    ("dict_padding_differs", "a dict of masks whose key padding differs between entries"),
])
def test_prepared_masks_are_refused_on_every_rank(pool2, kind, message):
    for msg in pool2.run(W.prepared_mask, kind):
        assert message in msg, msg


def test_an_outer_mask_for_a_chunked_attention_layer_is_refused(pool2):
    for msg in pool2.run(W.chunked_layer_outer_mask):
        assert "attends in chunks of" in msg, msg
