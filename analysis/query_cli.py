"""``query``: SQL over the traces and replay results with DuckDB.

    query "SELECT bench, count(*) AS trees, avg(accepted_length) AS tau FROM trees GROUP BY bench"
    query --schema
    query "SELECT * FROM replay_open" --format parquet --out results.parquet
    query "SELECT role, count(*) AS trees FROM trees GROUP BY role" --role all
"""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb

import console
from analysis.sql import connect, damaged_file, run_query, views
from catalog import atomic, location
from errors import UserError, fail

FORMATS = ("table", "csv", "json", "parquet")


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(
        prog="query", examples=__doc__.split("\n\n")[1],
        description="Run SQL over every trace table (sequences, trees, nodes, routing, moe_io, "
                    "runs) and replay result (replay_open, replay_closed) as named DuckDB views; "
                    "hive partitions (model, bench, run, config) and each run's role are "
                    "columns. The views hold evaluation runs unless --role says otherwise. "
                    "Read-only: queries (SELECT, WITH, EXPLAIN) only.")
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
    args = p.parse_args(argv)
    try:
        args.traces = location.from_args(args.traces, args.storage_options)
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
        rel = run_query(con, args.sql)
        if args.format == "parquet" and str(args.out) == "-":  # stdout, on purpose
            import io

            import pyarrow.parquet as pq
            buffer = io.BytesIO()
            pq.write_table(rel.to_arrow_table(), buffer, compression="zstd")
            sys.stdout.buffer.write(buffer.getvalue())
            sys.stdout.flush()
            return 0
        if args.format == "parquet":  # written by Python (DuckDB writes no file), atomically
            atomic.write_table(args.out, rel.to_arrow_table())
            return 0
        df = rel.pl()
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
    else:
        import polars as pl
        with pl.Config(tbl_rows=args.max_rows, tbl_cols=-1, tbl_width_chars=160,
                       tbl_hide_dataframe_shape=False):
            text = str(df)
    if args.out and str(args.out) != "-":  # - is stdout, on purpose
        try:
            atomic.write_bytes(args.out, text.encode("utf-8"))
        except OSError as exc:
            return fail("query", f"cannot write {args.out}: {exc.strerror or exc}; choose a "
                        "writable --out")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
