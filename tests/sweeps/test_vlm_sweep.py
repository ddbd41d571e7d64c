"""The VLM sweep over every image-text-to-text type of transformers: exact or refused, never silently wrong, with
a text-only batch and with images; and its matrix (docs/reference/support-matrix.md, patches/verified_vlm.py) is what a
fresh sweep gives."""
import support_matrix

from hfcp.testing.dist_pool import InPool
from hfcp.testing.sweeps import vlms

SWEEP = vlms.sweep  # what the `sweep` fixture (tests/conftest.py) runs


def START():
    """The sweep at cp 2, started with the run in a pool of its own, after the family sweep (conftest.py: started)."""
    return InPool(2, SWEEP)


def test_no_vlm_is_silently_wrong_or_crashes(sweep):
    bad = [r for r in sweep if r["result"] in ("mismatch", "error")]
    assert not bad, bad
    exact = {r["type"] for r in sweep if r["result"] == "exact"}
    assert len(exact) >= 20 and set(support_matrix.vlm_explicit()) <= exact, exact  # every hand-written record
    split = {r["type"] for r in sweep if r["tower"] == "split over the ranks"}
    assert {"llava", "qwen2_vl", "qwen3_vl", "gemma3", "idefics3"} <= split, split


def test_generated_vlm_matrix_is_current(sweep):
    import transformers

    from hfcp.patches import verified_vlm

    assert transformers.__version__ == verified_vlm.TRANSFORMERS_VERSION, \
        "the VLM matrix was made with another transformers: run python scripts/tools/support_matrix.py"
    types, text = support_matrix.verified_vlms(sweep)
    assert (list(verified_vlm.VERIFIED), list(verified_vlm.TEXT_TYPES)) == (types, text), \
        "patches/verified_vlm.py is stale: run python scripts/tools/support_matrix.py"
    page = support_matrix.MATRIX_PAGE.read_text()
    assert support_matrix.render_vlm_table(sweep) in page, \
        "docs' VLM matrix is stale: run scripts/tools/support_matrix.py"
