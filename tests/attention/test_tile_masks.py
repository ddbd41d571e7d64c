"""Bidirectional blocks (transformers' block_sequence_ids: Gemma 3's image blocks, PaliGemma's prefix) in hfcp's
block-sparse planner, single process: the forms hfcp's mask builder reads from transformers' mask functions, the
tile masks against those functions evaluated densely, and the planner's skip / full / causal decisions never
claiming what the dense mask contradicts (a block straddling a range boundary included)."""
import pytest
import torch
from transformers import masking_utils as mu

from hfcp.attention.tiles import _allowed, _classify
from hfcp.layout.masks import MaskSpec
from hfcp.layout import Layout, StepBatch
from hfcp.attention.outer_mask import hfcp_mask, layer_mask

L = 24


def _blocks():
    ids = torch.full((2, L), -1)
    ids[0, 3:9], ids[0, 14:21] = 0, 1      # two images in row 0
    ids[1, 9:17] = 0                         # one in row 1, across the middle
    return ids


FUNCTIONS = {  # name: (transformers' mask function, the form hfcp must read: window, blocks mode)
    "causal": (lambda b: mu.causal_mask_function, (None, None)),
    "causal_or_blocks": (lambda b: mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(b)), (None, "windowed")),
    # Gemma 3's sliding layers: AND(sliding_window, OR(causal, blockwise))
    "gemma3_sliding": (lambda b: mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(b)),
                                              mu.sliding_window_overlay(4)), (4, "windowed")),
    # create_sliding_window_causal_mask(block_sequence_ids=...): OR(sliding causal, blockwise)
    "sliding_or_blocks": (lambda b: mu.or_masks(mu.sliding_window_causal_mask_function(4), mu.blockwise_overlay(b)),
                          (4, "whole")),
}


def _dense(fn, batch):
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None, :]
    return torch.stack([fn(torch.tensor(b), torch.tensor(0), q, k).expand(L, L) for b in range(batch)])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("padded", [False, True])
def test_block_masks_equal_transformers_dense_mask_and_the_plan_is_sound(name, padded):
    make, (window, mode) = FUNCTIONS[name]
    ids = _blocks()
    padding = torch.ones(2, L, dtype=torch.bool)
    if padded:
        padding[1, :4] = False
    form = hfcp_mask(2, L, L, mask_function=make(ids), attention_mask=padding if padded else None,
                     allow_is_causal_skip=mode is None)
    assert form.form == ("causal" if window is None else "sliding") and form.window == window, form
    assert layer_mask(torch.nn.Identity(), {None: form}, True, window) == (True, window, mode)
    want = _dense(make(ids), 2) & padding[:, None, :]  # (B, L, L)
    sb = StepBatch(Layout(L, 2, True), 0, None, padding if padded else None, blocks=ids if mode else None)
    spec = MaskSpec(True, window, blocks=mode)
    got = _allowed(spec, sb, 0, L, 0, L, "cpu")[:, 0]
    assert torch.equal(got.expand_as(want), want), (got != want).nonzero()[:5]
    for qs in range(0, L, 5):  # ranges of 5 (a block straddles their boundaries): the plan never contradicts
        for ks in range(0, L, 5):
            ql, kl = min(5, L - qs), min(5, L - ks)
            kind, only_causal = _classify(spec, sb, qs, ql, ks, kl)
            tile = want[:, qs:qs + ql, ks:ks + kl]
            if kind == "skip":
                assert not tile.any(), (qs, ks)
            elif kind == "full":
                assert tile.all(), (qs, ks)
            elif only_causal:
                causal = torch.arange(ks, ks + kl)[None] <= torch.arange(qs, qs + ql)[:, None]
                assert torch.equal(tile, causal.expand_as(tile)), (qs, ks)
