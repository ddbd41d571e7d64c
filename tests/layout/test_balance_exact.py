"""balance="auto" is exact: packed rows split per document (hfcp.layout.balance) give the unpatched model's loss, logits
(gathered back into the original order) and every gradient, for every strategy at cp 2 and 4."""
import pytest

import workers_balance as WB
import workers_model as W
from test_models import _check

# rows of 29 and 38 tokens (padded to 32 and 40 at cp 2 and 4): one long document and short ones, rows that differ
DOCS_29 = [[16, 3, 4, 6], [2, 5, 20, 2]]
DOCS_38 = [[22, 2, 3, 5, 6], [4, 4, 25, 5], [1, 1, 1, 2, 30, 3]]


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window of 7
def test_balanced_cp2(pool2, family, strategy):
    results = pool2.run(W.run_case, dict(family=family, strategy=strategy, cp=2, B=2, L=29, documents=DOCS_29))
    _check(results)
    assert all(r["balanced"] for r in results)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "usp"])
def test_balanced_cp4(pool4, strategy):
    case = dict(family="mistral", strategy=strategy, cp=4, B=3, L=38, documents=DOCS_38,
                config=dict(num_key_value_heads=4, sliding_window=12))
    results = pool4.run(W.run_case, {**case, "patch": {"ulysses_size": 2} if strategy == "usp" else {}})
    _check(results)
    assert all(r["balanced"] for r in results)


def test_balance_row_keeps_zigzag(pool2):
    results = pool2.run(W.run_case, dict(family="llama", strategy="ring", cp=2, B=2, L=29, documents=DOCS_29,
                                         patch={"balance": "row"}))
    _check(results)
    assert not any(r["balanced"] for r in results)


def test_balanced_with_lora_and_gradient_checkpointing(pool2):
    """The recomputed forward runs on the step's balanced layout too."""
    results = pool2.run(W.run_case, dict(family="mistral", strategy="ring", cp=2, B=2, L=29, documents=DOCS_29,
                                         lora=True, checkpointing=True))
    _check(results)
    assert all(r["balanced"] for r in results)


def test_balanced_softcaps(pool2):
    """Gemma 2: attention and final logit softcaps, sliding and full layers, GQA. (GPT-OSS, with sinks, is left out:
    transformers' own GPT-OSS lets packed documents attend across each other, under either layout.)"""
    for r in pool2.run(WB.family_exact, "gemma2", "ring", DOCS_29):
        assert r["balanced"] and r["loss"] < 1e-5 and r["logits"] < 1e-5 and r["grad"] < 1e-4, r


def test_sequence_outputs_of_packed_rows(pool2):
    """A classifier's last-token score, logits_to_keep, hfcp.sequence_logps and gathered hidden states read each
    document where the balanced layout placed it (documents out of order on the ranks)."""
    for r in pool2.run(WB.sequence_outputs_exact, DOCS_29):
        assert r["classifier balanced"] and r["causal lm balanced"], r
        assert all(v < 1e-5 for k, v in r.items() if k.endswith(("loss", "outputs"))), r
        assert r["classifier grad"] < 1e-4 and r["causal lm grad"] < 1e-4, r
