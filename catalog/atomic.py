"""Atomic writes: the one place files and folders are put into place.

Every file is written to a hidden temporary name beside its target (``.<name>.tmp``: pyarrow's
dataset discovery skips ``.``-files and ``*.parquet`` globs never match it), flushed, then
renamed over the target, so a reader sees the old file or the new one, never half of one. A
folder is built in a hidden temporary folder and swapped in the same way.

On an object store (:mod:`catalog.location`) a file is one PUT of the whole object, which S3
makes visible atomically (old object or new, never half); no temporary name is needed. A folder
there cannot be swapped: :func:`folder` builds it locally, deletes the old objects and uploads
the new ones, the files whose names start with ``_`` (stamps, manifests: the commit points) last.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from moe_spec.catalog import location
from moe_spec.catalog.schema import FAST_DECODE_COLUMNS
from moe_spec.errors import UserError


def temporary_name(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp")


class UnsafeTarget(UserError, OSError):
    """An output path that is not a regular file (a device, FIFO, folder or symlink): never
    replaced. ``str()`` is one line for the user (callers print ``exc.strerror or exc``)."""


def check_target(path: Path) -> Path:
    """Refuse to replace anything but a regular file (or nothing): ``os.replace`` onto a device,
    FIFO or folder would swap it for a file, and a symlink may point out of the intended folder.
    """
    if location.is_remote(path):
        return path  # objects: no links, devices or FIFOs to refuse
    path = Path(path)
    if path.is_symlink():
        raise UnsafeTarget(f"{path} is a symbolic link; outputs never follow or replace links, "
                           "give the real file's path or another name")
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise UnsafeTarget(f"{path} is {kind}; give a file path (or - for stdout where offered)")
    return path


@contextmanager
def _replacing(path: Path):
    """Yield the temporary name for ``path``; rename it over ``path`` if the block succeeds and
    delete it on every failure path."""
    check_target(path)
    tmp = temporary_name(path)
    if tmp.is_symlink() or tmp.exists():  # a leftover (or planted link): never written through
        tmp.unlink()
    try:
        yield tmp
        check_target(path)  # nothing swapped in a link or device meanwhile
        os.replace(tmp, path)
    finally:
        if tmp.exists() or tmp.is_symlink():
            try:
                tmp.unlink()
            except OSError:
                pass


def write_bytes(path: Path, data: bytes) -> int:
    if location.is_remote(path):
        path.write_bytes(data)  # one PUT: atomic
        return len(data)
    with _replacing(Path(path)) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return len(data)


def write_json(path: Path, obj) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_table(path: Path, table: pa.Table) -> int:
    """One Parquet file, zstd (lz4 for :data:`catalog.schema.FAST_DECODE_COLUMNS`), page
    checksums. Dictionary encoding for string columns and statistics for scalar columns only:
    dictionary-encoding float vectors costs time and space, and their min/max help no query.
    Float vectors are byte-stream-split (Parquet's encoding for floats: ~15% smaller and faster
    to decode). Returns the bytes written."""
    def leaf(f: pa.Field) -> str:  # the Parquet column path of a field
        return f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name

    scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
    strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
    floats = [leaf(f) for f in table.schema if pa.types.is_list(f.type)
              and f.type.value_type in (pa.float32(), pa.float64())]
    codecs = {leaf(f): "lz4" if f.name in FAST_DECODE_COLUMNS else "zstd" for f in table.schema}
    options = dict(compression=codecs, use_dictionary=strings, write_statistics=scalar,
                   write_page_checksum=True, use_byte_stream_split=floats or False)
    if location.is_remote(path):  # serialised here, then one PUT
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, **options)
        return write_bytes(path, buffer.getvalue().to_pybytes())
    path = Path(path)
    with _replacing(path) as tmp:
        pq.write_table(table, tmp, **options)
    return path.stat().st_size


def write_via(path, write) -> None:
    """Let ``write(local_path)`` produce the file at ``path`` (a library that writes files
    itself); on an object store it writes a local temporary file, uploaded as one PUT."""
    if not location.is_remote(path):
        write(path)
        return
    with tempfile.TemporaryDirectory(prefix=".upload.") as tmp:
        local = Path(tmp) / path.name
        write(local)
        write_bytes(path, local.read_bytes())


@contextmanager
def folder(out: Path):
    """Yield a temporary folder beside ``out``; swap it in for ``out`` only if the block
    succeeds, so a crash or kill never leaves a half-written folder where a complete one was.
    On an object store the folder is built locally and uploaded once complete (old objects
    deleted first, names starting with ``_`` uploaded last)."""
    if location.is_remote(out):
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.") as tmp:
            yield Path(tmp)
            location.remove_tree(out, ignore_errors=True)
            files = sorted((p for p in Path(tmp).rglob("*") if p.is_file()),
                           key=lambda p: (p.name.startswith("_"), str(p)))
            for f in files:
                write_bytes(out / f.relative_to(tmp).as_posix(), f.read_bytes())
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
