"""hfcp.balance_report: counted from the batch and the model's config, no forward and no process group (the patched
case reads the model's settings on a DistPool)."""
import pytest
import torch

import hfcp
import workers_balance as WB
from hfcp.attention.volume import comm_bytes
import hfcp.layout.work
from hfcp.layout import Layout, build_step_batch
from test_balance import brute_force_work, documents
from workers_model import tiny_model
from hfcp.layout.masks import MaskSpec

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
    """balance="auto" (patch's default): the balanced layout when it gains, its counts equal to a brute-force count
    under the model's masks summed over its layers; "row" the zigzag layout, counted the same way."""
    model = tiny_model(family)
    report = hfcp.balance_report(model, cp_size=cp, **batch())
    row = Layout(PACKED.shape[1], cp, zigzag=True)
    assert report["row"]["layout"] == "row" and report["row"]["ranges"] == [list(row.ranges(r)) for r in range(cp)]
    assert report["row"]["tokens"] == report["tokens"] == [row.local_len] * cp
    assert report["row"]["attention_work"] == brute_force_work(row, PACKED, masks)
    row_work = report["row"]["attention_work"]
    assert report["row"]["imbalance"] == max(row_work) * cp / sum(row_work)
    assert report["row"]["imbalance"] > 1.2 or family == "mistral"  # (a window of 7 tokens: the work is nearly even)
    used = Layout(PACKED.shape[1], cp, True, tuple(tuple(r) for r in report["ranges"]) if report["layout"] == "balanced"
                  else None)
    assert report["attention_work"] == brute_force_work(used, PACKED, masks) and report["imbalance"] <= 1.05
    assert report["layout"] == ("balanced" if report["reason"] == "" else "row")
    assert report["reason"] in ("", "the row layout is as balanced") and (family == "mistral" or not report["reason"])
    assert report["bytes_per_layer"] == [comm_bytes("ring", 1, row.padded_len, 4, 2, 8, cp, None, 4)] * cp
    as_row = hfcp.balance_report(model, cp_size=cp, balance="row", **batch())
    assert {**as_row, "reason": ""} == {**report["row"], "reason": "", "row": report["row"]}


def test_report_of_a_padded_batch_of_rows():
    """Two rows of different documents and a length that pads (cu_seq_lens are read as the forward reads them)."""
    pos = torch.stack([documents([30, 20, 43]), documents([7, 86])])
    report = hfcp.balance_report(tiny_model("llama"), cp_size=4, **batch(pos))
    assert report["tokens"] == [24] * 4  # 93 tokens padded to 96
    assert report["row"]["attention_work"] == brute_force_work(Layout(93, 4, True), pos, [(MaskSpec(True, None), 2)])
    assert report["layout"] == "balanced" and report["imbalance"] <= 1.05 < report["row"]["imbalance"]
    one = hfcp.balance_report(tiny_model("llama"), cp_size=2, input_ids=batch()["input_ids"],
                              cu_seq_lens_q=torch.tensor([0, 50, 56, 65, 82, 85, 96]))
    assert one == hfcp.balance_report(tiny_model("llama"), cp_size=2, **batch())


@pytest.mark.parametrize("extra, reason", [
    ({"position_ids": torch.arange(96)[None]}, "no packed documents"),
    ({"attention_mask": torch.ones(1, 96, dtype=torch.long)}, "no packed documents"),
    ({"balance": "row"}, "balance='row'"),
])
def test_the_row_layout_and_why(extra, reason):
    report = hfcp.balance_report(tiny_model("llama"), cp_size=2, **batch(**extra))
    assert report["layout"] == "row" and reason in report["reason"]
    assert report["ranges"] == report["row"]["ranges"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp_size=2, balance="zigzag"), "balance='zigzag' is not one of \\['auto', 'row'\\]"),
    (dict(), "needs cp_size="),
    (dict(cp_size=0), "cp_size=0"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hfcp.balance_report(tiny_model("llama"), **kwargs, **batch())
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
        hfcp.balance_report(tiny_model("llama"), cp_size=2, position_ids=PACKED)


@pytest.mark.parametrize("ids, message", [
    (torch.zeros(96, dtype=torch.long), "input_ids has shape \\(96,\\); hfcp needs \\(batch, seq\\)"),
    (torch.zeros(0, 96, dtype=torch.long), "a batch of no rows"),
    (torch.zeros(1, 0, dtype=torch.long), "input_ids has shape \\(1, 0\\): no tokens"),
])
def test_a_batch_the_forward_refuses_is_refused(ids, message):
    """The same checks of the batch's shape as the patched forward's, not an IndexError or a report of nothing."""
    with pytest.raises(ValueError, match=message):
        hfcp.balance_report(tiny_model("llama"), cp_size=2, input_ids=ids)


def test_report_reads_a_patched_models_settings(pool2):
    """A patched model: its cp_size, strategy and balance setting, no cp_size= needed; the counts are those of the
    unpatched report."""
    for patched, unpatched in pool2.run(WB.report_of_patched, "allgather"):
        for key in ("ranges", "attention_work", "tokens", "reason", "layout"):
            assert patched[key] == unpatched[key]
        assert patched["bytes_per_layer"] == [comm_bytes("allgather", 1, 72, 4, 2, 8, 2, None, 4)] * 2
        assert patched["bytes_per_layer"] != unpatched["bytes_per_layer"]  # ring's
    for patched in pool2.run(WB.report_of_patched, "ring", "row"):
        assert patched[0]["layout"] == "row" and patched[0]["reason"] == "balance='row'"


def test_ulysses_shares_each_groups_work(pool2):
    """Ulysses' all-to-all gives each rank every query of its group for half the heads: the work is even whatever
    the layout (the ring's count of the same batch is not)."""
    for patched, ring in pool2.run(WB.report_of_patched, "ulysses", "row", "llama"):
        work = ring["row"]["attention_work"]
        assert patched["layout"] == "row" and patched["attention_work"] == [sum(work) / 2] * 2, (patched, work)
        assert patched["imbalance"] == 1.0 and ring["row"]["imbalance"] > 1.2, (patched, ring)


def test_usp_work_is_the_mean_of_each_ulysses_group():
    """usp at cp 4 with Ulysses groups of 2 ranks ({0, 1}, {2, 3}): each rank does its group's mean work."""
    layout = Layout(PACKED.shape[1], 4, zigzag=True)
    work = hfcp.layout.work.position_work([(MaskSpec(True, None), 1)],
                                          build_step_batch(layout, 0, 1, PACKED, None, "cpu"))
    own = hfcp.layout.work.rank_work(layout, work)
    pairs = [(own[0] + own[1]) / 2] * 2 + [(own[2] + own[3]) / 2] * 2
    assert (hfcp.layout.work.rank_work(layout, work, 2) == pairs
            and hfcp.layout.work.rank_work(layout, work, 4) == [sum(own) / 4] * 4)
    assert hfcp.layout.work.ulysses_width("usp", 4, 2) == 2 and hfcp.layout.work.ulysses_width("ulysses", 4, None) == 4
    assert hfcp.layout.work.ulysses_width("ring", 4, None) == hfcp.layout.work.ulysses_width("allgather", 4, None) == 1


def test_patch_refuses_an_unknown_balance():
    """Refused from the arguments alone (so on every rank alike, before any collective), naming the choices."""
    with pytest.raises(ValueError, match="balance='zigzag' is not one of \\['auto', 'row'\\]"):
        hfcp.patch(tiny_model("llama"), cp_size=2, balance="zigzag")


def test_step_imbalance_is_none_without_cp():
    """An unpatched model's forward (one process): nothing to report, so the trainers log no cp_imbalance."""
    model = tiny_model("llama")
    model(**batch())
    assert hfcp.step_imbalance(model) is None
