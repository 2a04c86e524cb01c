"""Committed file sets: what a run or a replay block *is*, file by file.

A capture commits a run by writing, in its manifest, the list of its files (what lakehouse
formats keep in their commit logs); replay commits a result block the same way in its unit's
``_config.json``. Per table::

    "files": {"routing": {"columns": ["prompt_index", …],
                          "parts": [["part-000000-0000.parquet", rows, bytes, "sha256…"], …]}, …}

Readers read exactly the listed files (:func:`verify` them first): a stray, duplicated,
uncommitted or symlinked file in a folder never changes an answer, and a listed file that is
missing, resized, retyped, short of rows or columns, or whose content hash differs is named in
one line. Hashing is done once per file version: a verified (path, size, mtime, ctime, inode) —
(key, size, ETag) on an object store — is remembered in a small SQLite cache
(``$XDG_CACHE_HOME/moe-spec-workbench/verified.sqlite``), so a warm read costs a ``stat``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sqlite3
import threading
from pathlib import Path

from moe_spec.catalog import location
from moe_spec.errors import UserError

CACHE_ENV = "MOESPEC_VERIFY_CACHE"  # path of the cache file; "off" disables caching


class CommitError(UserError, RuntimeError):
    """A committed file that does not match its record; the message is one line."""


def sha256_of(path) -> str:
    """The content hash of a local or remote file."""
    if location.is_remote(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record(path) -> list:
    """``[name, rows, bytes, sha256]`` of a Parquet file as it is now (its footer's row count)."""
    with location.parquet_file(path) as f:
        rows = f.metadata.num_rows
        columns = f.schema_arrow.names
    size = path.stat().st_size
    return [path.name, int(rows), int(size), sha256_of(path)], columns


def table_record(paths: list) -> dict:
    """The commit record of one table's files: their columns (the first file's) and parts."""
    parts, columns = [], None
    for path in sorted(paths, key=lambda p: p.name):
        entry, cols = record(path)
        parts.append(entry)
        columns = columns or cols
    return dict(columns=columns or [], parts=parts)


# --- the verification cache ----------------------------------------------------------------
_local = threading.local()


def _cache() -> sqlite3.Connection | None:
    path = os.environ.get(CACHE_ENV)
    if path == "off":
        return None
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = str(Path(base) / "moe-spec-workbench" / "verified.sqlite")
    held = getattr(_local, "con", None)
    if held is not None and held[0] == path:
        return held[1]
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(path, timeout=5, isolation_level=None)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("CREATE TABLE IF NOT EXISTS verified (key TEXT PRIMARY KEY, sha256 TEXT)")
    except (OSError, sqlite3.Error):
        return None  # no cache: every read hashes (slower, still exact)
    _local.con = (path, con)
    return con


def _version_key(path, size: int) -> str | None:
    """What identifies this version of the file's bytes without reading them."""
    if location.is_remote(path):
        try:
            info = path.fs.info(location.fs_path(path))
        except OSError:
            return None
        etag = info.get("ETag") or info.get("etag")
        return f"{path}|{size}|{etag}" if etag else None
    return f"{os.path.abspath(path)}|{location.file_version(os.stat(path))}"


def _cached(key: str | None) -> str | None:
    con = _cache() if key else None
    if con is None:
        return None
    try:
        row = con.execute("SELECT sha256 FROM verified WHERE key = ?", (key,)).fetchone()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def _remember(key: str | None, sha: str) -> None:
    con = _cache() if key else None
    if con is None:
        return
    try:
        con.execute("INSERT OR REPLACE INTO verified VALUES (?, ?)", (key, sha))
    except sqlite3.Error:
        pass


# --- verification ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _folder_inside(folder: str, root: str) -> bool:
    """Whether ``folder`` is reached from ``root`` without symbolic links (cached: every part
    of a table shares its folder)."""
    rel = os.path.relpath(os.path.abspath(folder), os.path.abspath(root))
    if rel.startswith(".."):
        return False
    return os.path.realpath(folder) == os.path.normpath(os.path.join(os.path.realpath(root),
                                                                      rel))


def inside(path, root) -> bool:
    """Whether a local ``path`` is a regular file reached without symbolic links under ``root``
    (a resolved root: links above the traces folder itself are the user's business)."""
    if location.is_remote(path):
        return True
    return not os.path.islink(path) and _folder_inside(os.path.dirname(os.fspath(path)),
                                                       os.fspath(root))


def present(path, entry: list, root, fix: str) -> None:
    """The cheap half of :func:`verify` (no read): a regular file inside ``root``, reached
    without links, of the recorded size."""
    where = location.display(path)
    if not location.is_remote(path):
        if os.path.islink(path) or not inside(path, root):
            raise CommitError(f"{where} is reached through a symbolic link; committed files are "
                              f"read only as regular files inside the traces folder: {fix}")
        if not os.path.isfile(path):
            raise CommitError(f"{where} is missing (listed in its commit record): {fix}")
    try:
        size = path.stat().st_size
    except (FileNotFoundError, OSError):
        raise CommitError(f"{where} is missing (listed in its commit record): {fix}") from None
    if size != entry[2]:
        raise CommitError(f"{where} has {size} bytes, its commit record says {entry[2]}: {fix}")


def verify(path, entry: list, columns: list[str] | None, root, fix: str, check=None) -> None:
    """Check one committed file against its record ``[name, rows, bytes, sha256]``; raise
    :class:`CommitError` naming it (``fix``: what the user should do) if it differs.
    ``check(path)``: a further check of a file read for the first time (its column types),
    remembered with the hash."""
    where = location.display(path)
    present(path, entry, root, fix)
    _, rows, size, sha = entry
    key = _version_key(path, size)
    if _cached(key) == sha:
        return
    found = sha256_of(path)
    if found != sha:
        raise CommitError(f"{where} fails its content hash (damaged or replaced since it was "
                          f"committed): {fix}")
    try:
        with location.parquet_file(path) as f:
            got_rows, got_cols = f.metadata.num_rows, f.schema_arrow.names
    except Exception as exc:  # noqa: BLE001 - the hash matched, so this is the committed file
        raise CommitError(f"{where} is not readable Parquet ({type(exc).__name__}): {fix}") \
            from None
    if got_rows != rows:
        raise CommitError(f"{where} holds {got_rows} rows, its commit record says {rows}: {fix}")
    missing = [c for c in (columns or []) if c not in got_cols]
    if missing:
        raise CommitError(f"{where} lacks column(s) {', '.join(missing)}: {fix}")
    if check is not None:
        check(path)
    _remember(key, sha)


PART_NAME = re.compile(r"^part-(\d{6})(?:-(\d{4}))?\.parquet$")


def prompt_of(name: str) -> int | None:
    """The prompt index in a part name capture or replay writes, or None for any other name."""
    m = PART_NAME.match(name)
    return int(m.group(1)) if m else None
