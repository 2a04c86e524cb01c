"""The import layering of DESIGN.md, enforced: bottom packages import no project code above them,
capture and replay never import each other, analysis and app read traces only through the
catalog and DuckDB."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("catalog", "policy", "tasks", "console", "cluster", "moe", "eagle", "capture",
            "replay", "analysis", "app", "training")
# package -> project packages it may import (anything else is a layering violation)
ALLOWED = {
    "catalog": set(),  # traces on disk: pyarrow only
    "policy": set(),  # expert budgets: torch/numpy only
    "tasks": set(),
    "console": {"catalog"},  # the one rule for what an output may replace (catalog.atomic)
    "cluster": set(),  # Ray, optional
    "moe": {"policy", "tasks", "console"},
    "eagle": {"moe"},
    "capture": {"catalog", "policy", "moe", "eagle", "tasks", "console", "cluster"},
    "replay": {"catalog", "policy", "moe", "eagle", "console", "cluster"},
    "analysis": {"catalog", "moe", "tasks", "console"},
    "app": {"analysis", "catalog", "console"},
    "training": {"catalog", "moe", "eagle", "tasks", "console"},
}


def imports(path: Path) -> set[str]:
    """Top-level project packages a module imports (at module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found


def edges() -> dict[str, set[str]]:
    graph = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            graph[package] |= imports(path) - {package}
    return graph


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_its_layer_allows(package):
    extra = edges()[package] - ALLOWED[package]
    assert not extra, f"{package} imports {sorted(extra)}; allowed: {sorted(ALLOWED[package])}"


def test_the_package_graph_has_no_cycle():
    graph = edges()
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(node):] + [node])}")
        if node in seen:
            return
        stack.append(node)
        for nxt in graph[node]:
            visit(nxt)
        stack.pop()
        seen.add(node)

    for package in PACKAGES:
        visit(package)


def test_the_checker_catches_a_violation(tmp_path):
    """The test can fail: a module importing replay from capture is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("from replay.run import replay\nimport capture.cli\n")
    assert imports(bad) == {"replay", "capture"}
