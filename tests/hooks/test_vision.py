"""ViT, VideoMAE, ViViT under CP: patched vs unpatched tiny seeded models (logits, loss, sequence, grads)."""
import pytest
import transformers

import hfcp
import workers_vision as W

from hfcp.testing.tiny_vision import VISION_SHAPE

TOL = 1e-5


def _check(results, head):
    r = results[0]
    assert r["loss"] < TOL and r["grad"] < TOL and r["n_grads"] == r["n_ref_grads"] > 0, r
    if head == "cls":  # whole and identical on every rank: the head saw the whole sequence
        assert r["logits"] < TOL, r
        assert len({x["logits_value"] for x in results}) == 1 and len({x["loss_value"] for x in results}) == 1
    else:
        assert r["seq"] < TOL and r.get("pooler", 0.0) < TOL, r


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("head", ["cls", "base"])
@pytest.mark.parametrize("family", ["vit", "videomae", "vivit", "dinov2"])  # 17, 12, 9, 17 tokens (17 and 9 padded)
def test_vision_cp2(pool2, family, head, strategy):
    _check(pool2.run(W.run_case, dict(family=family, head=head, cp=2, strategy=strategy)), head)


@pytest.mark.parametrize("case", [
    dict(family="vit", head="cls", strategy="ring"),  # 17 tokens over 4 ranks
    dict(family="vit", head="base", strategy="ulysses"),
    dict(family="videomae", head="cls", strategy="allgather", frames=4, config=dict(num_frames=4)),  # 8 tokens
    dict(family="vivit", head="cls", strategy="ring"),
    dict(family="dinov2", head="base", strategy="ring"),  # pooler_output: the global CLS on every rank
])
def test_vision_cp4(pool4, case):
    _check(pool4.run(W.run_case, {**case, "cp": 4}), case["head"])


@pytest.mark.parametrize("head", ["cls", "base"])
def test_vit_interpolate_pos_encoding(pool2, head):
    """40x40 input on a 32x32 model: 26 tokens with interpolated position embeddings."""
    _check(pool2.run(W.run_case, dict(family="vit", head=head, cp=2, strategy="ring", size=40, interpolate=True)), head)


def test_base_model_sequence_output_is_local(pool2):
    results = pool2.run(W.run_case, dict(family="vit", head="base", cp=2, strategy="ring"))
    assert [r["local_len"] for r in results] == [9, 9]  # 17 tokens padded to 18, 9 per rank


def test_timesformer_is_refused_with_the_reason():
    cfg = transformers.TimesformerConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=64, image_size=16, patch_size=8, num_frames=2)
    with pytest.raises(hfcp.UnsupportedModelError, match="divided space-time attention"):
        hfcp.patch(transformers.TimesformerModel(cfg))


def test_videomae_pretraining_is_refused():
    cfg = transformers.VideoMAEConfig(**{**VISION_SHAPE, "image_size": 16, "patch_size": 8, "num_frames": 4,
                                         "tubelet_size": 2})
    with pytest.raises(hfcp.UnsupportedModelError, match="VideoMAEForPreTraining"):
        hfcp.patch(transformers.VideoMAEForPreTraining(cfg))


def test_checkpointed_layers_recomputed_after_a_later_forward_stay_exact(pool2):
    """17 tokens are padded to 18: the padding mask must not depend on the later forward's batch size."""
    assert max(pool2.run(W.checkpoint_recompute_after_later_forward, 2)) < TOL


def test_forward_of_another_token_count_while_a_checkpointed_graph_is_alive_is_refused(pool2):
    for refused in pool2.run(W.checkpoint_with_other_token_counts, 2):
        assert "still alive under gradient checkpointing" in refused, refused
