"""DuckDB over every trace and replay table: one connection with a named view per table.

    >>> from analysis.sql import connect
    >>> con = connect("traces")
    >>> con.sql("SELECT bench, avg(accepted_length) FROM trees WHERE role = 'evaluation' "
    ...         "GROUP BY bench").pl()

Views read the Parquet files lazily with hive partitioning (``model``, ``bench``, ``run`` and,
for replay results, ``config`` and ``block`` become columns) and show only what is final: rows of
complete runs (with the run's ``role`` as a column) and of complete replay blocks computed from
the current capture of their run. Running captures and interrupted replays are left out.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa

from catalog import Catalog, partition_value, schema
from catalog.results import RESULT_TABLES, complete_blocks

VIEWS = (*schema.TRACE_TABLES, "runs", *RESULT_TABLES)


def _catalog_tables(root: Path, roles) -> tuple[pa.Table, pa.Table]:
    """(complete runs with role and run id, complete replay blocks) as small Arrow tables."""
    runs = Catalog(root).runs(roles=roles)
    run_rows = pa.Table.from_pylist(
        [dict(model=partition_value(r.model), bench=r.bench, run=r.name, role=r.role,
              run_id=r.run_id) for r in runs],
        schema=pa.schema([(c, pa.string()) for c in ("model", "bench", "run", "role", "run_id")]))
    blocks = [dict(b, table=t) for t in RESULT_TABLES for b in complete_blocks(root, t)]
    block_rows = pa.Table.from_pylist(blocks, schema=pa.schema(
        [(c, pa.string()) for c in ("model", "bench", "run", "config", "block", "run_id",
                                    "table")]))
    return run_rows, block_rows


def connect(root: str | Path = "traces", database: str = ":memory:",
            roles: tuple[str, ...] | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view for every table found under ``root``; ``roles`` limits
    every view to runs of those roles (default: all, with ``role`` as a column)."""
    root = Path(root)
    con = duckdb.connect(database)
    runs, blocks = _catalog_tables(root, roles)
    for name, table in (("_complete_runs", runs), ("_complete_blocks", blocks)):
        con.register("_arrow", table)  # tables, not registrations: cursors must see them too
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _arrow")
        con.unregister("_arrow")
    for name in VIEWS:
        if not any((root / name).rglob("*.parquet")):
            continue
        glob = (root / name).as_posix().replace("'", "''") + "/**/*.parquet"
        scan = f"read_parquet('{glob}', hive_partitioning = true, union_by_name = true)"
        if name in RESULT_TABLES:
            body = (f"SELECT t.* FROM {scan} t SEMI JOIN (SELECT b.* FROM _complete_blocks b "
                    f"JOIN _complete_runs r USING (model, bench, run, run_id) WHERE b.table = "
                    f"'{name}') c USING (model, bench, run, config, block)")
        elif name == "runs":
            body = f"SELECT t.* FROM {scan} t SEMI JOIN _complete_runs c USING (model, bench, run)"
        else:
            body = (f"SELECT t.*, c.role FROM {scan} t JOIN _complete_runs c "
                    "USING (model, bench, run)")
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")
    return con


def views(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_type = 'VIEW' "
        "ORDER BY table_name").fetchall()]
