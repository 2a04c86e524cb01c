"""Atomic, resumable writing of one capture run (layout and tables in :mod:`catalog.schema`).

* Every file goes through :mod:`catalog.atomic`, so a reader never sees half a file.
* A prompt's tables are written in :data:`catalog.schema.TRACE_TABLES` order with ``sequences``
  last: the prompt is complete exactly when its ``sequences`` part exists. On resume, any other
  parts of an incomplete prompt are deleted and the prompt is captured again.
* ``_manifest.json`` says ``"status": "running"`` until every prompt is done, then
  ``"complete"`` (and a one-row ``runs`` part is written), so a run is never mistaken for
  complete. Rerunning with different settings is refused; a run started from scratch gets a new
  ``run_id``, so results computed from an older capture of the same name are never reused.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
from filelock import FileLock, Timeout

from capture.settings import CaptureError  # noqa: F401 - re-exported
from catalog import atomic, schema
from catalog.runs import CatalogError, read_manifest, run_dir, write_manifest


class RunWriter:
    def __init__(self, root: str | Path, model: str, bench: str, run: str):
        self.root = Path(root)
        self.model, self.bench, self.run = model, bench, run

    def table_dir(self, table: str) -> Path:
        return run_dir(self.root, table, self.model, self.bench, self.run)

    @property
    def manifest_path(self) -> Path:
        return self.table_dir("runs") / schema.MANIFEST

    def read_manifest(self) -> dict | None:
        if not self.manifest_path.is_file():
            return None
        try:
            return read_manifest(self.manifest_path)
        except CatalogError as exc:
            raise CaptureError(f"{exc}; or pick another --run") from exc

    def lock(self) -> None:
        """Hold the run's lock until :meth:`close`: one capture writes a run at a time (a second
        one would delete the first one's in-flight files when it cleans up)."""
        folder = self.table_dir("runs")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CaptureError(f"cannot create {self.root}: {exc.strerror}; choose a writable "
                               "--out") from exc
        self._lock = FileLock(str(folder / ".lock"))
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise CaptureError(f"run {self.run!r} is being written by another capture right now "
                               f"({folder / '.lock'} is held); wait for it to finish or pass "
                               "another --run") from None

    def close(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None and lock.is_locked:
            lock.release()

    def start(self, manifest: dict) -> tuple[dict, set[int]]:
        """Lock, then create or resume the run; returns (the manifest as stored, prompt indices
        already complete)."""
        self.lock()
        old = self.read_manifest()
        manifest = as_stored(manifest)  # compare as stored (tuples become lists)
        if old is not None:
            for key in ("settings", "role"):
                if old[key] != manifest[key]:
                    raise CaptureError(f"run {self.run!r} exists with different {key} "
                                       f"({_changed(old[key], manifest[key])}); pass another "
                                       f"--run or the same {key}")
        try:
            for table in (*schema.TRACE_TABLES, "runs"):
                self.table_dir(table).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CaptureError(f"cannot create {self.root}: {exc.strerror}; choose a writable "
                               "--out") from exc
        done = self.completed()
        if old is not None and old.get("status") == "complete" \
                and old.get("prompt_ids") == manifest.get("prompt_ids") \
                and len(done) >= len(manifest.get("prompt_ids") or [None]):
            return old, done  # nothing to capture: the run stays as it was, untouched
        self._clean_incomplete(done)
        run_id = old["run_id"] if old and old.get("run_id") else uuid.uuid4().hex
        manifest = {**manifest, "run_id": run_id, "status": "running",
                    "prompts_done": len(done)}
        self.write_manifest(manifest)
        return manifest, done

    def write_manifest(self, manifest: dict) -> None:
        write_manifest(self.root, manifest)

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
        return atomic.write_table(self.table_dir(table) / name, rows)

    def finish(self, manifest: dict, runs_row: dict) -> None:
        atomic.write_table(self.table_dir("runs") / "part-0.parquet",
                           pa.Table.from_pylist([runs_row], schema=schema.RUNS_SCHEMA))
        self.write_manifest({**manifest, "status": "complete"})

    def bytes_written(self) -> int:
        return sum(p.stat().st_size for t in (*schema.TRACE_TABLES, "runs")
                   for p in self.table_dir(t).glob("*") if p.is_file())


def as_stored(obj):
    """``obj`` as it reads back from JSON."""
    import json
    return json.loads(json.dumps(obj))


def _changed(old, new) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        return ", ".join(sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)))
    return f"{old} vs {new}"
