"""Atomic, resumable writing of one capture run (layout and tables in :mod:`capture.schema`).

* Every file is written as ``.<name>.tmp`` and renamed, so a reader never sees half a file.
* A prompt's tables are written in :data:`schema.TRACE_TABLES` order with ``sequences`` last:
  the prompt is complete exactly when its ``sequences`` part exists. On resume, any other parts
  of an incomplete prompt are deleted and the prompt is captured again.
* ``_manifest.json`` says ``"status": "running"`` until every prompt is done, then
  ``"complete"`` (and a one-row ``runs`` part is written), so a run is never mistaken for
  complete. Rerunning with different settings is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from capture import schema


class CaptureError(RuntimeError):
    """A run that cannot be written or resumed; the message is one line for the user."""


def _tmp(path: Path) -> Path:
    """Hidden while being written: pyarrow skips '.'-files and '*.parquet' globs miss '.tmp'."""
    return path.with_name(f".{path.name}.tmp")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = _tmp(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_table(path: Path, table: pa.Table) -> int:
    """zstd, dictionary encoding and statistics for scalar columns only: dictionary-encoding
    float vectors costs time and space, and their min/max help no query."""
    tmp = _tmp(path)
    scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
    strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
    pq.write_table(table, tmp, compression="zstd", use_dictionary=strings,
                   write_statistics=scalar)
    os.replace(tmp, path)
    return path.stat().st_size


class RunWriter:
    def __init__(self, root: str | os.PathLike, model: str, bench: str, run: str):
        self.root = Path(root)
        self.parts = {"model": schema.partition_value(model), "bench": bench, "run": run}

    def table_dir(self, table: str) -> Path:
        p = self.parts
        return self.root / table / f"model={p['model']}" / f"bench={p['bench']}" / f"run={p['run']}"

    @property
    def manifest_path(self) -> Path:
        return self.table_dir("runs") / schema.MANIFEST

    def read_manifest(self) -> dict | None:
        if not self.manifest_path.is_file():
            return None
        try:
            return json.loads(self.manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise CaptureError(f"corrupt manifest {self.manifest_path}; delete the run folder "
                               "or pick another --run") from exc

    def start(self, manifest: dict) -> set[int]:
        """Create or resume the run; returns the prompt indices already complete."""
        old = self.read_manifest()
        manifest = json.loads(json.dumps(manifest))  # compare as stored (tuples become lists)
        if old is not None and old["settings"] != manifest["settings"]:
            changed = sorted(k for k in set(old["settings"]) | set(manifest["settings"])
                             if old["settings"].get(k) != manifest["settings"].get(k))
            raise CaptureError(f"run {self.parts['run']!r} exists with different settings "
                               f"({', '.join(changed)}); pass another --run or the same settings")
        try:
            for table in (*schema.TRACE_TABLES, "runs"):
                self.table_dir(table).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CaptureError(f"cannot create {self.root}: {exc.strerror}; choose a writable "
                               "--out") from exc
        done = self.completed()
        self._clean_incomplete(done)
        manifest = {**manifest, "status": "running", "prompts_done": len(done)}
        self.write_manifest(manifest)
        return done

    def write_manifest(self, manifest: dict) -> None:
        _atomic_write_bytes(self.manifest_path, (json.dumps(manifest, indent=2) + "\n").encode())

    def completed(self) -> set[int]:
        folder = self.table_dir(schema.COMPLETION_TABLE)
        return {int(p.name.split("-")[1]) for p in folder.glob("part-*.parquet")}

    def _clean_incomplete(self, done: set[int]) -> None:
        for table in schema.TRACE_TABLES:
            for p in self.table_dir(table).iterdir():
                stale = p.name.endswith(".tmp") or (
                    p.name.startswith("part-") and int(p.name.split("-")[1]) not in done)
                if stale:
                    p.unlink()

    def write_part(self, table: str, prompt_index: int, chunk: int, rows: pa.Table) -> int:
        name = f"part-{prompt_index:06d}-{chunk:04d}.parquet"
        return _atomic_write_table(self.table_dir(table) / name, rows)

    def finish(self, manifest: dict, runs_row: dict) -> None:
        _atomic_write_table(self.table_dir("runs") / "part-0.parquet",
                            pa.Table.from_pylist([runs_row], schema=schema.RUNS_SCHEMA))
        self.write_manifest({**manifest, "status": "complete"})

    def bytes_written(self) -> int:
        return sum(p.stat().st_size for t in (*schema.TRACE_TABLES, "runs")
                   for p in self.table_dir(t).glob("*") if p.is_file())
