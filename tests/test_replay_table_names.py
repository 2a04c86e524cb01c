"""A replay table's name is declared once, in its record (catalog/replay_metrics.py: ``TABLES``,
``OPEN_TABLE``, ``CLOSED_TABLE``, ...): the analysis and the app name a table through those
constants, SQL included (f-strings), never as a quoted literal of their own. Docstrings may show
SQL (documentation, like docs/), and so may comments."""

import ast
import re
from pathlib import Path

from moe_spec.catalog.replay_metrics import TABLES

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("analysis", "app")  # (catalog/ declares the names)
NAME = re.compile(r"\b(" + "|".join(map(re.escape, sorted(TABLES, key=len, reverse=True)))
                  + r")\b")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def quoted_table_names(path: Path) -> list[str]:
    """Where ``path`` spells a replay table's name inside a string of code (a literal, an SQL
    string, an f-string's text), docstrings aside: ``file:line name``."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    return [f"{path.name}:{node.lineno} {match}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs for match in NAME.findall(node.value)]


def test_analysis_and_app_name_replay_tables_through_their_records():
    found = [hit for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in quoted_table_names(path)]
    assert not found, found


def test_the_scan_finds_a_planted_literal_and_passes_constants_and_docstrings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Reads ``replay_open``: SELECT * FROM replay_closed."""\n'
        "from moe_spec.catalog.replay_metrics import OPEN_TABLE\n"
        "def f(con, where):\n"
        '    """SELECT avg(rse) FROM replay_open"""\n'
        "    if 'replay_closed' in con.views:  # replay_batch\n"
        '        return con.sql(f"SELECT * FROM replay_closed_batch WHERE {where}")\n'
        '    return con.sql(f"SELECT * FROM {OPEN_TABLE}"), "replay_open_all"\n')
    assert quoted_table_names(module) == ["m.py:5 replay_closed",
                                          "m.py:6 replay_closed_batch"]
