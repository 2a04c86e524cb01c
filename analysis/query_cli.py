"""``query``: SQL over the traces and replay results with DuckDB.

    query "SELECT run, bench, count(*) AS trees, avg(accepted_length) AS tau FROM trees GROUP BY ALL"
    query "SELECT run, ranking, coverage, budget, avg(rse) AS rse FROM replay_open GROUP BY ALL ORDER BY ALL"
    query "SELECT * FROM variants"         # every replay variant, and which the views show
    query --schema
    query "SELECT * FROM replay_open" --format parquet --out results.parquet
    query "SELECT role, count(*) AS trees FROM trees GROUP BY role" --role all
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import duckdb
import pyarrow as pa

from moe_spec import console
from moe_spec.analysis.sql import (
    MEMORY_ENV,
    RESULT_TABLES,
    TIMEOUT_ENV,
    connect,
    damaged_file,
    hidden_variants,
    run_query,
    sql_limits,
    views,
)
from moe_spec.catalog import atomic, location
from moe_spec.catalog.runs import add_legacy_argument, allow_legacy
from moe_spec.errors import UserError, fail

FORMATS = ("table", "csv", "json", "parquet")
MAX_ROWS = 1_000_000  # rows --format table may show


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_args(args)
    except UserError as exc:
        return fail("query", exc)
    if not args.traces.is_dir():
        return fail("query", f"no traces folder at {args.traces}; run "
                    f"`{console.command('capture')}` first or pass --traces")
    try:
        con = connect(args.traces, roles=None if args.role == "all" else (args.role,))
    except UserError as exc:
        return fail("query", exc)
    names = views(con)
    if args.schema:
        _print_schema(con, names, args.role, args.traces)
        return 0
    if not args.sql:
        return fail("query", "give a SQL query or --schema")
    if args.format == "parquet" and not args.out:
        return fail("query", "--format parquet needs --out FILE")
    try:
        result = _run(con, args.sql, args.timeout, args.memory_limit)
        if args.format == "parquet":
            _write_parquet(result, args.out)
            return 0
        import polars as pl
        df = pl.from_arrow(result)
    except duckdb.Error as exc:
        return fail("query", _query_failure(args.traces, args.sql, exc, names))
    except OSError as exc:
        return fail("query", _cannot_write(args.out, exc))
    except UserError as exc:  # a refused query
        return fail("query", exc)
    try:
        text = _RENDERERS[args.format](df, result, args.max_rows)
    except UserError as exc:  # a result the format cannot hold
        return fail("query", exc)
    return _emit(text, args.out)


def _parser() -> console.ArgumentParser:
    """The command line of ``query``."""
    p = console.ArgumentParser(
        prog="query", examples=__doc__.split("\n\n")[1],
        description="Run SQL over every trace table (sequences, trees, nodes, routing, moe_io, "
                    "runs with its capture settings as columns, quality, summary_tree_layers, "
                    "summary_layers, batch_profile, batch_profile_passes) and replay result ("
                    + ", ".join(RESULT_TABLES) + ": one whole variant per curve; <table>_all: every "
                    "variant, and the variants view lists them) as named DuckDB views; hive "
                    "partitions (model, bench, run) and each run's role are columns. The views "
                    "read exactly the files runs and replays committed, verified. They hold "
                    "evaluation runs unless --role says otherwise. Read-only: queries (SELECT, "
                    "WITH, EXPLAIN) only, bounded in time and memory.")
    p.add_argument("sql", nargs="?", help="the query")
    p.add_argument("--traces", default="traces", help="traces root: a folder or "
                                                      "s3://bucket/prefix")
    location.add_storage_options_argument(p)
    p.add_argument("--role", default="evaluation", choices=("evaluation", "calibration", "all"),
                   help="which runs the views hold (default evaluation: calibration runs are "
                        "not pooled into results unless asked; all: every role, `role` is a "
                        "column)")
    p.add_argument("--schema", action="store_true", help="list the views and their columns")
    p.add_argument("--format", default="table", choices=FORMATS, help="output format")
    p.add_argument("--out", type=Path, default=None, help="write here instead of stdout "
                                                          "(required for parquet)")
    p.add_argument("--max-rows", type=int, default=40, help="rows shown by --format table")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help=f"stop a query after this long (default ${TIMEOUT_ENV} or 120)")
    add_legacy_argument(p)
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help=f"the query's memory limit, e.g. 2GB (default ${MEMORY_ENV} or 4GB): "
                        "DuckDB's own, and the query process's address space (this plus "
                        "0.5 GiB) so no function can allocate past it")
    return p


def _check_args(args: argparse.Namespace) -> None:
    """Resolve ``--traces`` and check the limits, ``--max-rows`` and ``--out`` (UserError)."""
    args.traces = location.from_args(args.traces, args.storage_options)
    allow_legacy(args)
    sql_limits(args.memory_limit, args.timeout)
    if args.memory_limit:
        import os
        os.environ[MEMORY_ENV] = args.memory_limit  # the connection's limit
    if not 1 <= args.max_rows <= MAX_ROWS:
        raise UserError(f"--max-rows must be between 1 and {MAX_ROWS:,}; "
                        "write the whole result with --format parquet --out FILE")
    check_out(args.out, args.traces)


def _print_schema(con: duckdb.DuckDBPyConnection, names: list[str], role: str, traces) -> None:
    """Print each view and its columns (``--schema``), or how to get some."""
    if not names:
        print(f"no tables of {role} runs under {traces} yet; run "
              f"`{console.command('capture')}` first" + ("" if role == "all" else
                                                         " or pass --role all"))
    for name in names:
        cols = con.execute(f"DESCRIBE {name}").fetchall()
        print(f"{name}: " + ", ".join(f"{c[0]} {c[1]}" for c in cols))


def _run(con: duckdb.DuckDBPyConnection, sql: str, timeout: float | None,
         memory: str | None) -> pa.Table:
    """Run the user's query (in a bounded child process, :func:`analysis.sql.run_query`);
    notes on stderr for default-variant views that hide variants."""
    result = run_query(con, sql, timeout=timeout, memory=memory)
    for note in hidden_variants(con, sql):
        print(f"note: {note}", file=sys.stderr)
    return result


def _write_parquet(result: pa.Table, out: Path) -> None:
    """The result as Parquet: to stdout for ``--out -``, else to the file, atomically."""
    if str(out) == "-":  # stdout, on purpose
        import io

        import pyarrow.parquet as pq
        buffer = io.BytesIO()
        pq.write_table(result, buffer, compression="zstd")
        sys.stdout.buffer.write(buffer.getvalue())
        sys.stdout.flush()
        return
    atomic.write_table(out, result)  # written by Python (DuckDB writes no file), atomically
    print(f"wrote {result.num_rows} rows × {result.num_columns} columns to {out}",
          file=sys.stderr)


def _query_failure(traces, sql: str, exc: duckdb.Error, names: list[str]) -> str:
    """One line for a query DuckDB could not run: the damaged file it read, else its error."""
    damaged = damaged_file(traces, sql, exc)  # a corrupt page names no file
    if damaged:
        return damaged
    first = str(exc).strip().splitlines()[0]
    return f"{first} (views: {', '.join(names) or 'none'})"


def _cannot_write(out: Path | None, exc: OSError) -> str:
    """One line for an ``--out`` that could not be written."""
    return f"cannot write {out}: {exc.strerror or exc}; choose a writable --out"


def _csv(df, result: pa.Table, max_rows: int) -> str:
    """The result as CSV; list columns are refused (UserError): CSV cannot hold them."""
    nested = [name for name, dtype in df.schema.items() if dtype.is_nested()]
    if nested:
        raise UserError(f"CSV cannot hold the list columns {', '.join(nested)}; select "
                        "other columns, or use --format json or --format parquet --out FILE")
    return df.write_csv()


def _json(df, result: pa.Table, max_rows: int) -> str:
    """The result as JSON records."""
    return df.write_json()


def _box(df, result: pa.Table, max_rows: int) -> str:
    """DuckDB's own box rendering (types under the names, tiny numbers in e-notation) of the
    first ``max_rows`` rows, and the row count."""
    shown = result.slice(0, max_rows)
    text = str(duckdb.connect().from_arrow(shown)).rstrip("\n")
    return text + f"\n{result.num_rows} row(s)" + (
        f", {max_rows} shown (--max-rows)" if result.num_rows > max_rows else "")


_RENDERERS = {"csv": _csv, "json": _json, "table": _box}  # --format -> text (parquet: binary)


def _emit(text: str, out: Path | None) -> int:
    """Write the text to ``--out`` (atomically) or print it; the exit status."""
    if out and str(out) != "-":  # - is stdout, on purpose
        try:
            atomic.write_bytes(out, text.encode("utf-8"))
        except OSError as exc:
            return fail("query", _cannot_write(out, exc))
    else:
        print(text)
    return 0


def check_out(out: Path | None, traces) -> None:
    """``--out`` never lands inside the traces root: a file there could be read as a part of a
    run or replace one."""
    atomic.check_outside(out, traces, "--out")  # the one owner of the rule


if __name__ == "__main__":
    sys.exit(main())
