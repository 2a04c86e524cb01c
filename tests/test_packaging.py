"""The install puts one top-level package into site-packages: ``moe_spec``, its subpackages the
design card's folders at the top of the repository (pyproject.toml's package-dir), so nothing
named ``errors``, ``tasks`` or ``app`` collides with another project in a shared environment."""

import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from test_layering import NAMESPACE, PACKAGES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())


def on_disk() -> set[str]:
    """Every package folder (an ``__init__.py``) under the design card's folders, as installed."""
    return {NAMESPACE} | {".".join([NAMESPACE, *p.parent.relative_to(ROOT).parts])
                          for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")}


def test_pyproject_lists_every_package_folder_under_the_namespace():
    setuptools = CONFIG["tool"]["setuptools"]
    assert set(setuptools["packages"]) == on_disk()
    assert setuptools["package-dir"] == {f"{NAMESPACE}.{p}": p for p in PACKAGES}
    for script, target in CONFIG["project"]["scripts"].items():
        assert target.startswith(f"{NAMESPACE}."), (script, target)


def build_isolation() -> list[str]:
    """Build with this environment's setuptools when it is new enough (no download), else in
    pip's isolated build environment (pyproject's build-system requirement)."""
    try:
        recent = int(version("setuptools").split(".")[0]) >= 77
    except (PackageNotFoundError, ValueError):
        recent = False
    return ["--no-build-isolation"] if recent else []


@pytest.mark.slow  # builds the wheel
def test_the_wheel_holds_one_top_level_package_with_every_module(tmp_path):
    """Built from a copy of what the wheel reads (setuptools leaves build/ where it builds)."""
    source = tmp_path / "source"
    for name in (*PACKAGES, NAMESPACE):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           *build_isolation(), str(source), "-w", str(tmp_path / "dist")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {NAMESPACE}, top
    expected = {f"{NAMESPACE}/{p.relative_to(ROOT)}" for top in PACKAGES
                for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".j2")
                and "__pycache__" not in p.parts}
    assert expected <= set(names), sorted(expected - set(names))[:5]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    targets = [line.split("=", 1)[1].strip() for line in
               zipfile.ZipFile(wheel).read(entry_points).decode().splitlines() if "=" in line]
    assert targets and all(t.startswith(f"{NAMESPACE}.") for t in targets), targets
