"""User SQL in a child process under operating-system limits: the one place ``query`` and the
dashboard's console run it (:func:`analysis.sql.run_query` calls :func:`run`).

DuckDB bounds what its buffer manager allocates, but not what a function builds outside it
(``len(range(0, 300000000))``, ``printf('%1500000000d', 1)``, ``damerau_levenshtein`` of two
long strings took 7–19 GiB and ignored the statement timeout). So the query runs in a fresh
Python (``python -m moe_spec.analysis.sql_child``) that, before DuckDB is imported, sets

- ``RLIMIT_AS`` (address space) to the memory limit plus :data:`HEADROOM` for Python, DuckDB
  and Arrow themselves (about 0.4 GiB of address space with glibc's arenas capped), so no
  allocation of any function can take the machine's memory: it fails inside the child;
- ``RLIMIT_CPU`` to the timeout times the child's threads (plus a little), so a loop that never
  returns to DuckDB's interrupt check is ended by the kernel;

and the parent kills it :data:`GRACE` s after the timeout whatever it is doing. The child
rebuilds the connection from a recipe the parent sends (the tables and view definitions of the
parent's connection: views, verification and catalog work stay in the parent), confines it
(:func:`analysis.sql_guard.confine`), checks the statement (:func:`analysis.sql_guard.check_query`)
and sends back an Arrow IPC stream, or one line. It imports DuckDB, Arrow and
:mod:`analysis.sql_guard` only (no catalog, polars or torch): it starts in a fraction of a
second.
"""

from __future__ import annotations

import math
import os
import pickle
import resource
import signal
import subprocess
import sys

HEADROOM = 512 * 2**20  # bytes of address space beyond DuckDB's memory limit (Python, DuckDB,
# Arrow and the result's copy; ~0.4 GiB is mapped before the query runs)
GRACE = 2.0  # s after the timeout before the parent kills the child
_ENV = {"MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MiB of address space per thread otherwise
        "ARROW_DEFAULT_MEMORY_POOL": "system", "OMP_NUM_THREADS": "1"}


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def run(request: dict, memory: str, timeout: float, threads: int):
    """Run ``request`` (``sql``, ``prefix``, ``root``, ``tables``: name -> Arrow IPC bytes,
    ``views``: CREATE VIEW statements in order) in a bounded child; the result as an Arrow
    table, or :class:`QueryRefused` / :class:`QueryTimeout` / a ``duckdb.Error`` with one line."""
    import duckdb
    import pyarrow as pa

    from moe_spec.analysis.sql_guard import (
        MEMORY_ENV,
        TIMEOUT_ENV,
        QueryRefused,
        QueryTimeout,
        memory_bytes,
    )
    cap = memory_bytes(memory) + HEADROOM
    cpu = math.ceil(timeout * max(1, threads)) + 2
    request = dict(request, memory=memory, timeout=timeout, threads=threads)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_spec.analysis.sql_child", str(cap), str(cpu)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, **_ENV), start_new_session=True)
    stopped = f"the query was stopped at {_gib(cap)} / {timeout:g} s"
    try:
        out, err = proc.communicate(pickle.dumps(request), timeout=timeout + GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise QueryTimeout(f"{stopped}: it ran past its {timeout:g} s limit; narrow it, or "
                           f"raise the limit (--timeout or ${TIMEOUT_ENV})") from None
    finally:
        if proc.poll() is None:  # an interrupted parent (Ctrl-C): never leave the child running
            proc.kill()
            proc.wait()
    if out[:1] == b"T":
        return pa.ipc.open_stream(out[1:]).read_all()
    if out[:1] == b"E":
        import json
        kind, message = json.loads(out[1:].decode("utf-8"))
        if kind == "refused":
            raise QueryRefused(message)
        if kind == "timeout":
            raise QueryTimeout(f"{stopped}: it ran past its {timeout:g} s limit; narrow it, or "
                               f"raise the limit (--timeout or ${TIMEOUT_ENV})")
        if kind != "memory":
            error = getattr(duckdb, kind, None)
            if not (isinstance(error, type) and issubclass(error, duckdb.Error)):
                error = duckdb.Error
            raise error(message)
    elif proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the CPU-time limit
        raise QueryTimeout(f"{stopped}: it used more than its {cpu} s of CPU time; narrow it, "
                           f"or raise the limit (--timeout or ${TIMEOUT_ENV})")
    elif proc.returncode >= 0 and b"MemoryError" not in err and b"bad_alloc" not in err:
        line = (err.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
        raise QueryRefused(f"the query process failed ({line[:200]}); this is a bug, please "
                           "report it with the query")
    raise QueryTimeout(f"{stopped}: it needed more than its memory limit ({memory}); narrow "
                       f"it, or raise the limit (--memory-limit or ${MEMORY_ENV})")


def _answer(kind: bytes, payload: bytes) -> None:
    out = os.fdopen(1, "wb", closefd=False)
    out.write(kind + payload)
    out.flush()


def _serve(request: dict) -> None:
    """In the child: rebuild the connection, confine it, check and run the query, answer."""
    import json
    import threading

    import duckdb
    import pyarrow as pa

    from moe_spec.analysis.sql_guard import QueryRefused, check_query, confine

    def fail(kind: str, message: str) -> None:
        _answer(b"E", json.dumps([kind, message]).encode("utf-8"))

    try:
        con = duckdb.connect(config={"threads": max(1, int(request["threads"]))})
        if request.get("root") is not None:  # an object store: its fsspec filesystem
            from moe_spec.catalog import location
            con.register_filesystem(location.duckdb_filesystem(request["root"]))
        for name, data in request["tables"].items():
            con.register("_arrow", pa.ipc.open_stream(data).read_all())
            con.execute(f'CREATE TABLE "{name}" AS SELECT * FROM _arrow')
            con.unregister("_arrow")
        for view in request["views"]:
            con.execute(view)
        confine(con, request["prefix"], request["memory"])
        check_query(con, request["sql"])
    except QueryRefused as exc:
        return fail("refused", str(exc))
    except duckdb.Error as exc:
        return fail(type(exc).__name__, str(exc).strip().splitlines()[0])
    timer = threading.Timer(request["timeout"], con.interrupt)
    timer.daemon = True
    timer.start()
    try:
        table = con.sql(request["sql"]).to_arrow_table()
    except duckdb.InterruptException:
        return fail("timeout", "")
    except (duckdb.OutOfMemoryException, MemoryError):
        return fail("memory", "")
    except duckdb.Error as exc:
        message = str(exc).strip()
        if "bad_alloc" in message or "Allocation failure" in message:
            return fail("memory", "")
        return fail(type(exc).__name__, message.splitlines()[0] if message else type(exc).__name__)
    finally:
        timer.cancel()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    _answer(b"T", sink.getvalue().to_pybytes())


def main(argv: list[str]) -> None:
    """The child: limits first (before DuckDB is imported), then the request from stdin."""
    cap, cpu = int(argv[0]), int(argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    request = pickle.loads(sys.stdin.buffer.read())  # from the parent, which built it
    sys.stdout = sys.stderr  # stdout carries the answer alone
    try:
        _serve(request)
    except MemoryError:
        _answer(b"E", b'["memory", ""]')


if __name__ == "__main__":
    main(sys.argv[1:])
