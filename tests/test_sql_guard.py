"""The SQL guard decides by what DuckDB would execute: a table of statement shapes, each either
answered as a read-only query or refused in one line, with the traces left untouched."""

from __future__ import annotations

import duckdb
import pytest

from moe_spec.analysis.sql import QueryRefused, lock_down, run_query

ALLOWED = [
    "SELECT 1",
    "  select * FROM t",
    "WITH x AS (SELECT 1 AS a) SELECT a FROM x",
    "EXPLAIN SELECT * FROM t",
    "explain analyze select count(*) from t",
    "EXPLAIN\n  ANALYZE\n  SELECT * FROM t",
]
REFUSED = [
    "EXPLAIN ANALYZE COPY (SELECT 99 AS a) TO '{part}' (FORMAT parquet)",
    "EXPLAIN ANALYZE CREATE OR REPLACE VIEW t AS SELECT 99 AS a",
    "EXPLAIN ANALYZE INSERT INTO t VALUES (99)",
    "EXPLAIN ANALYZE DELETE FROM t",
    "EXPLAIN ANALYZE UPDATE t SET a = 99",
    "EXPLAIN COPY t TO '{part}'",
    "EXPLAIN /* c */ ANALYZE COPY (SELECT 99) TO '{part}'",
    "EXPLAIN ANALYZE SELECT 1; COPY t TO '{part}'",
    "COPY (SELECT 99) TO '{part}' (FORMAT parquet)",
    "CREATE VIEW v AS SELECT 1",
    "INSERT INTO t VALUES (99)",
    "ATTACH '{part}.db' AS other",
    "SET threads = 1",
    "PRAGMA version",
    "SELECT 1; SELECT 2",
    "",
]


@pytest.fixture
def con(tmp_path):
    part = tmp_path / "part.parquet"
    c = duckdb.connect()
    c.execute("CREATE TABLE t AS SELECT 1 AS a")
    c.execute(f"COPY t TO '{part}' (FORMAT parquet)")
    lock_down(c, tmp_path)
    return c, part


@pytest.mark.parametrize("sql", ALLOWED)
def test_read_only_queries_run(con, sql):
    c, _ = con
    assert run_query(c, sql).num_rows is not None


@pytest.mark.parametrize("sql", REFUSED)
def test_everything_else_is_refused_and_changes_nothing(con, sql):
    c, part = con
    before = part.read_bytes()
    with pytest.raises(QueryRefused) as err:
        run_query(c, sql.format(part=part))
    assert "\n" not in str(err.value)
    assert part.read_bytes() == before
    assert c.execute("SELECT a FROM t").fetchall() == [(1,)]
