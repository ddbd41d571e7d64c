"""The docs site: it builds with broken links and missing pages as errors, the API page shows every public name with
every parameter of its signature, the `hfcp verify` page every option, and the README's links land on pages."""
import contextlib
import importlib
import inspect
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hfcp
import hfcp.integrations

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "reference" / "api.md"
# paths users were told about in guides and error messages, documented on the API page beside the package's __all__
OTHER_PUBLIC = [
    "hfcp.inference.kv_cache.ShardedKVCache",
    "hfcp.testing.tiny.tiny_config",
    "hfcp.testing.tiny.tiny_model",
    "hfcp.testing.tiny_vlm.tiny_vlm",
    "hfcp.testing.tiny_vlm.text_batch",
    "hfcp.testing.tiny_vlm.image_batch",
    "hfcp.testing.tiny_vlm.video_batch",
    "hfcp.testing.tiny_audio.tiny_audio",
    "hfcp.testing.tiny_audio.text_batch",
    "hfcp.testing.tiny_audio.audio_batch",
    "hfcp.testing.tiny_audio.mixed_audio_batch",
    "hfcp.attention.volume.comm_bytes",
    "hfcp.attention.volume.conv_halo_bytes",
    "hfcp.attention.volume.state_fold_bytes",
    "hfcp.attention.volume.scalar_fold_bytes",
    "hfcp.attention.volume.channel_fold_bytes",
    "hfcp.attention.mesh_volume.layout_bytes",
    "hfcp.planning.search",
    "hfcp.planning.dry_run",
]


def public_names() -> list[str]:
    return ([f"hfcp.{n}" for n in hfcp.__all__] + [f"hfcp.integrations.{n}" for n in hfcp.integrations.__all__]
            + OTHER_PUBLIC)


def resolve(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def rendered_signature(qualname: str, obj) -> str | None:
    """`qualname(a, b=1, *, c="x", **kwargs)` as the API page writes it: no annotations, defaults as Python literals
    in double quotes, a default that is no literal (a sentinel) left out. None for a class without a signature."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parts, star = [], False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        default = repr(p.default).replace("'", '"')
        parts.append(p.name if p.default is p.empty or default.startswith("<") else f"{p.name}={default}")
    return f"{qualname}({', '.join(parts)})"


def flat(text: str) -> str:
    """Signatures may wrap after a comma or an opening parenthesis."""
    return re.sub(r"\(\s+", "(", re.sub(r",\s+", ", ", text))


@pytest.mark.parametrize("qualname", public_names())
def test_api_page_shows_every_public_name_with_its_full_signature(qualname):
    page = API.read_text()
    obj = resolve(qualname)
    assert qualname in page, f"docs/reference/api.md does not document {qualname}"
    expected = rendered_signature(qualname, obj)
    if expected is None:  # an exception class: its heading is its documentation
        assert f"### `{qualname}`" in page, qualname
        return
    assert expected in flat(page), f"docs/reference/api.md must show `{expected}` (the code's signature)"
    params = [p for p in inspect.signature(obj).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p.name for p in params if f"`{p.name}`" not in page]
    assert not missing, f"docs/reference/api.md does not describe {qualname}'s options {missing}"


def verify_options() -> list[str]:
    from hfcp.commands import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    return sorted(set(re.findall(r"(--[a-z][a-z-]+)", out.getvalue())) - {"--help"})


def test_verify_page_shows_every_option():
    options = verify_options()
    assert {"--model", "--seq-len", "--cp-size", "--strategy"} <= set(options), options
    page = (DOCS / "how-to" / "verify.md").read_text()
    missing = [o for o in options if f"| `{o}` |" not in page]
    assert not missing, f"docs/how-to/verify.md's options table lacks {missing}"


def test_api_check_fails_on_a_missing_option():
    """The signature check is not vacuous: a parameter the page does not show is caught."""
    def patch(model, cp_size=None, new_option=3):
        pass

    assert rendered_signature("hfcp.patch", patch) not in flat(API.read_text())
    assert rendered_signature("hfcp.patch", hfcp.patch) in flat(API.read_text())


def test_readme_links_land_on_docs_pages():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/reference/api.md") for link in local), local
    assert any(link.startswith("docs/reference/support-matrix.md") for link in local), local
    missing = [link for link in local if not (ROOT / link).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    missing = [p for p in pages if f": {p}\n" not in nav]
    assert not missing, f"mkdocs.yml's nav lacks {missing}"


@pytest.mark.skipif(shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists(),
                    reason="mkdocs is not installed (pip install -e '.[dev]')")
def test_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    cmd = [str(mkdocs) if mkdocs.exists() else "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link(tmp_path):
    """The strict build is what catches a broken link or anchor: a copy of the site with one fails."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists() and shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text()
                    + "\n[gone](reference/no-such-page.md) [anchor](reference/api.md#no-such-anchor)\n")
    cmd = [str(mkdocs) if mkdocs.exists() else "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
