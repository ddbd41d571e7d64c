"""hfcp's parts import downward only: each part of hfcp/ (a top-level module or package) imports only the parts
listed before it in LAYERS. KNOWN_UPWARD is the debt this test found when it was written (docs/contributing/
architecture.md, issue 53): it may only shrink, and an entry that no longer occurs must leave it."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HFCP = ROOT / "hfcp"

# bottom first: a part may import the parts before it
LAYERS = ["compiler", "layout", "forward_data", "state", "distributed", "checks", "attention", "loss", "pooling",
          "families", "mixers", "tiling", "norm_fold", "offload", "inference", "hooks", "attach", "report", "api",
          "outputs", "testing", "tiny", "tiny_vlm", "kv_cache", "commands", "pipelining", "integrations"]

# (importing file, imported part): upward imports to remove, none to add
KNOWN_UPWARD = {
    ("hfcp/families/resolve.py", "hooks"),
    ("hfcp/inference/generate.py", "hooks"),
    ("hfcp/loss/head_input.py", "families"), ("hfcp/loss/head_input.py", "hooks"),
}


def imported_parts(path: Path) -> set[str]:
    """The parts of hfcp that `path` imports at run time (at module level or inside functions; not for annotations
    under `if TYPE_CHECKING:`), its own excepted."""
    package = ["hfcp", *path.relative_to(HFCP).parts[:-1]]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for n in ast.walk(block)}
    parts = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{a.name}" for a in node.names] if module == "hfcp" else [module]
        else:
            continue
        parts |= {n.split(".")[1] for n in names if n.startswith("hfcp.") and len(n.split(".")) > 1}
    return parts


def part_of(path: Path) -> str | None:
    first = path.relative_to(HFCP).parts[0]
    return None if first == "__init__.py" else first.removesuffix(".py")


def upward_imports() -> set[tuple[str, str]]:
    rank = {p: i for i, p in enumerate(LAYERS)}
    found = set()
    for path in sorted(HFCP.rglob("*.py")):
        me = part_of(path)
        if me is None:
            continue
        for other in imported_parts(path) - {me}:
            if other in rank and rank[other] > rank[me]:
                found.add((str(path.relative_to(ROOT)), other))
    return found


def test_every_part_has_its_place():
    parts = {part_of(p) for p in HFCP.rglob("*.py")} - {None, "patches"}
    assert parts <= set(LAYERS), f"place {sorted(parts - set(LAYERS))} in tests/test_layers.py's LAYERS"
    assert set(LAYERS) <= parts, f"{sorted(set(LAYERS) - parts)} no longer exist: take them out of LAYERS"


def test_imports_go_down_only():
    found = upward_imports()
    new = found - KNOWN_UPWARD
    assert not new, (f"upward imports (a part imports one listed after it in LAYERS): {sorted(new)}; move the "
                     "shared code down, or the importing code up")
    gone = KNOWN_UPWARD - found
    assert not gone, f"fixed, so take them out of KNOWN_UPWARD: {sorted(gone)}"


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check has teeth: a module of layout that imports hooks is found."""
    bad = HFCP / "layout" / "_upward_probe.py"
    bad.write_text("from ..hooks import causal_lm\n")
    try:
        assert ("hfcp/layout/_upward_probe.py", "hooks") in upward_imports()
    finally:
        bad.unlink()
