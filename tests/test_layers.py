"""hfcp's parts import downward only: each part of hfcp/ (a top-level module or package) imports only the parts
listed before it in LAYERS, which docs/contributing/architecture.md gives in the same order; at most 5 loose modules;
patches/ (model knowledge) imports only the parts a record needs."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HFCP = ROOT / "hfcp"

# bottom first: a part may import the parts before it
LAYERS = ["compiler", "layout", "state", "distributed", "attention", "loss", "families", "mixers", "memory",
          "inference", "hooks", "outputs", "report", "api", "pipelining", "planning", "testing", "commands",
          "integrations"]

LOOSE_MODULES = {"api.py", "compiler.py", "report.py", "state.py"}  # hfcp/*.py besides __init__.py: at most 5
RECORD_PARTS = {"families", "mixers"}  # what patches/ may import


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
    """(importing file, imported part) for each import of a part listed after the importer's in LAYERS."""
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
    assert not found, (f"upward imports (a part imports one listed after it in LAYERS): {sorted(found)}; move the "
                       "shared code down, or the importing code up")


def test_few_loose_modules():
    loose = {p.name for p in HFCP.glob("*.py")} - {"__init__.py"}
    assert loose == LOOSE_MODULES, (f"loose modules in hfcp/: {sorted(loose)}; put a new one in the folder of its "
                                    "concern (or, for a new concern, a folder of its own)")


def test_records_import_only_what_a_record_needs():
    for path in sorted((ROOT / "patches").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        parts = {m.split(".")[1] for m in imported if m.startswith("hfcp.")}
        assert parts <= RECORD_PARTS, f"patches/{path.name} imports hfcp.{sorted(parts - RECORD_PARTS)}"


def test_the_architecture_page_gives_the_order():
    """docs/contributing/architecture.md's bottom-first list is LAYERS, and its tree names every part."""
    page = (ROOT / "docs" / "contributing" / "architecture.md").read_text()
    listed = page.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    assert [w.strip(" `,.\n") for w in listed.split(",")] == LAYERS, "architecture.md's order differs from LAYERS"
    tree = page.split("## Where things live")[1].split("\n## ")[0]
    for part in LAYERS + [m.removesuffix(".py") for m in LOOSE_MODULES]:
        assert f" {part}" in tree, f"architecture.md's 'Where things live' does not show {part}"


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check has teeth: a module of layout that imports hooks is found."""
    bad = HFCP / "layout" / "_upward_probe.py"
    bad.write_text("from ..hooks import causal_lm\n")
    try:
        assert ("hfcp/layout/_upward_probe.py", "hooks") in upward_imports()
    finally:
        bad.unlink()
