"""The built wheel holds every package of the source tree (hfcp/ and patches/ as hfcp.patches)."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_packages() -> set[str]:
    """Dotted names of the installed packages the source tree defines."""
    names = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hfcp").rglob("__init__.py")}
    names |= {".".join(("hfcp",) + p.parent.relative_to(ROOT).parts) for p in (ROOT / "patches").rglob("__init__.py")}
    return names


def test_the_wheel_holds_every_package_of_the_source_tree(tmp_path):
    src = tmp_path / "src"
    for name in ("hfcp", "patches"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "patches"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("hfcp-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {f.rsplit("/", 1)[0].replace("/", ".") for f in files if f.endswith("/__init__.py")}
    expected = source_packages()
    assert {"hfcp", "hfcp.attention", "hfcp.integrations", "hfcp.patches"} <= expected
    assert expected <= in_wheel, f"packages missing from the wheel: {sorted(expected - in_wheel)}"
    modules = {f for f in files if f.endswith(".py")}
    for record in (ROOT / "patches").glob("*.py"):
        assert f"hfcp/patches/{record.name}" in modules, f"{record.name} missing from the wheel"
    for config in (ROOT / "hfcp" / "planning" / "configs").glob("*.json"):  # (hfcp plan's shipped configs)
        assert f"hfcp/planning/configs/{config.name}" in files, f"{config.name} missing from the wheel"
    scripts = [f for f in files if f.endswith("entry_points.txt")]
    assert scripts and "hfcp" in zipfile.ZipFile(wheel).read(scripts[0]).decode()
