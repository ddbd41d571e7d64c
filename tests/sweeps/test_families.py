"""The family sweep over every causal-LM type of transformers: exact or refused, never silently wrong; and the
support matrix (docs/reference/support-matrix.md, patches/verified.py) is what a fresh sweep gives."""
import re

import support_matrix

from hfcp.testing.dist_pool import InPool
from hfcp.testing.sweeps import families as S

SWEEP = S.sweep  # what the `sweep` fixture (tests/conftest.py) runs


def START():
    """The sweep at cp 2, started with the run in a pool of its own (conftest.py: started)."""
    return InPool(2, SWEEP)


def test_no_family_is_silently_wrong_or_crashes(sweep):
    bad = [r for r in sweep if r["result"] in ("mismatch", "error")]
    assert not bad, bad
    assert sum(r["result"] == "exact" for r in sweep) >= 80, "the sweep lost families it showed exact before"


def test_generated_support_matrix_is_current(sweep):
    import transformers

    from hfcp.patches import verified

    assert transformers.__version__ == verified.TRANSFORMERS_VERSION, \
        "the family matrix was made with another transformers: run python scripts/tools/support_matrix.py"
    assert list(verified.VERIFIED) == support_matrix.verified_types(sweep), \
        "patches/verified.py is stale: run python scripts/tools/support_matrix.py"
    page = support_matrix.MATRIX_PAGE.read_text()
    assert support_matrix.render_table(sweep) in page, \
        "docs' support matrix is stale: run scripts/tools/support_matrix.py"


def test_families_refused_for_their_features(pool2):
    out = pool2.run(S.refusals)[0]
    # the sparse-attention families compute their indexer's mask from the attention mask (attention_mask[:, 0]):
    # refused there, naming the line, before their attention passes indices (refused by name too: test_user_built)
    assert re.search(r"modeling_deepseek_v32\.py:\d+ \(forward\) computes a new tensor from its attention mask "
                     r"\(__getitem__\)", out["sparse_indices"]), out
    assert "router auxiliary loss is computed in a form hfcp does not read" in out["aux_loss_form"], out


def test_records_a_user_registers_are_held_to_the_same_checks(pool2, sweep):
    # every type the sweep refuses, and every hybrid exact through its record's mixers, registered as a user would
    # (attention classes named by hand, no mixers): exact or refused, never silently wrong or a raw error (before,
    # 25 came out wrong and 13 crashed this way: sweep_families.SKIP)
    out = pool2.run(S.user_records, S.user_record_types(sweep), timeout=900)[0]
    assert len(out) >= 50, len(out)
    bad = [r for r in out if r["result"] not in ("exact", "refused")]
    assert not bad, bad
    reasons = {r["type"]: r["detail"] for r in out}
    assert "mixes tokens without attention" in reasons["zamba"], reasons["zamba"]  # a Mamba 1 hybrid
    assert "MultiHeadAttention does not compute attention through" in reasons["xlm"], reasons["xlm"]
    assert "(RobertaSelfAttention, inside it, does: name that class)" in reasons["roberta"], reasons["roberta"]


def test_every_family_hfcp_ships_passes_the_model_checks():
    # the checks every record goes through at patch time refuse no shipped family (a convolution over tokens is
    # allowed inside a record's mixers and a token model's embeddings only)
    checked, refused = S.model_check_refusals()
    assert checked >= 140 and not refused, (checked, refused)


def test_a_user_record_naming_the_right_class_is_still_checked_and_can_opt_out(pool2):
    # RoBERTa computes position ids from input_ids: a record naming its interface class was silently wrong before
    msg = pool2.run(S.user_record, "roberta", ("RobertaSelfAttention",))[0]
    assert "computes position ids from input_ids" in msg and "skip_model_checks=True" in msg, msg
    assert pool2.run(S.user_record, "roberta", ("RobertaSelfAttention",), True)[0] == "patched"
