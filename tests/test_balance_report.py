"""hfcp.balance_report: counted from the batch and the model's config, no forward and no process group (the patched
case reads the model's settings on a DistPool)."""
import pytest
import torch

import hfcp
import workers_balance as WB
from hfcp.attention.volume import comm_bytes
from hfcp.layout import Layout
from test_balance import brute_force_work, documents
from workers_model import tiny_model
from hfcp.attention.blocks import MaskSpec

PACKED = documents([50, 6, 9, 17, 3, 11])[None]  # 96 tokens, one long document first


def batch(position_ids=PACKED, **extra):
    ids = torch.randint(0, 64, position_ids.shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "position_ids": position_ids, **extra}


@pytest.mark.parametrize("family, masks", [
    ("llama", [(MaskSpec(True, None), 2)]),
    ("mistral", [(MaskSpec(True, 7), 2)]),  # its config's sliding window, on every layer
    ("qwen2", [(MaskSpec(True, 6), 1), (MaskSpec(True, None), 1)]),  # layer_types: one sliding, one full
])
@pytest.mark.parametrize("cp", [2, 4])
def test_report_counts_the_layout_hfcp_runs(family, masks, cp):
    """The report describes the row layout (the one hfcp runs), its counts equal a brute-force count under the model's
    masks summed over its layers, and the balanced plan is reported apart, balanced."""
    model = tiny_model(family)
    report = hfcp.balance_report(model, cp_size=cp, **batch())
    row = Layout(PACKED.shape[1], cp, zigzag=True)
    assert report["layout"] == "row"
    assert report["ranges"] == [list(row.ranges(r)) for r in range(cp)] == report["row"]["ranges"]
    assert report["tokens"] == [row.local_len] * cp
    assert report["attention_work"] == brute_force_work(row, PACKED, masks) == report["row"]["attention_work"]
    assert report["imbalance"] == max(report["attention_work"]) * cp / sum(report["attention_work"])
    assert report["imbalance"] > 1.2 or family == "mistral"  # (a window of 7 tokens: the work is nearly even)
    plan = report["balanced_plan"]
    assert plan["tokens"] == report["tokens"] and plan["imbalance"] <= 1.05
    assert plan["reason"] in ("", "the row layout is as balanced")
    assert (plan["reason"] == "") == (plan["ranges"] != report["ranges"])
    planned = Layout(PACKED.shape[1], cp, True, tuple(tuple(r) for r in plan["ranges"]))
    assert plan["attention_work"] == brute_force_work(planned, PACKED, masks)
    assert report["bytes_per_layer"] == [comm_bytes("ring", 1, row.padded_len, 4, 2, 8, cp, None, 4)] * cp


def test_report_of_a_padded_batch_of_rows():
    """Two rows of different documents and a length that pads (cu_seq_lens are read as the forward reads them)."""
    pos = torch.stack([documents([30, 20, 43]), documents([7, 86])])
    report = hfcp.balance_report(tiny_model("llama"), cp_size=4, **batch(pos))
    assert report["tokens"] == [24] * 4  # 93 tokens padded to 96
    assert report["attention_work"] == brute_force_work(Layout(93, 4, True), pos, [(MaskSpec(True, None), 2)])
    assert report["balanced_plan"]["imbalance"] <= 1.05 < report["imbalance"]
    one = hfcp.balance_report(tiny_model("llama"), cp_size=2, input_ids=batch()["input_ids"],
                              cu_seq_lens_q=torch.tensor([0, 50, 56, 65, 82, 85, 96]))
    assert one == hfcp.balance_report(tiny_model("llama"), cp_size=2, **batch())


@pytest.mark.parametrize("extra, reason", [
    ({"position_ids": torch.arange(96)[None]}, "no packed documents"),
    ({"attention_mask": torch.ones(1, 96, dtype=torch.long)}, "no packed documents"),
])
def test_rows_without_documents_report_the_row_layout_only(extra, reason):
    report = hfcp.balance_report(tiny_model("llama"), cp_size=2, **batch(**extra))
    assert reason in report["balanced_plan"]["reason"]
    assert report["balanced_plan"]["ranges"] == report["ranges"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp_size=2, balance="auto"), "balance='auto' is not one of \\['row'\\]"),
    (dict(cp_size=2, balance="zigzag"), "balance='zigzag'"),
    (dict(), "needs cp_size="),
    (dict(cp_size=0), "cp_size=0"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hfcp.balance_report(tiny_model("llama"), **kwargs, **batch())
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
        hfcp.balance_report(tiny_model("llama"), cp_size=2, position_ids=PACKED)


def test_report_reads_a_patched_models_settings(pool2):
    """A patched model: its cp_size and strategy, no cp_size= needed; the counts are those of the unpatched report."""
    for patched, unpatched in pool2.run(WB.report_of_patched, "allgather"):
        assert patched["attention_work"] == unpatched["attention_work"]
        for key in ("ranges", "attention_work", "tokens", "reason"):
            assert patched["balanced_plan"][key] == unpatched["balanced_plan"][key]
        assert patched["bytes_per_layer"] == [comm_bytes("allgather", 1, 72, 4, 2, 8, 2, None, 4)] * 2
        assert patched["bytes_per_layer"] != unpatched["bytes_per_layer"]  # ring's
