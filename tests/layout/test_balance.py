"""The balanced layout for packed rows (hfcp.layout.balance) and the count of attention work it balances
(hfcp.layout.work): counted, no processes. Per-rank work is checked against a brute-force count over each rank's local
indices written here from the masks' definitions (documents from position_ids resets, causal, sliding window, attention
chunks, key padding)."""

import pytest
import torch

from hfcp.layout.masks import MaskSpec
from hfcp.layout.balance import balanced_layout, plan_ranges, segment_starts
from hfcp.layout import Layout, build_step_batch, check_plan
from hfcp.layout.work import imbalance, position_work, rank_work
from hfcp.testing.packed_rows import documents, long_tail, one_long

CAUSAL = [(MaskSpec(True, None), 1)]


def plan(position_ids, cp: int, masks=CAUSAL, attention_mask=None, seq_len=None):
    """(row layout, balanced layout, per-position work) of a batch given by its (B, L) position ids."""
    B, L = position_ids.shape
    row = Layout(seq_len or L, cp, zigzag=True)
    sb = build_step_batch(row, 0, B, position_ids, attention_mask, "cpu")
    work = position_work(masks, sb)
    return row, balanced_layout(row, work, segment_starts(sb.doc_ids, row.padded_len)), work


def brute_force_work(layout: Layout, position_ids, masks, attention_mask=None) -> list[int]:
    """Each rank's allowed (query, key) pairs, summed over rows and layers, from its local indices: O(L^2) loops."""
    B, L = position_ids.shape
    P = layout.padded_len
    out = []
    for rank in range(layout.cp_size):
        total = 0
        for b in range(B):
            pos = position_ids[b].tolist()
            doc = [0] * L
            for i in range(1, L):
                doc[i] = doc[i - 1] + (pos[i] != pos[i - 1] + 1)
            packed = attention_mask is None and any(d != doc[0] for d in doc)
            valid = [i < L and (attention_mask is None or bool(attention_mask[b, i])) for i in range(P)]
            same = (lambda q, k: (doc[q] if q < L else -1) == (doc[k] if k < L else -1)) if packed else \
                (lambda q, k: True)
            for spec, layers in masks:
                for q in layout.local_index(rank).tolist():
                    for k in range(P):
                        ok = valid[k] and same(q, k) and (not spec.causal or k <= q)
                        ok = ok and (spec.window is None or q - k < spec.window)
                        if spec.chunk is not None and packed and q < L and k < L:
                            ok = ok and pos[q] // spec.chunk == pos[k] // spec.chunk
                        total += layers * ok
        out.append(total)
    return out


def assert_partition(layout: Layout):
    """Every rank holds padded_len/cp tokens and every position is held exactly once."""
    seen = torch.cat([layout.local_index(r) for r in range(layout.cp_size)])
    assert all(layout.local_index(r).numel() == layout.local_len for r in range(layout.cp_size))
    assert torch.equal(seen.sort().values, torch.arange(layout.padded_len))


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("workload, length", [("long tail", 16384), ("long tail", 32768), ("one long", 16384)])
def test_balanced_within_five_percent(workload, length, cp):
    """Slowest rank at most 1.05x the mean on packed rows where the zigzag row layout is far off."""
    make = long_tail if workload == "long tail" else one_long
    worst_row = 0.0
    for seed in range(2):
        row, balanced, work = plan(documents(make(length, seed))[None], cp)
        assert balanced.balanced
        assert_partition(balanced)
        assert imbalance(rank_work(balanced, work)) <= 1.05
        assert max(len(balanced.ranges(r)) for r in range(cp)) <= 32  # few ranges: few and large tiles
        worst_row = max(worst_row, imbalance(rank_work(row, work)))
    assert worst_row > 1.1  # the workload is one the row layout does not balance


SMALL = {  # name: (position ids (B, L), masks, attention_mask)
    "documents": (documents([5, 17, 3, 9, 30])[None], CAUSAL, None),
    "one long document and short ones": (documents([40, 3, 6, 2, 9])[None], CAUSAL, None),
    "tiny documents": (documents([1, 3, 2, 1, 3, 2, 1, 1, 3] * 4)[None], CAUSAL, None),
    "sliding window and full layers": (documents([21, 6, 33, 4])[None],
                                       [(MaskSpec(True, 7), 3), (MaskSpec(True, None), 1)], None),
    "attention chunks": (documents([25, 11, 28])[None], [(MaskSpec(True, None, chunk=8), 2)], None),
    "bidirectional": (documents([12, 30, 6, 16])[None], [(MaskSpec(False, None), 1)], None),
    "rows of different documents": (torch.stack([documents([30, 10, 24]), documents([4, 50, 10]),
                                                 torch.arange(64)]), CAUSAL, None),
    "key padding, no documents": (torch.arange(50).expand(2, -1), CAUSAL,
                                  torch.cat([torch.ones(2, 41), torch.zeros(2, 9)], 1).long()),
}


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("cp", [2, 4])
def test_counts_equal_brute_force(name, cp):
    """rank_work of both the row and the balanced layout equals pairs counted from each rank's local indices."""
    position_ids, masks, attention_mask = SMALL[name]
    seq_len = position_ids.shape[1] - (3 if name == "documents" else 0)  # a padded tail too
    position_ids = position_ids[:, :seq_len]
    mask = None if attention_mask is None else attention_mask[:, :seq_len]
    row, balanced, work = plan(position_ids, cp, masks, mask)
    for layout in (row, balanced):
        assert_partition(layout)
        assert rank_work(layout, work) == brute_force_work(layout, position_ids, masks, mask)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("name, lengths", [
    ("one document longer than half the row", [3000, 200, 500, 100, 296]),
    ("many documents shorter than 2*cp", [1, 2, 3, 1, 1, 2, 3, 2] * 512),
    ("a padded tail", [700, 1300, 90, 1900, 7]),
    ("long tail, odd length", long_tail(9999, 3, median=300)),
])
def test_edge_cases(name, lengths, cp):
    position_ids = documents(lengths)[None]
    row, balanced, work = plan(position_ids, cp)
    assert_partition(balanced)
    assert imbalance(rank_work(balanced, work)) <= 1.05
    assert max(len(balanced.ranges(r)) for r in range(cp)) <= 32


@pytest.mark.parametrize("cp", [2, 4])
def test_batch_of_rows_balanced_over_their_sum(cp):
    """Two or three rows of different documents share one layout, balanced over the rows' summed work."""
    rows = torch.stack([documents(long_tail(8192, 1)), documents([4096, 4096]), documents(one_long(8192, 2))])
    for batch in (rows[:2], rows):
        row, balanced, work = plan(batch, cp)
        assert_partition(balanced)
        assert imbalance(rank_work(balanced, work)) <= 1.05


def test_rows_without_documents_keep_the_row_layout():
    """One document per row (or none marked: an attention mask turns packing detection off, as in transformers) keeps
    zigzag, the plan's fallback when it would not gain."""
    for position_ids, mask in ((torch.arange(64)[None], None), (documents([30, 34])[None], torch.ones(1, 64).long())):
        row, balanced, work = plan(position_ids, 4, attention_mask=mask)
        assert balanced is row and not balanced.balanced
    row, balanced, work = plan(documents([32, 32])[None], 2)  # two equal documents: zigzag is as good already
    assert balanced is row


def test_plan_ranges_is_deterministic_and_merged():
    work = torch.tensor([1, 2, 3, 4, 1, 1, 1, 1, 9, 9, 1, 1, 2, 2, 2, 2])
    first = plan_ranges(work, [0, 4, 8, 10], 2)
    assert first == plan_ranges(work, [0, 4, 8, 10], 2)
    for ranges in first:
        assert all(s + n < t for (s, n), (t, _) in zip(ranges, ranges[1:]))  # ascending, adjacent ones merged
    check_plan(first, 2, 16)


@pytest.mark.parametrize("plan_, message", [
    (((0, 4),), "cp_size=2"),
    ((((0, 4),), ((4, 3),)), "holds 4 tokens"),
    ((((4, 4),), ((0, 4),)), None),
    ((((0, 4),), ((2, 4),)), "repeats position 2"),
    ((((4, 2), (0, 2)), ((2, 2), (6, 2))), "ascending"),
])
def test_bad_plans_are_refused(plan_, message):
    if message is None:
        check_plan(plan_, 2, 8)
        assert Layout(8, 2, True, plan_).ranges(1) == ((0, 4),)
        return
    with pytest.raises(ValueError, match=message):
        check_plan(plan_, 2, 8)


def test_a_balanced_layout_has_no_chunk_length():
    """What reads a chunk length (the halos of recurrent mixers) never gets a made-up one from a balanced layout."""
    plan_ = (((0, 2), (6, 2)), ((2, 4),))
    assert Layout(8, 2, True).chunk_len == 2
    with pytest.raises(ValueError, match="no chunk length"):
        Layout(8, 2, True, plan_).chunk_len
