"""Atomic writes: the one place files and folders are put into place.

Every file is written to a hidden temporary name beside its target (``.<name>.tmp``: pyarrow's
dataset discovery skips ``.``-files and ``*.parquet`` globs never match it), flushed, then
renamed over the target, so a reader sees the old file or the new one, never half of one. A
folder is built in a hidden temporary folder and swapped in the same way.
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

from errors import UserError


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
    with _replacing(Path(path)) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return len(data)


def write_json(path: Path, obj) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_table(path: Path, table: pa.Table) -> int:
    """One Parquet file, zstd, page checksums. Dictionary encoding for string columns and
    statistics for scalar columns only: dictionary-encoding float vectors costs time and space,
    and their min/max help no query. Float vectors are byte-stream-split (Parquet's encoding for
    floats: ~15% smaller and faster to decode). Returns the bytes written."""
    path = Path(path)
    scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
    strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
    floats = [f"{f.name}.list.element" for f in table.schema if pa.types.is_list(f.type)
              and f.type.value_type in (pa.float32(), pa.float64())]
    with _replacing(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", use_dictionary=strings,
                       write_statistics=scalar, write_page_checksum=True,
                       use_byte_stream_split=floats or False)
    return path.stat().st_size


@contextmanager
def folder(out: Path):
    """Yield a temporary folder beside ``out``; swap it in for ``out`` only if the block
    succeeds, so a crash or kill never leaves a half-written folder where a complete one was."""
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
