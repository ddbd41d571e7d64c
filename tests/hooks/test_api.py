"""Single-process tests: layout arithmetic, registry, label shift, errors, world-size-1 no-op."""
import pytest
import torch
import transformers

import hfcp
from hfcp.layout import Layout, build_step_batch, document_ids
from hfcp.loss.cross_entropy import shift_labels
from hfcp.distributed.mesh import build_mesh
from workers_model import make_batch, tiny_model


def test_zigzag_layout_balances_and_covers():
    lay = Layout(seq_len=37, cp_size=4, zigzag=True)
    assert lay.padded_len == 40 and lay.chunk_len == 5
    assert lay.ranges(0) == ((0, 5), (35, 5)) and lay.ranges(3) == ((15, 5), (20, 5))
    assert sorted(lay.gathered_order().tolist()) == list(range(40))


def test_contiguous_layout():
    lay = Layout(seq_len=10, cp_size=4, zigzag=False)
    assert lay.padded_len == 12 and lay.local_index(1).tolist() == [3, 4, 5]


def test_document_ids_match_transformers():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert torch.equal(document_ids(pos), find_packed_sequence_indices(pos))


def test_step_batch_marks_padding_and_documents():
    lay = Layout(seq_len=6, cp_size=2, zigzag=True)  # padded to 8
    sb = build_step_batch(lay, 0, 1, torch.tensor([[0, 1, 0, 1, 2, 3]]), None, "cpu")
    assert sb.doc_ids.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert sb.key_valid.tolist() == [[True] * 6 + [False] * 2]
    # with an attention_mask, transformers does not detect packing: neither do we
    sb = build_step_batch(lay, 0, 1, torch.tensor([[0, 1, 0, 1, 2, 3]]), torch.ones(1, 6), "cpu")
    assert sb.doc_ids is None


def test_labels_shift_over_the_global_sequence():
    """Regression: labels shifted per shard drop the target of every shard's last token."""
    labels = torch.arange(8)[None]
    shifted = shift_labels(labels)
    assert shifted.tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    lay = Layout(8, 2, zigzag=True)
    local0 = shifted[:, lay.local_index(0)]
    assert local0.tolist() == [[1, 2, 7, -100]]  # token 1's target (2) lives in another chunk, kept


def test_unsupported_model_type_names_types_and_how_to_register():
    # BLOOM computes attention outside transformers' AttentionInterface: no record, not in the verified families
    model = transformers.BloomForCausalLM(transformers.BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=32))
    with pytest.raises(hfcp.UnsupportedModelError, match=r"model_type='bloom'.*'llama'.*register_patcher"):
        hfcp.patch(model)
    assert issubclass(hfcp.UnsupportedModelError, ValueError)


def test_unsupported_head_is_refused():
    cfg = tiny_model("llama").config  # (a sequence classifier is supported: tests/families/test_heads.py)
    model = transformers.LlamaForQuestionAnswering(cfg)
    with pytest.raises(hfcp.UnsupportedModelError, match="LlamaForQuestionAnswering.*has a head hfcp does not "
                                                         "support.*LlamaForSequenceClassification"):
        hfcp.patch(model)


def test_unknown_strategy_lists_known_ones():
    with pytest.raises(ValueError, match=r"strategy='zigzag' is not one of \['allgather', 'ring', 'ulysses', 'usp'\]"):
        hfcp.patch(tiny_model("llama"), strategy="zigzag")


@pytest.mark.parametrize("bad", [0, -8, 2.5, "big", True])
def test_bad_loss_chunk_names_the_value(bad):
    with pytest.raises(ValueError, match=f"loss_chunk={bad!r} must be a positive number of tokens, 'auto' or None"):
        hfcp.patch(tiny_model("llama"), loss_chunk=bad)


def test_register_patcher_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        hfcp.register_patcher(hfcp.Patcher(model_type="llama", attention_classes=("LlamaAttention",)))
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(hfcp.supported_model_types())


def test_world_size_one_runs_unchanged():
    model = tiny_model("llama")
    batch = make_batch(dict(B=2, L=12))
    ref = model(**batch).loss
    assert hfcp.patch(model) is model
    assert not hasattr(model, "_hfcp_state") and model.config._attn_implementation == "sdpa"
    assert torch.equal(model(**batch).loss, ref)
    logits = model(**batch).logits
    assert hfcp.gather_sequence(logits, model) is logits
    out = model(**batch)
    assert hfcp.gather_outputs(out, model) is out and torch.equal(out.logits, logits)  # unchanged, as gather_sequence
    assert hfcp.gather_outputs((logits,), model)[0] is logits


def test_world_size_in_env_without_process_group_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .*init_process_group"):
        hfcp.patch(tiny_model("llama"))


@pytest.mark.parametrize("bad", [0, -2, 2.5, "2"])
def test_bad_cp_size(bad):
    with pytest.raises(ValueError, match="cp_size"):
        build_mesh(bad)


def test_cp_size_not_dividing_world():
    with pytest.raises(ValueError, match="cp_size=2 must divide the world size 1"):
        build_mesh(2)


def test_bad_timeout():
    with pytest.raises(ValueError, match="timeout=-1"):
        build_mesh(None, timeout=-1)


def test_comm_volume_from_shapes():
    from hfcp.attention.volume import comm_bytes

    shape = dict(batch=1, seq_len=131072, heads=32, kv_heads=8, head_dim=128, cp=8)
    ring, ulysses = comm_bytes("ring", **shape), comm_bytes("ulysses", **shape)
    assert comm_bytes("usp", **shape, ulysses_size=1) == ring  # u = 1 is the ring
    assert comm_bytes("usp", **shape, ulysses_size=8) == ulysses  # u = cp is Ulysses
    kv_block = 131072 / 8 * 8 * 128  # elements of one local K block
    assert ring == 7 * 2 * kv_block * 2 * 2 + 8 * 2 * kv_block * 4
    assert comm_bytes("usp", **shape, ulysses_size=2) < ring  # the ring over 4 groups moves fewer blocks
    with pytest.raises(ValueError, match="strategy='zigzag'"):
        comm_bytes("zigzag", **shape)


def test_layout_volume_by_dimension():
    """hfcp.attention.mesh_volume: each dimension's bytes from its own collective; cp from comm_bytes over the heads
    of one TP rank; the table of docs/how-to/scaling-out.md (Llama-3-8B shape, 128k tokens, 16 GPUs)."""
    from hfcp.attention.mesh_volume import layout_bytes
    from hfcp.attention.volume import comm_bytes

    shape = dict(params=8.03e9, layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, seq_len=131072)
    alone = layout_bytes(**shape)
    assert alone == {"cp": 0.0, "tp": 0.0, "dp_shard": 0.0, "dp_replicate": 0.0}
    b = layout_bytes(**shape, dp_shard=2, cp=4, tp=2, strategy="ulysses")
    assert b["cp"] == 32 * comm_bytes("ulysses", 1, 131072, 16, 4, 128, 4)
    assert b["tp"] == 32 * 4 * 2 * (1 / 2) * (131072 / 4) * 4096 * 2  # 4 all-reduces of (L/cp, hidden) per layer
    assert b["dp_shard"] == 3 * (7 / 8) * 8.03e9 / 2 * 2  # FSDP over dp_shard x cp = 8 ranks, half the parameters
    hsdp = layout_bytes(**shape, dp_replicate=2, dp_shard=2, cp=4, strategy="ulysses")
    assert hsdp["dp_replicate"] == 2 * (1 / 2) * 8.03e9 * 2 / 8  # a rank's gradient shard, all-reduced over 2
    # docs/how-to/scaling-out.md
    assert round(b["tp"] / 2**30, 1) == 32.0 and round(hsdp["dp_replicate"] / 2**30, 1) == 1.9
    with pytest.raises(ValueError, match="tp=3 must divide"):
        layout_bytes(**shape, tp=3)


def test_the_step_mask_stand_in_refuses_a_mask_the_model_computes_from_it():
    import torch.nn.functional as F

    from hfcp.attention.step_token import step_token

    token = step_token("step", "cpu")
    assert len(token.shape) == 4 and token.dtype == torch.bool and token.to(torch.bool) is token  # what code reads
    assert token.to(torch.float32).hfcp_step == "step" and token.detach().hfcp_step == "step"  # copies stand for it
    extend = torch.zeros(2, 1, 3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"test_api\.py:\d+ \(<lambda>\) computes a new tensor from its attention "
                                         r"mask \(cat\); it failed on hfcp's stand-in: RuntimeError: Sizes"):
        (lambda: torch.cat([token, extend], dim=-1))()
    for op in (lambda: F.pad(token, (0, 3)), lambda: token[..., :1], lambda: token * 2):
        with pytest.raises(ValueError, match=r"test_api\.py:\d+ .*not supported by hfcp"):
            op()


def test_the_step_mask_stand_in_refuses_a_computed_mask_under_torch_compile_too():
    # a compiled model's operation on the stand-in breaks the graph and is checked as in eager mode (the compiled
    # graph would otherwise compute from the stand-in's one False value: silently wrong)
    from hfcp.attention.step_token import step_token

    token = step_token("step", "cpu")
    try:
        with pytest.raises(ValueError, match=r"test_api\.py:\d+ .*computes a new tensor from its attention mask"):
            torch.compile(lambda m: m[..., :1], backend="aot_eager")(token)
        copied = torch.compile(lambda m: m.to(torch.float32), backend="aot_eager")(token)
        assert copied.hfcp_step == "step"  # a copy still stands for the step's masks
    finally:
        torch._dynamo.reset()


def test_memory_options_without_cp_are_named_not_silent(caplog):
    """One process (or cp_size 1): hfcp.patch leaves the model unchanged, and says so by name when it was asked for
    tiled_mlp / offload_checkpoints (before, they were dropped without a word)."""
    import logging

    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="hfcp"):
        hfcp.patch(model, tiled_mlp=True, offload_checkpoints=True)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "hfcp"]
    assert warned and "without tiled_mlp=True, offload_checkpoints=True" in warned[0].getMessage(), caplog.text
    assert all("forward" not in m.__dict__ for m in model.modules())  # unchanged
