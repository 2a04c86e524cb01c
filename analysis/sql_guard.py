"""What user SQL may do, decided on what DuckDB parsed: one read-only query, calling only the
functions allowed here, under memory and time limits.

This module imports DuckDB and the project's error classes only, so the child process that runs
user SQL (:mod:`analysis.sql_child`) starts without the catalog, polars or torch. It owns

- the limits (:func:`sql_limits`: validated, one line for a zero, tiny or absurd size),
- the statement check (:func:`check_query`: queries only, and every function the parsed
  statement calls, as ``json_serialize_sql`` sees it, on the allowlist: built-in scalar,
  aggregate and window functions called by their plain names, table functions from
  :data:`TABLE_FUNCTIONS`; a name qualified by a catalog or schema (``system.main.repeat``,
  however it is spelled, comments included) and ``query(…)``/``query_table(…)``, which would
  run SQL no check saw, are refused),
- the confinement of a connection (:func:`confine`: files under one folder, no network or
  extension installs, no spill folder, size guards on functions that build one huge value,
  configuration locked).
"""

from __future__ import annotations

import json
import os
import re

import duckdb

from moe_spec.errors import UserError

# bounds on user SQL: DuckDB's memory limit (no spilling to disk: the spill folder would be
# readable through the views' confinement), a statement timeout, and the size of one value
MEMORY_ENV, TIMEOUT_ENV = "MOESPEC_SQL_MEMORY", "MOESPEC_SQL_TIMEOUT"
DEFAULT_MEMORY, DEFAULT_TIMEOUT = "4GB", 120.0
MIN_MEMORY = 64 * 2**20  # bytes: below this DuckDB and the child's Python cannot start
MAX_VALUE = 256 * 2**20  # bytes (or list elements) one value built by repeat/lpad/… may have
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # DuckDB's own meanings
# scalar functions whose result size the caller chooses: each is wrapped by a macro of the same
# name that refuses an oversized result before calling the built-in, a fast answer before the
# child's operating-system limit stops it (its parameters, the size of its result; the last
# parameter is the size argument, checked before the built-in runs)
_SIZED = {"repeat": ("s, n", "length(s) * n"), "lpad": ("s, n, c", "n"),
          "rpad": ("s, n, c", "n"), "list_resize": ("l, n", "n"), "array_resize": ("l, n", "n")}

# moe_io's vectors stored in bfloat16 are its 16-bit patterns (uint16, lossless); these macros
# decode them in SQL exactly as catalog.reader.matrix does: bf16(bits) one value, bf16_list(l) a
# vector (e.g. SELECT bf16_list(hidden) FROM moe_io; for runs stored in float16/32 the column is
# already floats)
_BITS = "b::INTEGER"
DECODERS = {
    "bf16(b)": (f"(CASE WHEN (({_BITS} >> 7) & 255) = 255 THEN (CASE WHEN ({_BITS} & 127) = 0 "
                f"THEN (CASE WHEN {_BITS} >> 15 = 1 THEN '-inf' ELSE 'inf' END)::DOUBLE "
                "ELSE 'nan'::DOUBLE END) "
                f"ELSE (CASE WHEN {_BITS} >> 15 = 1 THEN -1.0 ELSE 1.0 END) * "
                f"(CASE WHEN (({_BITS} >> 7) & 255) = 0 THEN (({_BITS} & 127)::DOUBLE / 128.0) "
                f"* pow(2.0, -126) ELSE (1.0 + ({_BITS} & 127)::DOUBLE / 128.0) * "
                f"pow(2.0, (({_BITS} >> 7) & 255) - 127) END) END)::FLOAT"),
    "bf16_list(l)": "list_transform(l, lambda x: bf16(x))",
}

# table functions user SQL may call (FROM f(…)): generators and readers of files, which the
# confinement keeps under the traces root; everything else (query, query_table, checkpoint,
# logging, external resources, …) is refused
TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "summary", "glob", "json_each", "json_tree",
    "read_parquet", "parquet_scan", "parquet_metadata", "parquet_schema", "parquet_file_metadata",
    "parquet_kv_metadata", "read_csv", "read_csv_auto", "read_json", "read_json_auto",
    "read_ndjson", "read_ndjson_auto", "read_text", "read_blob",
    "duckdb_views", "duckdb_tables", "duckdb_columns", "duckdb_functions", "duckdb_types",
    "duckdb_keywords", "pragma_table_info"})
REFUSED_FUNCTIONS = frozenset({"query", "query_table"})  # SQL in a string: never checked
# what the parser calls functions without the catalog listing them as scalars: unnest/unlist in
# a select list, the postfix factorial operator
SPECIAL_FUNCTIONS = frozenset({"unnest", "unlist", "!"})
_FUNCTION_KINDS = ("scalar", "aggregate", "window", "macro")


class QueryRefused(UserError, ValueError):
    """SQL that is not a read-only query; the message is one line for the user."""


class QueryTimeout(UserError, RuntimeError):
    """A query that ran past its time or memory bound; the message is one line."""


def memory_bytes(memory: str) -> int:
    """``4GB`` -> bytes, as DuckDB reads the size (GB = 1000**3, GiB = 2**30)."""
    m = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,6})?)\s*([KMGT]?i?B)\s*", memory, re.IGNORECASE)
    if not m:
        raise QueryRefused(f"memory limit {memory!r} is not a size like 4GB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def physical_memory() -> int:
    """This machine's memory in bytes (the ceiling of a memory limit)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not reported: no ceiling but 1 TiB
        return 2**40


def sql_limits(memory: str | None = None, timeout: float | None = None) -> tuple[str, float]:
    """(memory limit, timeout in s) for user SQL: the arguments, else ``$MOESPEC_SQL_MEMORY`` /
    ``$MOESPEC_SQL_TIMEOUT``, else 4GB / 120 s; a limit that is not a size, below
    :data:`MIN_MEMORY` or above the machine's memory is refused in one line."""
    memory = memory or os.environ.get(MEMORY_ENV) or DEFAULT_MEMORY
    if timeout is None:
        try:
            timeout = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
        except ValueError:
            raise QueryRefused(f"${TIMEOUT_ENV} must be a number of seconds") from None
    if not (timeout > 0 and timeout < 1e6):
        raise QueryRefused(f"a query timeout of {timeout} s is out of range (0 < s < 1e6)")
    size = memory_bytes(memory)
    if size < MIN_MEMORY:
        raise QueryRefused(f"memory limit {memory.strip()} is below the {MIN_MEMORY // 2**20} MiB "
                           "a query needs to start; give e.g. --memory-limit 1GB")
    if size > physical_memory():
        raise QueryRefused(f"memory limit {memory.strip()} is more than this machine's "
                           f"{physical_memory() / 2**30:.0f} GiB; give e.g. --memory-limit 4GB")
    return memory.strip(), timeout


def confine(con: duckdb.DuckDBPyConnection, prefix: str, memory: str | None = None) -> None:
    """Files under ``prefix`` only (DuckDB adds its spill folder to the allowed directories, so
    spilling is off), no network or extension installs, a memory limit, guards on functions
    that build one huge value, configuration locked."""
    folder = prefix.replace("'", "''")
    con.execute("SET temp_directory = ''")  # no spill folder: nothing else readable
    con.execute(f"SET memory_limit = '{sql_limits(memory)[0]}'")
    con.execute(f"SET allowed_directories = ['{folder}']")
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    for name, (params, size) in _SIZED.items():
        guarded = (f"CASE WHEN {size} > {MAX_VALUE} THEN error('{name}: a value of more than "
                   f"{MAX_VALUE} bytes or elements is refused here') ELSE n END")
        args = params.split(", ")
        args = ", ".join(guarded if a == "n" else a for a in args)
        con.execute(f"CREATE OR REPLACE TEMP MACRO {name}({params}) AS "
                    f"system.main.{name}({args})")
    for name, body in DECODERS.items():
        con.execute(f"CREATE OR REPLACE TEMP MACRO {name} AS {body}")
    con.execute("SET lock_configuration = true")


def _kind(statement) -> str:
    """A statement's type name; DuckDB's parser knows types its Python enum does not
    (``UPDATE EXTENSIONS``): those are named as unknown, never a traceback."""
    try:
        return statement.type.name
    except ValueError:
        return "an unknown statement type"


def check_query(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Refuse, in one line, anything but one read-only query calling allowed functions."""
    statements = con.extract_statements(sql)
    if not statements:
        raise QueryRefused("empty query; write a SELECT")
    refused = [s for s in statements if _kind(s) not in ("SELECT", "EXPLAIN")
               or (s.type == duckdb.StatementType.EXPLAIN and _explained(con, s.query) is None)]
    if refused:
        kind = _kind(refused[0])
        if kind == "EXPLAIN":
            kind = "EXPLAIN of anything but a SELECT (EXPLAIN ANALYZE runs its statement)"
        raise QueryRefused(f"only read-only queries are allowed here (SELECT, WITH … SELECT, "
                           f"EXPLAIN), not {kind}; the traces are read-only")
    if len(statements) > 1:
        raise QueryRefused("one query at a time, please (found "
                           f"{len(statements)} statements)")
    query = statements[0].query
    if statements[0].type == duckdb.StatementType.EXPLAIN:
        query = _explained(con, query)
    check_functions(con, query)


def _parsed(con: duckdb.DuckDBPyConnection, query: str) -> dict:
    """DuckDB's parse of one SELECT as JSON (``json_serialize_sql``)."""
    try:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [query]).fetchall()[0][0])
    except (duckdb.Error, ValueError, TypeError) as exc:
        raise QueryRefused(f"this query cannot be checked ({str(exc).splitlines()[0][:200]}); "
                           "write it as a plain SELECT") from None
    if tree.get("error"):
        raise QueryRefused(f"this query cannot be checked ({tree.get('error_message')}); "
                           "write it as a plain SELECT (PIVOT: use GROUP BY)")
    return tree


def _calls(node, table: bool = False):
    """(name, catalog, schema, is table function) of every function a parsed statement calls."""
    if isinstance(node, list):
        for item in node:
            yield from _calls(item)
    elif isinstance(node, dict):
        if node.get("type") == "TABLE_FUNCTION" and isinstance(node.get("function"), dict):
            f = node["function"]
            yield f.get("function_name"), f.get("catalog"), f.get("schema"), True
            yield from _calls(f.get("arguments"))
            for key, value in node.items():
                if key != "function":
                    yield from _calls(value)
            return
        if node.get("class") in ("FUNCTION", "WINDOW") and "function_name" in node:
            yield node["function_name"], node.get("catalog"), node.get("schema"), False
        for value in node.values():
            yield from _calls(value)


def allowed_functions(con: duckdb.DuckDBPyConnection) -> frozenset:
    """Names user SQL may call as functions: DuckDB's built-in scalar, aggregate, window and
    macro functions, and this connection's own macros (size guards, decoders)."""
    kinds = ", ".join(f"'{k}'" for k in _FUNCTION_KINDS)
    names = con.execute("SELECT DISTINCT function_name FROM duckdb_functions() WHERE "
                        f"function_type IN ({kinds})").fetchall()
    return (frozenset(n for (n,) in names) | SPECIAL_FUNCTIONS) - REFUSED_FUNCTIONS


def check_functions(con: duckdb.DuckDBPyConnection, query: str) -> None:
    """Every function ``query`` calls is on the allowlist and named plainly (refused in one
    line otherwise): decided on DuckDB's parse, so comments, quoting and case cannot hide a
    ``system.main.…`` or a ``query('…')``."""
    allowed = allowed_functions(con)
    for name, catalog, schema, table in _calls(_parsed(con, query)):
        if catalog or schema:
            raise QueryRefused(f"queries may not name a function by its catalog or schema "
                               f"({'.'.join(p for p in (catalog, schema, name) if p)}: the "
                               "system catalog's functions go around the size guards); call "
                               "functions by their plain names")
        if (name in TABLE_FUNCTIONS) if table else (name in allowed):
            continue
        if name in REFUSED_FUNCTIONS:
            raise QueryRefused(f"{name}(…) runs SQL held in a string, which is not checked; "
                               "write that SQL as the query itself")
        raise QueryRefused(f"the {'table ' if table else ''}function {name} is not allowed "
                           "here; the console runs read-only queries over the views")


_EXPLAIN = re.compile(r"^\s*EXPLAIN(\s+ANALYZE)?\s+", re.IGNORECASE)


def _explained(con: duckdb.DuckDBPyConnection, statement: str) -> str | None:
    """The SELECT an EXPLAIN statement explains, or None: the text after ``EXPLAIN [ANALYZE]``
    must parse, with DuckDB's own parser, as exactly one SELECT. ``EXPLAIN ANALYZE`` executes
    what it explains (a COPY … TO, CREATE, INSERT or DELETE would run), and anything the prefix
    does not match (comments, options) is refused rather than guessed at."""
    match = _EXPLAIN.match(statement)
    if not match:
        return None
    try:
        inner = con.extract_statements(statement[match.end():])
    except duckdb.Error:
        return None
    if len(inner) == 1 and inner[0].type == duckdb.StatementType.SELECT:
        return inner[0].query
    return None
