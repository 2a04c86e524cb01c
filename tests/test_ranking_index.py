"""policy.index is the one place a ranking is declared: its module, runtime, summary, examples,
ablation step and skip message. The registry imports a ranking's module on first use, so adding
one is its module plus one line of the index."""

import ast
import sys
from pathlib import Path

import pytest

from moe_spec.policy import index, rankings
from moe_spec.policy.rankings import base

ROOT = Path(__file__).resolve().parent.parent
RANKINGS_DIR = ROOT / "policy" / "rankings"

WIDEST = '''
from moe_spec.policy.rankings.base import Ranking, by_mass, register


@register
class Widest(Ranking):
    name = "widest"

    def order(self, batch, coverage, max_budget):
        return by_mass(batch.mass())
'''


def ranking_modules() -> set[str]:
    """Every module under policy/rankings/ that defines a ranking (all but the package and base)."""
    return {f"moe_spec.policy.rankings.{p.stem}" for p in RANKINGS_DIR.glob("*.py")
            if p.stem not in ("__init__", "base")}


def test_every_ranking_module_is_indexed_and_every_line_names_its_module():
    assert {e.module for e in index.RANKINGS.values()} == ranking_modules()
    for name, entry in index.RANKINGS.items():
        cls = rankings.get(name)
        assert (cls.name, cls.__module__, cls.runtime) == (name, entry.module, entry.runtime)
        assert {f: getattr(cls, f) for f in base.FACTS} == {f: getattr(entry, f)
                                                             for f in base.FACTS}
        assert cls().skipped(64, list(range(1, 65))) == index.skipped_budgets(
            name, 64, list(range(1, 65)))
    assert sorted(rankings.REGISTRY) == sorted(index.RANKINGS)
    assert {n: c.runtime for n, c in rankings.REGISTRY.items()} == \
        {n: e.runtime for n, e in index.RANKINGS.items()}


def test_no_ranking_class_declares_what_the_index_holds():
    for path in RANKINGS_DIR.glob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for stmt in cls.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value else []
                if isinstance(stmt, ast.FunctionDef) and path.name != "base.py":
                    assert stmt.name != "skipped", f"{path.name}: {cls.name} overrides skipped " \
                        "(its budgets are its line's subset_limit: replay plans without torch)"
                declared = {getattr(t, "id", None) for t in targets} & set(base.FACTS) \
                    if path.name != "base.py" else set()  # (the protocol's defaults)
                assert not declared, \
                    f"{path.name}: class {cls.name} declares {declared} (policy.index holds it)"


def test_the_rankings_package_lists_no_modules():
    tree = ast.parse((RANKINGS_DIR / "__init__.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "moe_spec.policy.rankings" for a in node.names}
    assert not imported, f"policy/rankings/__init__.py imports ranking modules {imported}"


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as it is now, restored after the test (whatever the test registers)."""
    monkeypatch.setattr(base.REGISTRY, "classes", dict(base.REGISTRY.classes))


def test_adding_a_ranking_is_one_file_plus_one_line(tmp_path, monkeypatch, fresh_registry):
    from moe_spec.capture import settings
    from moe_spec.policy.calibration import MAX_EXAMPLES, examples_for
    from moe_spec.replay.cli import parser as replay_parser
    (tmp_path / "extra_widest.py").write_text(WIDEST)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(index.RANKINGS, "widest", index.Entry(
        "extra_widest", True, "widest experts first (a test ranking)", examples=True,
        ablation_step=9, skip_message="budgets wider than {limit}"))
    try:
        assert "extra_widest" not in sys.modules
        assert "widest" in rankings.names(runtime=True) and "widest" in rankings.REGISTRY
        assert "extra_widest" not in sys.modules  # listing imports nothing
        cls = rankings.get("widest")
        assert "extra_widest" in sys.modules and cls.__module__ == "extra_widest"
        assert cls.name == "widest" and cls.runtime is True
        assert rankings.get("widest") is cls and rankings.REGISTRY["widest"] is cls

        help_text = replay_parser().format_help()
        assert "widest" in help_text and "(a test ranking)" in " ".join(help_text.split())
        choices = next(a.choices for a in replay_parser()._actions
                       if "--ranking" in a.option_strings)
        assert "widest" in choices
        assert "widest" in settings.runtime_rankings()
        assert examples_for(["widest"]) == MAX_EXAMPLES and examples_for(["router"]) == 0
        assert index.ablation_ladder()[-1] == "widest"
        assert index.skip_reason("widest", 7) == "budgets wider than 7"
    finally:
        sys.modules.pop("extra_widest", None)


def test_a_ranking_must_match_its_line(tmp_path, monkeypatch, fresh_registry):
    """A class that declares runtime, lives elsewhere than its line says or has no line is
    refused when it registers; a module that registers nothing is named."""
    declares = WIDEST.replace('"widest"', '"declares"').replace(
        "    def order", "    runtime = False\n\n    def order")
    versioned = WIDEST.replace('"widest"', '"versioned"').replace(
        "    def order", "    version = 2\n\n    def order")
    files = {"extra_declares": declares, "extra_versioned": versioned,
             "extra_elsewhere": WIDEST.replace('"widest"', '"elsewhere"'),
             "extra_unindexed": WIDEST.replace('"widest"', '"unindexed"'),
             "extra_silent": ""}
    for module, text in files.items():
        (tmp_path / f"{module}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, module in (("declares", "extra_declares"), ("elsewhere", "extra_somewhere"),
                         ("silent", "extra_silent"), ("versioned", "extra_versioned")):
        monkeypatch.setitem(index.RANKINGS, name, index.Entry(module, True, "test"))
    try:
        with pytest.raises(ValueError, match="declares runtime; policy.index holds it"):
            rankings.get("declares")
        with pytest.raises(ValueError, match="declares version; policy.index holds it"):
            rankings.get("versioned")
        with pytest.raises(ValueError, match="defined in extra_elsewhere, policy.index says "
                                             "extra_somewhere"):
            __import__("extra_elsewhere")
        with pytest.raises(ValueError, match="'unindexed' has no line in policy.index"):
            __import__("extra_unindexed")
        with pytest.raises(ValueError, match="module extra_silent registers no ranking 'silent'"):
            rankings.get("silent")
        with pytest.raises(rankings.RankingError, match="unknown ranking 'nowhere'"):
            rankings.get("nowhere")
        assert not {"declares", "elsewhere", "unindexed", "versioned"} & set(base.REGISTRY.classes)
    finally:
        for module in files:
            sys.modules.pop(module, None)


def test_calibration_examples_and_the_ablation_ladder_come_from_the_index():
    from moe_spec.analysis import replay_views
    from moe_spec.policy.calibration import MAX_EXAMPLES, examples_for
    assert replay_views.ABLATION == index.ablation_ladder() \
        == ("sqmass", "coact-diag", "coact", "coact-online", "learned")
    for name, entry in index.RANKINGS.items():
        assert examples_for([name]) == (MAX_EXAMPLES if entry.examples else 0), name
    assert [n for n, e in index.RANKINGS.items() if e.examples] == ["learned", "oracle"]


def test_the_cli_says_each_rankings_own_skip_message():
    exact, limit = rankings.get("exact"), index.RANKINGS["exact"].subset_limit
    assert index.skip_reason("exact", limit) == f"C(N, B) exceeds its limit of {limit} subsets"
    assert exact().skipped(64, [2, 4]) == [4]  # C(64, 4) > 5000: the message's case
    assert index.skip_reason("router") == index.SKIPPED


def test_analysis_reads_only_the_torch_free_index_of_policy():
    """tests/test_layering.py lets analysis import policy for policy.index (and the overhead
    numbers it names, policy.overhead) alone, which import nothing else (so analysis and app stay
    free of torch)."""
    for path in (ROOT / "analysis").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("moe_spec.policy"):
                names = {a.name for a in node.names}
                assert (node.module == "moe_spec.policy" and names <= {"index", "overhead"}) or \
                    node.module in ("moe_spec.policy.index", "moe_spec.policy.overhead"), \
                    f"{path.name} imports {node.module}"
            elif isinstance(node, ast.ImportFrom) and node.module == "moe_spec":
                assert "policy" not in {a.name for a in node.names}, path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("moe_spec.policy") and a.name not in (
                    "moe_spec.policy.index", "moe_spec.policy.overhead") for a in node.names), \
                    path.name
    for module, allowed in (("index", {"moe_spec.policy"}), ("overhead", set())):
        tree = ast.parse((ROOT / "policy" / f"{module}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert imported <= {"__future__", "math", "typing", "dataclasses", *allowed}, imported
    index_imports = [n for n in ast.walk(ast.parse((ROOT / "policy" / "index.py").read_text()))
                     if isinstance(n, ast.ImportFrom) and n.module == "moe_spec.policy"]
    assert all({a.name for a in n.names} == {"overhead"} for n in index_imports)


def test_the_recommended_ranking_is_a_runtime_one_and_help_names_it():
    assert index.RANKINGS[index.RECOMMENDED].runtime
    clauses = [c for c in index.ranking_help().split("; ") if "[recommended]" in c]
    assert len(clauses) == 1 and clauses[0].startswith(f"{index.RECOMMENDED}: ")


def test_the_recommendation_without_a_surrogate_is_another_runtime_ranking_that_reads_none():
    free = index.RANKINGS[index.RECOMMENDED_WITHOUT_SURROGATE]
    assert free.runtime and free.overhead is None  # charged nothing beyond its experts
    assert index.RANKINGS[index.RECOMMENDED].overhead is not None
    assert index.RECOMMENDED_WITHOUT_SURROGATE != index.RECOMMENDED
    text = index.ranking_help()
    assert text.count("[recommended without") == 1
    assert (f"{index.RECOMMENDED_WITHOUT_SURROGATE}: {free.summary} [recommended without a "
            "surrogate]") in text
