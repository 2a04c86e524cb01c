"""DuckDB over every trace and replay table: one connection with a named view per table.

    >>> from analysis.sql import connect
    >>> con = connect("traces")
    >>> con.sql("SELECT bench, avg(accepted_length) FROM trees WHERE role = 'evaluation' "
    ...         "GROUP BY bench").pl()

The connection is read-only and confined to the traces folder: DuckDB may read files under
``root`` only (no other file, no network, no extension installs), its configuration is locked,
(a root on an object store, ``s3://bucket/prefix``, is read through the fsspec filesystem of
:mod:`catalog.location`, registered with DuckDB, and confined to that prefix the same way),
and :func:`run_query` — what ``query`` and the dashboard's console run user SQL through —
refuses every statement that is not a query, so a typed ``COPY``, ``ATTACH``, ``CREATE`` or
``SET`` can neither write anywhere nor change what other users see.

Routing figures read ``summary_tree_layers`` and ``summary_layers`` (:mod:`analysis.summaries`,
built once per run by :func:`analysis.summaries.ensure`) instead of scanning ``routing``. Views
read the Parquet files lazily with hive partitioning (``model``, ``bench``, ``run`` and, for
replay results, ``config`` and ``block`` become columns) and show only what is final: rows of
complete runs (with the run's ``role`` as a column) and of complete replay blocks computed from
the current capture of their run. Running captures and interrupted replays are left out.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import duckdb
import pyarrow as pa

import console
from analysis import summaries
from catalog import Catalog, CatalogError, location, partition_value, reader, schema
from catalog.results import RESULT_TABLES, complete_blocks
from errors import UserError

VIEWS = (*schema.TRACE_TABLES, "runs", "quality", *RESULT_TABLES, *summaries.TABLES,
         *schema.BATCH_PROFILE_TABLES)


_WARNED: set[str] = set()


def warn(line: str) -> None:
    """Say on stderr, once per process, what a view leaves out and how to fix it."""
    if line not in _WARNED:
        _WARNED.add(line)
        print(f"warning: {line}", file=sys.stderr)


def _catalog_tables(root: Path, roles) -> tuple[pa.Table, pa.Table]:
    """(complete runs with role, run id and whether their routing summaries are fresh,
    complete replay blocks) as small Arrow tables."""
    runs = Catalog(root).runs(roles=roles)
    run_rows = pa.Table.from_pylist(
        [dict(model=partition_value(r.model), bench=r.bench, run=r.name, role=r.role,
              run_id=r.run_id, summarised=summaries.is_fresh(root, r)) for r in runs],
        schema=pa.schema([*((c, pa.string()) for c in ("model", "bench", "run", "role",
                                                        "run_id")),
                          ("summarised", pa.bool_())]))
    prompts = {(partition_value(r.model), r.bench, r.name): r.prompt_indices() for r in runs}
    skipped: list[str] = []  # torn result configs: left out, and said so
    blocks = [dict(b, table=t) for t in RESULT_TABLES for b in complete_blocks(root, t, skipped)
              if b.pop("prompts") == prompts.get((b["model"], b["bench"], b["run"]))]
    for line in skipped:
        warn(line)
    block_rows = pa.Table.from_pylist(blocks, schema=pa.schema(
        [(c, pa.string()) for c in ("model", "bench", "run", "config", "block", "run_id",
                                    "table")]))
    return run_rows, block_rows


def connect(root: str | Path = "traces", database: str = ":memory:",
            roles: tuple[str, ...] | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view for every table found under ``root``; ``roles`` limits
    every view to runs of those roles (default: all, with ``role`` as a column)."""
    root = location.root(root)
    con = duckdb.connect(database)
    remote = location.duckdb_filesystem(root)
    if remote is not None:
        con.register_filesystem(remote)
    con.execute(f"SET threads = {console.threads.current()}")  # never more than this process's CPUs
    runs, blocks = _catalog_tables(root, roles)
    for name, table in (("_complete_runs", runs), ("_complete_blocks", blocks)):
        con.register("_arrow", table)  # tables, not registrations: cursors must see them too
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _arrow")
        con.unregister("_arrow")
    for name in VIEWS:
        folder = root / summaries.FOLDER / name if name in summaries.TABLES else root / name
        if not any(folder.rglob("*.parquet")):
            continue
        reader.check_files(folder, name)  # damaged or retyped parts: refused, naming the file
        glob = location.display(folder).replace("'", "''") + "/**/*.parquet"
        scan = f"read_parquet('{glob}', hive_partitioning = true, union_by_name = true)"
        if name in RESULT_TABLES:
            body = (f"SELECT t.* FROM {scan} t SEMI JOIN (SELECT b.* FROM _complete_blocks b "
                    f"JOIN _complete_runs r USING (model, bench, run, run_id) WHERE b.table = "
                    f"'{name}') c USING (model, bench, run, config, block)")
        elif name in summaries.TABLES:  # fresh summaries of complete runs only
            body = (f"SELECT t.*, c.role FROM {scan} t JOIN _complete_runs c "
                    "USING (model, bench, run) WHERE c.summarised")
        elif name in schema.BATCH_PROFILE_TABLES:  # measurements, not runs: every one
            body = f"SELECT * FROM {scan}"
        elif name == "runs":
            body = f"SELECT t.* FROM {scan} t SEMI JOIN _complete_runs c USING (model, bench, run)"
        else:
            body = (f"SELECT t.*, c.role FROM {scan} t JOIN _complete_runs c "
                    "USING (model, bench, run)")
        try:
            con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")
        except duckdb.Error as exc:  # DuckDB reads the files' schemas here
            first = str(exc).strip().splitlines()[0]
            if name in summaries.TABLES:  # derived data: leave it out, never fail the rest
                warn(f"the {name} view is left out (a summary file is damaged: {first[:200]}); "
                     f"run `report` or delete {folder} to rebuild it")
                continue
            raise CatalogError(f"the {name} table cannot be read ({first[:300]}); recapture "
                               "the affected run") from None
    lock_down(con, root)
    return con


def lock_down(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """Files under ``root`` only, no network or extension installs, configuration locked."""
    folder = location.allowed_prefix(root).replace("'", "''")
    con.execute(f"SET allowed_directories = ['{folder}']")
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET lock_configuration = true")


QUERY_STATEMENTS = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)


class QueryRefused(UserError, ValueError):
    """SQL that is not a read-only query; the message is one line for the user."""


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> duckdb.DuckDBPyRelation:
    """Run user SQL: queries only (``SELECT``, ``WITH … SELECT``, ``EXPLAIN``), never a statement
    that writes a file, attaches a database, or changes views or settings."""
    statements = con.extract_statements(sql)
    if not statements:
        raise QueryRefused("empty query; write a SELECT")
    refused = [s for s in statements if s.type not in QUERY_STATEMENTS
               or (s.type == duckdb.StatementType.EXPLAIN and not _explains_a_query(con, s.query))]
    if refused:
        kind = refused[0].type.name
        if refused[0].type == duckdb.StatementType.EXPLAIN:
            kind = "EXPLAIN of anything but a SELECT (EXPLAIN ANALYZE runs its statement)"
        raise QueryRefused(f"only read-only queries are allowed here (SELECT, WITH … SELECT, "
                           f"EXPLAIN), not {kind}; the traces are read-only")
    if len(statements) > 1:
        raise QueryRefused("one query at a time, please (found "
                           f"{len(statements)} statements)")
    return con.sql(sql)


_EXPLAIN = re.compile(r"^\s*EXPLAIN(\s+ANALYZE)?\s+", re.IGNORECASE)


def _explains_a_query(con: duckdb.DuckDBPyConnection, statement: str) -> bool:
    """Whether an EXPLAIN statement explains a SELECT: the text after ``EXPLAIN [ANALYZE]`` must
    parse, with DuckDB's own parser, as exactly one SELECT. ``EXPLAIN ANALYZE`` executes what
    it explains (a COPY … TO, CREATE, INSERT or DELETE would run), and anything the prefix does
    not match (comments, options) is refused rather than guessed at."""
    match = _EXPLAIN.match(statement)
    if not match:
        return False
    try:
        inner = con.extract_statements(statement[match.end():])
    except duckdb.Error:
        return False
    return len(inner) == 1 and inner[0].type == duckdb.StatementType.SELECT


def views(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_type = 'VIEW' "
        "ORDER BY table_name").fetchall()]


def damaged_file(root: str | Path, sql: str, error: duckdb.Error) -> str | None:
    """After a query failed reading data (DuckDB names no file for a corrupt page), the first
    Parquet file of the views ``sql`` mentions that does not read back with its page checksums,
    as one line for the user; None when the error is not about the data or no file is found."""
    if isinstance(error, (duckdb.ParserException, duckdb.BinderException,
                          duckdb.CatalogException)):
        return None
    root = location.root(root)
    words = set(re.findall(r"[A-Za-z_]+", sql.lower()))
    for name in VIEWS:
        if name not in words:
            continue
        folder = root / summaries.FOLDER / name if name in summaries.TABLES else root / name
        for path in sorted(folder.rglob("*.parquet")):
            try:
                location.read_table(path, page_checksum_verification=True)
            except (pa.ArrowException, OSError) as exc:
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                why = why.replace(str(path), "the file")[:200]
                return (f"{path}: corrupt or unreadable {name} file ({why}); recapture the run "
                        "(or delete the file if it is a replay result and replay again)")
    return None
