"""DuckDB over every trace and replay table: one connection with a named view per table.

    >>> from analysis.sql import connect
    >>> con = connect("traces")
    >>> con.sql("SELECT bench, avg(accepted_length) FROM trees GROUP BY bench").pl()

Views read the Parquet files lazily with hive partitioning (``model``, ``bench``, ``run`` and,
for replay results, ``config`` become columns); nothing is loaded into Python until asked.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from capture import schema

VIEWS = (*schema.TRACE_TABLES, "runs", *schema.REPLAY_TABLES)


def connect(root: str | Path = "traces", database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view for every table found under ``root``."""
    root = Path(root)
    con = duckdb.connect(database)
    for name in VIEWS:
        if any((root / name).rglob("*.parquet")):
            glob = (root / name).as_posix() + "/**/*.parquet"
            con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM read_parquet("
                        f"'{glob}', hive_partitioning = true, union_by_name = true)")
    return con


def views(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_type = 'VIEW' "
        "ORDER BY table_name").fetchall()]
