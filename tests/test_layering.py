"""The import layering of DESIGN.md, enforced: bottom packages import no project code above them,
capture and replay never import each other, analysis and app read traces only through the
catalog and DuckDB."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "moe_spec"  # the one top-level package the wheel installs (pyproject's package-dir)
PACKAGES = ("errors", "catalog", "policy", "tasks", "console", "cluster", "moe", "eagle", "capture",
            "replay", "analysis", "app", "training", "profiling", "bench")
# package -> project packages it may import besides ``errors`` (anything else is a layering
# violation); ``errors`` (the user errors' base class and the CLIs' error line) imports nothing
ALLOWED = {
    "errors": set(),
    "catalog": set(),  # traces on disk: pyarrow only
    "policy": set(),  # expert budgets: torch/numpy only
    "tasks": set(),
    "console": {"catalog"},  # the one rule for what an output may replace (catalog.atomic)
    "cluster": set(),  # Ray, optional
    "moe": {"policy", "console"},
    "eagle": {"moe"},
    "capture": {"catalog", "policy", "moe", "eagle", "tasks", "console", "cluster"},
    "replay": {"catalog", "policy", "moe", "eagle", "console", "cluster"},
    "analysis": {"catalog", "moe", "tasks", "console", "policy"},  # policy: its torch-free index
    # only (the rankings' table: the ablation ladder), checked by tests/test_ranking_index.py
    "app": {"analysis", "catalog", "console"},
    "training": {"catalog", "moe", "eagle", "tasks", "console"},
    # measuring a model (inspect-model, profile-target, profile-batch): capture's prompt encoding,
    # analysis's fits of what it measured
    "profiling": {"catalog", "policy", "moe", "eagle", "tasks", "console", "capture", "analysis"},
    # the benches (python bench/<script>.py): the top, over every package; none imports them
    "bench": set(PACKAGES) - {"bench"},
}
ALLOWED = {p: allowed | {"errors"} if p != "errors" else allowed for p, allowed in ALLOWED.items()}


def unprefixed(name: str) -> str:
    """A project module's name inside the namespace: ``moe_spec.policy.index`` → ``policy.index``
    (other names unchanged)."""
    return name[len(NAMESPACE) + 1:] if name.startswith(NAMESPACE + ".") else name


def imports(path: Path) -> set[str]:
    """Top-level project packages a module imports (at module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        names = [unprefixed(n) for n in names]
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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (node -> nodes it imports) as ``[a, b, …, a]``, or None."""
    done, stack = set(), []

    def visit(node):
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in done:
            return None
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt)
            if cycle:
                return cycle
        stack.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_the_package_graph_has_no_cycle():
    cycle = find_cycle(edges())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def module_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> project modules it imports (at module level or inside functions), for every
    module of ``packages`` under ``root``. ``from p import m`` is an edge to the module ``p.m``
    when there is one, else to ``p`` itself (its ``__init__``)."""
    paths = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {unprefixed(a.name) for a in node.names if unprefixed(a.name) in paths}
            elif isinstance(node, ast.ImportFrom):
                base = unprefixed(node.module or "")
                if node.level:  # relative: from the importing module's package, then up
                    package = module.split(".")[:None if path.name == "__init__.py" else -1]
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join([*package, *([node.module] if node.module else [])])
                for alias in node.names:
                    target = alias.name if base == NAMESPACE else f"{base}.{alias.name}"
                    found.add(target if target in paths else base)
        graph[module] = (found & set(paths)) - {module}
    return graph


def test_the_module_graph_has_no_cycle():
    """No two project modules import each other, directly or around a circle (a lazy import
    inside a function counts: it only hides the circle)."""
    cycle = find_cycle(module_graph(ROOT, PACKAGES))
    assert cycle is None, f"import cycle between modules: {' -> '.join(cycle)}"


def test_the_module_checker_catches_a_circle(tmp_path):
    """The circle capture/run.py <-> capture/distributed.py had (each importing the other inside
    functions) is found; without it the graph is clean."""
    (tmp_path / "capture").mkdir()
    (tmp_path / "capture" / "__init__.py").write_text("")
    (tmp_path / "capture" / "run.py").write_text(
        "def capture_run():\n    from moe_spec.capture.distributed import capture_distributed\n")
    (tmp_path / "capture" / "distributed.py").write_text(
        "import time\n\n\nclass CaptureWorker:\n    def __init__(self):\n"
        "        from moe_spec.capture.run import Target\n")
    graph = module_graph(tmp_path, ("capture",))
    assert graph["capture.run"] == {"capture.distributed"}
    assert find_cycle(graph) == ["capture.distributed", "capture.run", "capture.distributed"]
    (tmp_path / "capture" / "distributed.py").write_text("from . import settings\n")
    (tmp_path / "capture" / "settings.py").write_text("")
    graph = module_graph(tmp_path, ("capture",))
    assert graph["capture.distributed"] == {"capture.settings"} and find_cycle(graph) is None


def test_the_checker_catches_a_violation(tmp_path):
    """The test can fail: a module importing replay from capture is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("from moe_spec.replay.run import replay\nimport moe_spec.capture.cli\n"
                   "from moe_spec import console\n")
    assert imports(bad) == {"replay", "capture", "console"}


def test_no_string_names_a_project_module_without_the_namespace():
    """A module named in a string (``importlib.import_module("x")``, jinja2's ``PackageLoader``,
    ``importlib.resources.files``) escapes the import check above: in a checkout run from its
    root the bare name still imports (a second copy), from a console script it does not."""
    calls = {"import_module", "PackageLoader", "files", "find_spec", "get_data", "__import__"}
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                first = node.args[0]
                if name in calls and isinstance(first, ast.Constant) and \
                        isinstance(first.value, str) and first.value.split(".")[0] in PACKAGES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {first.value}")
    assert not found, found


def test_every_project_import_names_the_namespace():
    """Project code is imported as ``moe_spec.<package>`` everywhere (packages, tests, benches,
    the app's script): a bare ``import capture`` would load a second copy of the module (two
    registries) in a checkout and fail in an installed wheel, which has no top-level ``capture``."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts or rel.parts[0] == "build":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level \
                and node.module else []
            found += [f"{rel}:{node.lineno} {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert not found, found


PATH_EDITS = ("sys.path.insert(", "sys.path.append(", "sys.path.extend(", "site.addsitedir(")


def path_edits(path: Path) -> list[str]:
    """The ``sys.path`` edits of a module: a call on ``sys.path`` that changes it, an assignment
    to it, ``site.addsitedir``, the same in code it hands a child process (a string), and
    pytest's ``monkeypatch.syspath_prepend`` of anything but a test's temporary folder (a
    throwaway module a registry imports by name, undone after the test)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Assign, ast.AugAssign)) else ""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            edits = (owner == "sys.path" and node.func.attr in ("insert", "append", "extend",
                                                               "remove", "clear", "pop")) or \
                (owner == "site" and node.func.attr == "addsitedir") or \
                (node.func.attr == "syspath_prepend" and not all(
                    name.id.startswith("tmp") for arg in node.args for name in ast.walk(arg)
                    if isinstance(name, ast.Name) and name.id not in ("str", "Path")))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            edits = any(ast.unparse(t).startswith("sys.path") for t in targets)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            edits, text = any(edit in node.value for edit in PATH_EDITS), "(in a string)"
        else:
            edits = False
        if edits:
            found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:"
                         f"{node.lineno} {text[:80]}")
    return found


def test_no_module_edits_sys_path():
    """Benches, tests and packages import the project through the one installed namespace
    (``moe_spec.bench.pipeline``, never ``sys.path.insert(0, "bench"); import pipeline``): a
    path edit makes a second copy of a module importable under a bare name (two registries)
    and hides a package a bench shadows."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts or \
                rel.parts[0] == "build" or path == Path(__file__).resolve():  # (its examples)
            continue
        found += path_edits(path)
    assert not found, found


def test_the_path_edit_checker_catches_each_kind(tmp_path):
    """The test can fail: each kind of edit is found, a temporary folder's prepend is not."""
    bad = tmp_path / "bad.py"
    bad.write_text('import sys, site\nsys.path.insert(0, "bench")\nsys.path.append(ROOT)\n'
                   'sys.path[:0] = ["x"]\nsys.path = []\nsite.addsitedir("x")\n'
                   'CODE = "import sys; sys.path.insert(0, \'bench\'); import pipeline"\n'
                   'def test(monkeypatch, tmp_path):\n'
                   '    monkeypatch.syspath_prepend(str(ROOT / "bench"))\n'
                   '    monkeypatch.syspath_prepend(str(tmp_path))\n'
                   '    sys.path.index("x")\n')
    assert sorted(int(f.split(":")[1].split()[0]) for f in path_edits(bad)) == [2, 3, 4, 5, 6, 7, 9]
