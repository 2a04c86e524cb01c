"""Atomic writes: the one place files and folders are put into place.

Every file is written to a fresh private temporary file beside its target
(``.<name>.<random>.tmp``, made by ``mkstemp``: created with ``O_EXCL``, so a name planted in
advance, a symbolic link included, is never opened or followed; pyarrow's dataset discovery skips
``.``-files and ``*.parquet`` globs never match it), written through the descriptor ``mkstemp``
returned, flushed, then renamed over the target, so a reader sees the old file or the new one,
never half of one. A folder is built in a fresh private folder (``mkdtemp``) and swapped in the
same way; the folder it replaces is first renamed aside (never deleted in place), and a link at
the target is refused. Whether an existing target may be replaced at all is the caller's rule
(:func:`check_target` for files; ``--force`` rules such as :func:`check_replaceable` for
folders); :func:`check_outside` keeps outputs out of a traces root.

On an object store (:mod:`catalog.location`) a file is one PUT of the whole object, which S3
makes visible atomically (old object or new, never half); no temporary name is needed. A folder
there cannot be swapped: :func:`folder` builds it locally, deletes the old objects and uploads
the new ones, the files whose names start with ``_`` (stamps, manifests: the commit points) last.
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1)
def _file_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file (0666 less the umask), read
    without changing the umask; ``mkstemp`` makes its file 0600."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = 0o022
    return 0o666 & ~umask


@contextmanager
def _replacing(path: Path):
    """Yield a binary file object open on a fresh private temporary file beside ``path``
    (``mkstemp``: never an existing name, never a link); rename it over ``path`` if the block
    succeeds and delete it on every failure path."""
    check_target(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), _file_mode())
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
    with _replacing(Path(path)) as f:
        f.write(data)
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
    with _replacing(path) as f:
        pq.write_table(table, f, **options)
    return path.stat().st_size


def write_via(path, write) -> None:
    """Let ``write(local_path)`` produce the file at ``path`` (a library that writes files
    itself): it writes into a fresh private folder (:func:`staged`), whose file is then renamed
    into place; on an object store that file is uploaded as one PUT."""
    if not location.is_remote(path):
        check_target(Path(path))
        with staged(Path(path)) as local:
            write(local)
        return
    with tempfile.TemporaryDirectory(prefix=".upload.") as tmp:
        local = Path(tmp) / path.name
        write(local)
        write_bytes(path, local.read_bytes())


@contextmanager
def staged(out: Path):
    """Yield a path (not yet existing) inside a fresh private folder beside ``out`` (``mkdtemp``:
    mode 0700, a name nobody could plant) for a writer that creates a file or a folder by path
    (the engine formats of ``export-routing``, a library's ``save``); when the block succeeds
    it is put in place of ``out`` (:func:`_put`). The private folder is removed either way."""
    out = Path(out)
    if out.is_symlink():
        raise UnsafeTarget(f"{out} is a symbolic link; outputs never follow or replace links, "
                           "give the real path or another name")
    out.parent.mkdir(parents=True, exist_ok=True)
    box = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield box / out.name
        made = box / out.name
        if made.is_dir():
            made.chmod(0o777 & _file_mode() | 0o111)
        _put(made, out)
    finally:
        shutil.rmtree(box, ignore_errors=True)


def _put(made: Path, out: Path) -> None:
    """Rename ``made`` to ``out``: over a regular file (:func:`check_target`), or, for a folder,
    after moving the old folder aside (renamed onto a fresh empty folder, then deleted): the old
    one is never deleted in place, and a link at ``out`` is refused, never followed."""
    if made.is_dir() and out.is_dir() and not out.is_symlink():
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, aside)  # onto an empty folder: atomic on POSIX
        os.rename(made, out)
        shutil.rmtree(aside, ignore_errors=True)
        return
    check_target(out)
    os.replace(made, out)


def check_outside(out, root, option: str) -> None:
    """``option``'s path ``out`` never lands inside (or on) the traces root ``root``: a file there
    could be read as part of a run, or replace one (UnsafeTarget, one line)."""
    if out is None or str(out) == "-" or root is None or location.is_remote(root) or \
            location.is_remote(out):
        return
    inside = os.path.realpath(out)
    top = os.path.realpath(root)
    if inside == top or inside.startswith(top.rstrip(os.sep) + os.sep):
        raise UnsafeTarget(f"{option} {out} is inside the traces folder {root}; write it "
                           "elsewhere (the traces hold what captures and replays commit)")


def holds_traces(folder: Path) -> bool:
    """Whether ``folder`` is a traces root or holds one (a run manifest or replay results below
    it): a folder no output may replace."""
    for pattern in ("runs/model=*/bench=*/run=*/_manifest.json", "**/_manifest.json",
                    "**/_config.json"):
        if next(iter(folder.glob(pattern)), None) is not None:
            return True
    return False


def check_replaceable(folder: Path, marker: str, option: str = "DEST") -> None:
    """``--force`` may replace the folder ``folder`` only if this tool wrote it: empty, or
    holding ``marker`` (a file the tool writes into every folder it makes), and never ``.``,
    ``..``, the working folder or one of its parents, or a folder holding a traces root
    (UnsafeTarget, one line)."""
    folder = Path(folder)
    real = os.path.realpath(folder)
    here = os.path.realpath(os.getcwd())
    if folder.name in ("", ".", "..") or real == here or \
            here.startswith(real.rstrip(os.sep) + os.sep):
        raise UnsafeTarget(f"{option} {folder} is the working folder or one of its parents; "
                           "give a new folder's name")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not (folder / marker).is_file():
        raise UnsafeTarget(f"{option} {folder} is a folder this tool did not write (no "
                           f"{marker} in it); --force replaces only its own output: give a new "
                           "or empty folder")
    if holds_traces(folder):
        raise UnsafeTarget(f"{option} {folder} holds a traces root; give a new folder's name")


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
    with staged(out) as made:
        made.mkdir()
        yield made
