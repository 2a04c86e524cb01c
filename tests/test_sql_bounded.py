"""User SQL runs in a child process under operating-system limits (analysis.sql_child): a query
whose function allocates outside DuckDB's own accounting is stopped at the limit in one line,
functions are checked on DuckDB's parse (not the text), and the limits themselves are checked.

The memory cases run at a 256MB limit (the child's address space: 0.75 GiB), so on the old code
they fail by allocating 1.5-3 GB and running past the timeout; here each stops in about a
second."""

from __future__ import annotations

import pytest
from helpers import one_line

from moe_spec.analysis import query_cli

LIMITS = ["--memory-limit", "256MB", "--timeout", "20"]
HOGS = [  # each allocates far more than 256 MB outside DuckDB's buffer manager
    "SELECT len(range(0, 300000000)) AS n",
    "SELECT len(repeat([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 20000000)) AS n",
    "SELECT len(list_transform(range(200000000), lambda x: x + 1)) AS n",
    "SELECT length(printf('%1500000000d', 1)) AS n",
    "SELECT length(format('{:>1500000000}', 'x')) AS n",
    "SELECT damerau_levenshtein(repeat('a', 20000), repeat('b', 20000)) AS d",
]


@pytest.fixture
def root(tmp_path):
    (tmp_path / "traces").mkdir()
    return tmp_path / "traces"


def _query(root, sql, *extra):
    return query_cli.main([sql, "--traces", str(root), *LIMITS, *extra])


@pytest.mark.parametrize("sql", HOGS)
def test_a_query_that_allocates_outside_duckdb_stops_at_the_limit(root, capsys, sql):
    code = _query(root, sql)
    one_line(capsys, code, "stopped at 0.738 GiB / 20 s", "--memory-limit")


def test_a_small_answer_comes_back(root, capsys):
    assert _query(root, "SELECT len(range(0, 1000)) AS n, repeat('ab', 2) AS s",
                  "--format", "json") == 0
    assert capsys.readouterr().out.strip() == '[{"n":1000,"s":"abab"}]'


@pytest.mark.parametrize("sql,words", [
    ("SELECT system/**/.main.repeat('x', 3000000000)", ("system.main.repeat", "plain names")),
    ("SELECT \"SYSTEM\"  .  main . repeat('x', 3000000000)", ("system",)),
    ("SELECT main.repeat('x', 3000000000)", ("main.repeat",)),
    ("SELECT * FROM query('SELECT system.main.repeat(''x'', 3000000000)')", ("query(…)",)),
    ("SELECT * FROM query_table('t')", ("query_table(…)",)),
    ("SELECT * FROM checkpoint()", ("table function checkpoint",)),
    ("EXPLAIN SELECT * FROM query('SELECT 1')", ("query(…)",)),
    ("WITH x AS (SELECT 1 AS a) SELECT (SELECT system.main.lpad('a', 2000000000, 'b')) FROM x",
     ("system.main.lpad",)),
])
def test_functions_are_checked_on_the_parsed_statement(root, capsys, sql, words):
    one_line(capsys, _query(root, sql), "query: error:", *words)


@pytest.mark.parametrize("args,words", [
    (["--memory-limit", "0GB"], ("below",)),
    (["--memory-limit", "1B"], ("below",)),
    (["--memory-limit", "99999999999999999999TB"], ("not a size",)),
    (["--memory-limit", "9999999TB"], ("more than this machine",)),
    (["--memory-limit", "lots"], ("not a size",)),
    (["--max-rows", str(10**30)], ("--max-rows",)),
    (["--max-rows", "0"], ("--max-rows",)),
    (["--timeout", "nan"], ("timeout",)),
    (["--timeout", "1e400"], ("timeout",)),
])
def test_limits_are_validated_in_one_line(root, capsys, args, words):
    code = query_cli.main(["SELECT 1", "--traces", str(root), *args])
    one_line(capsys, code, *words)
