"""How a run's tables are written: part names, the manifest as the commit point, atomic writes.

Capture, the synthetic runs of the benchmarks and the tests all write traces through
:class:`RunWriter`, so a run on disk is laid out one way (:mod:`catalog.schema`):

* Every file goes through :mod:`catalog.atomic`, so a reader never sees half a file.
* A prompt's rows go to ``part-<prompt>-<chunk>.parquet`` (:func:`catalog.runs.part_name`) in
  :data:`catalog.schema.TRACE_TABLES` order with ``sequences`` last: the prompt is complete
  exactly when its ``sequences`` part exists. On resume, any other parts of an incomplete prompt
  are deleted and the prompt is written again.
* ``_manifest.json`` says ``"status": "running"`` until every prompt is done, then
  ``"complete"`` (after the one-row ``runs`` part), so a run is never mistaken for complete.
  Rerunning with a different role or settings is refused; a run started from scratch gets a new
  ``run_id``, so results computed from an older capture of the same name are never reused.
* One writer at a time: a file lock beside a local run, a lease object on an object store
  (:func:`catalog.location.lock`: conditional put, renewed while held).

Refusals are :class:`catalog.runs.CatalogError`, one line for the user.
"""

from __future__ import annotations

import json
import uuid
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pyarrow as pa
from filelock import Timeout

from moe_spec.catalog import atomic, commit, location, schema
from moe_spec.catalog.runs import (
    PART_GLOB,
    WHOLE_PART,
    CatalogError,
    batch_part,
    batch_profile_dir,
    commit_digest,
    part_name,
    profile_dir,
    prompt_of_part,
    read_manifest,
    run_dir,
    write_manifest,
)


def list_column(matrix: np.ndarray, dtype: pa.DataType) -> pa.ListArray:
    """Rows of a 2-D array as a :func:`catalog.schema.vector` column (zero-copy offsets, one
    flat values buffer)."""
    rows, width = matrix.shape
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1), type=dtype),
                                    type=schema.vector(dtype))


class RunWriter:
    """The tables of one run (``model``/``bench``/``run``) under the traces root ``root``.

    ``kind``: a capture (per-prompt parts, resumed prompt by prompt) or a routing-only run
    (``import-routing``: the ``routing_ids`` and ``sequences`` tables in parts of bounded size,
    started afresh on every write and committed whole by :meth:`finish`, or removed by
    :meth:`abandon`: an import is never half committed)."""

    def __init__(self, root: str | Path, model: str, bench: str, run: str,
                 kind: str = schema.CAPTURE):
        self.root = location.root(root)
        self.model, self.bench, self.run = model, bench, run
        self.kind = kind
        self.tables = schema.run_tables(kind)

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
            raise CatalogError(f"{exc}; or pick another --run") from exc

    def lock(self) -> None:
        """Hold the run's lock until :meth:`close`: one writer writes a run at a time (a second
        one would delete the first one's in-flight files when it cleans up). On an object
        store the lock is a lease (:class:`catalog.location.Lease`)."""
        folder = self.table_dir("runs")
        try:
            location.mkdir(folder)
        except OSError as exc:
            raise CatalogError(f"cannot create {self.root}: {exc.strerror}; choose a writable "
                               "--out") from exc
        self._lock = location.lock(folder / ".lock")
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            held = self._lock.describe() if location.is_remote(folder) else \
                f"{folder / '.lock'} is held"
            raise CatalogError(f"run {self.run!r} is being written by another capture right now "
                               f"({held}); wait for it to finish or pass another --run") from None
        except OSError as exc:  # an object store refusing the lease (permissions, network)
            raise CatalogError(f"cannot take the lease {folder / '.lock'}: {exc}; check the "
                               "credentials or choose a writable --out") from None

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
                    raise CatalogError(f"run {self.run!r} exists with different {key} "
                                       f"({_changed(old[key], manifest[key])}); pass another "
                                       f"--run or the same {key}")
        try:
            for table in (*self.tables, "runs"):
                location.mkdir(self.table_dir(table))
        except OSError as exc:
            raise CatalogError(f"cannot create {self.root}: {exc.strerror}; choose a writable "
                               "--out") from exc
        if self.kind == schema.ROUTING_ONLY:  # never resumed: every part written afresh
            self._clean_incomplete(set())
            manifest = {**manifest, "run_id": uuid.uuid4().hex, "status": "running",
                        "prompts_done": 0}
            self.write_manifest(manifest)
            return manifest, set()
        done = self.completed()
        if old is not None and old.get("status") == "complete" \
                and old.get("prompt_ids") == manifest.get("prompt_ids") \
                and len(done) >= len(manifest.get("prompt_ids") or [None]):
            return old, done  # nothing to write: the run stays as it was, untouched
        self._clean_incomplete(done)
        run_id = old["run_id"] if old and old.get("run_id") else uuid.uuid4().hex
        manifest = {**manifest, "run_id": run_id, "status": "running",
                    "prompts_done": len(done)}
        self.write_manifest(manifest)
        return manifest, done

    def write_manifest(self, manifest: dict) -> None:
        write_manifest(self.root, manifest)

    def record_progress(self, manifest: dict) -> None:
        """The manifest of a running run, its ``prompts_done`` counted from the ``sequences``
        parts on disk (whoever wrote them: this process or a worker)."""
        self.write_manifest({**manifest, "prompts_done": len(self.completed())})

    def completed(self) -> set[int]:
        """Prompts written completely: those with a part in the completion table."""
        return {prompt_of_part(p) for p in self.table_dir(schema.COMPLETION_TABLE).glob(PART_GLOB)}

    def _clean_incomplete(self, done: set[int]) -> None:
        """Under the run's lock: the parts of prompts not complete, and every temporary file a
        killed writer left (``catalog.atomic``'s ``.<name>.<random>.tmp``), in the tables'
        folders and beside the manifest (a kill between a manifest's temporary file and its
        rename leaves one there)."""
        for table in (*self.tables, "runs"):
            for p in location.iterdir(self.table_dir(table)):
                stale = p.name.endswith(".tmp") or (
                    table != "runs" and fnmatch(p.name, PART_GLOB)
                    and prompt_of_part(p) not in done)
                if stale:
                    p.unlink()

    def write_part(self, table: str, prompt_index: int, chunk: int, rows: pa.Table) -> int:
        """One chunk of one prompt's rows of ``table``; returns the bytes written."""
        return atomic.write_table(self.table_dir(table) / part_name(prompt_index, chunk), rows)

    def finish(self, manifest: dict) -> None:
        """Commit the run: its one-row ``runs`` part, then the manifest says complete and lists
        every file of the run (:mod:`catalog.commit`: rows, bytes, content hash), so readers
        read exactly these files."""
        atomic.write_table(self.table_dir("runs") / WHOLE_PART,
                           pa.Table.from_pylist([runs_row(manifest)], schema=schema.RUNS_SCHEMA))
        done = self.completed()
        whole = self.kind == schema.ROUTING_ONLY  # every part it wrote (named by first request)
        files = {}
        for table in self.tables:
            files[table] = commit.table_record(
                [p for p in location.iterdir(self.table_dir(table))
                 if commit.prompt_of(p.name) in done
                 or (whole and commit.prompt_of(p.name) is not None)])
        files["runs"] = commit.table_record([self.table_dir("runs") / WHOLE_PART])
        committed = {**manifest, "status": "complete", "files": files,
                     "schema_version": max(manifest.get("schema_version", 0),
                                           schema.SCHEMA_VERSION)}
        committed["commit_digest"] = commit_digest(committed)
        self.write_manifest(committed)

    def bytes_written(self) -> int:
        return sum(size for t in (*self.tables, "runs")
                   for name, size, _ in location.listing(self.table_dir(t)) if "/" not in name)

    def abandon(self) -> None:
        """Remove every folder of this run (its parts and its manifest): what a failed import
        leaves, so nothing of it is ever read or mistaken for a run. Only for runs this writer
        started (an import refuses to write over a committed run before it starts)."""
        for table in (*self.tables, "runs"):
            location.remove_tree(self.table_dir(table), ignore_errors=True)


def runs_row(manifest: dict) -> dict:
    """The one row of the ``runs`` table, from the manifest (fields a synthetic run does not
    describe are null)."""
    return dict(role=manifest["role"], run_id=manifest["run_id"],
                model_location=manifest.get("model_location"), draft=manifest.get("draft"),
                num_experts=manifest.get("num_experts"), top_k=manifest.get("top_k"),
                renormalize=manifest.get("renormalize"),
                routing_rule=json.dumps(manifest["routing_rule"], sort_keys=True)
                if manifest.get("routing_rule") else None, num_layers=manifest.get("num_layers"),
                moe_layers=manifest.get("moe_layers"), hidden_size=manifest.get("hidden_size"),
                dtype=manifest.get("dtype"), device=manifest.get("device"),
                prompts=manifest.get("prompts_total", len(manifest.get("prompt_ids", []))),
                settings=json.dumps(manifest["settings"], sort_keys=True),
                versions=json.dumps(manifest.get("versions", {}), sort_keys=True),
                schema_version=schema.SCHEMA_VERSION, status="complete")


def write_profile(root: Path, model: str, device: str, points: pa.Table) -> Path:
    """Store ``profile-target``'s points (:data:`catalog.schema.PROFILE` columns; a column under
    its older name is stored under the current one) for ``model`` on ``device``, replacing the
    profile there; returns its folder."""
    folder = profile_dir(root, model, device)
    location.mkdir(folder)
    old = schema.renamed(schema.PROFILE_TABLE, points.column_names)
    points = points.rename_columns([old.get(c, c) for c in points.column_names])
    atomic.write_table(folder / WHOLE_PART, points.select(schema.PROFILE.names)
                       .cast(schema.PROFILE))
    return folder


def write_batch_profile(root: Path, model: str, bench: str, run: str, measurement: str,
                        tables: dict[str, pa.Table]) -> list[Path]:
    """Store one ``profile-batch`` measurement's tables beside the run's earlier measurements:
    ``part-<measurement>.parquet`` in the run's folder, rewritten atomically as the measurement
    grows (a reader sees the old rows or the new, never half); earlier measurements' files are
    never touched. Returns the files."""
    written = []
    for table, data in tables.items():
        path = batch_profile_dir(root, table, model, bench, run) / batch_part(measurement)
        location.mkdir(path.parent)
        declared = schema.BATCH_PROFILE_TABLES[table]
        atomic.write_table(path, data.select(declared.names).cast(declared))
        written.append(path)
    return written


def as_stored(obj):
    """``obj`` as it reads back from JSON."""
    return json.loads(json.dumps(obj))


def _changed(old, new) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        return ", ".join(sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)))
    return f"{old} vs {new}"
