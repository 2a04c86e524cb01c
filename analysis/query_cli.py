"""``query``: SQL over the traces and replay results with DuckDB.

    query "SELECT run, bench, count(*) AS trees, avg(accepted_length) AS tau FROM trees GROUP BY ALL"
    query "SELECT run, ranking, coverage, budget, avg(rse) AS rse FROM replay_open GROUP BY ALL ORDER BY ALL"
    query "SELECT * FROM variants"         # every replay variant, and which the views show
    query --schema
    query "SELECT * FROM replay_open" --format parquet --out results.parquet
    query "SELECT role, count(*) AS trees FROM trees GROUP BY role" --role all
"""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb

import console
from analysis.sql import (
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
from catalog import atomic, location
from errors import UserError, fail

FORMATS = ("table", "csv", "json", "parquet")


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(
        prog="query", examples=__doc__.split("\n\n")[1],
        description="Run SQL over every trace table (sequences, trees, nodes, routing, moe_io, "
                    "runs with its capture settings as columns, quality, summary_tree_layers, "
                    "summary_layers, batch_profile, batch_profile_passes) and replay result ("
                    + ", ".join(RESULT_TABLES) + ": one variant per cell; <table>_all: every "
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
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help=f"DuckDB's memory limit, e.g. 2GB (default ${MEMORY_ENV} or 4GB)")
    args = p.parse_args(argv)
    try:
        args.traces = location.from_args(args.traces, args.storage_options)
        sql_limits(args.memory_limit, args.timeout)
        if args.memory_limit:
            import os
            os.environ[MEMORY_ENV] = args.memory_limit  # the connection's limit
        if args.max_rows < 1:
            raise UserError(f"--max-rows {args.max_rows} must be at least 1")
        check_out(args.out, args.traces)
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
        if not names:
            print(f"no tables of {args.role} runs under {args.traces} yet; run "
                  f"`{console.command('capture')}` first" + ("" if args.role == "all" else
                                                             " or pass --role all"))
        for name in names:
            cols = con.execute(f"DESCRIBE {name}").fetchall()
            print(f"{name}: " + ", ".join(f"{c[0]} {c[1]}" for c in cols))
        return 0
    if not args.sql:
        return fail("query", "give a SQL query or --schema")
    if args.format == "parquet" and not args.out:
        return fail("query", "--format parquet needs --out FILE")
    try:
        result = run_query(con, args.sql, timeout=args.timeout)
        for note in hidden_variants(con, args.sql):
            print(f"note: {note}", file=sys.stderr)
        if args.format == "parquet" and str(args.out) == "-":  # stdout, on purpose
            import io

            import pyarrow.parquet as pq
            buffer = io.BytesIO()
            pq.write_table(result, buffer, compression="zstd")
            sys.stdout.buffer.write(buffer.getvalue())
            sys.stdout.flush()
            return 0
        if args.format == "parquet":  # written by Python (DuckDB writes no file), atomically
            atomic.write_table(args.out, result)
            print(f"wrote {result.num_rows} rows × {result.num_columns} columns to {args.out}",
                  file=sys.stderr)
            return 0
        import polars as pl
        df = pl.from_arrow(result)
    except duckdb.Error as exc:
        damaged = damaged_file(args.traces, args.sql, exc)  # a corrupt page names no file
        if damaged:
            return fail("query", damaged)
        first = str(exc).strip().splitlines()[0]
        return fail("query", f"{first} (views: {', '.join(names) or 'none'})")
    except OSError as exc:
        return fail("query", f"cannot write {args.out}: {exc.strerror or exc}; choose a writable "
                    "--out")
    except UserError as exc:  # a refused query
        return fail("query", exc)
    if args.format == "csv":
        nested = [name for name, dtype in df.schema.items() if dtype.is_nested()]
        if nested:
            return fail("query", f"CSV cannot hold the list columns {', '.join(nested)}; select "
                        "other columns, or use --format json or --format parquet --out FILE")
        text = df.write_csv()
    elif args.format == "json":
        text = df.write_json()
    else:  # DuckDB's own box rendering (types under the names, tiny numbers in e-notation)
        shown = result.slice(0, args.max_rows)
        text = str(duckdb.connect().from_arrow(shown)).rstrip("\n")
        text += f"\n{result.num_rows} row(s)" + (
            f", {args.max_rows} shown (--max-rows)" if result.num_rows > args.max_rows else "")
    if args.out and str(args.out) != "-":  # - is stdout, on purpose
        try:
            atomic.write_bytes(args.out, text.encode("utf-8"))
        except OSError as exc:
            return fail("query", f"cannot write {args.out}: {exc.strerror or exc}; choose a "
                        "writable --out")
    else:
        print(text)
    return 0


def check_out(out: Path | None, traces) -> None:
    """``--out`` never lands inside the traces root: a file there could be read as a part of a
    run or replace one."""
    if out is None or str(out) == "-" or location.is_remote(traces):
        return
    import os
    inside = os.path.realpath(out)
    root = os.path.realpath(traces)
    if inside == root or inside.startswith(root.rstrip(os.sep) + os.sep):
        raise UserError(f"--out {out} is inside the traces folder {traces}; write results "
                        "elsewhere (the traces hold what captures and replays commit)")


if __name__ == "__main__":
    sys.exit(main())
