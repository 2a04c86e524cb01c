"""Where replay results live, so that a finished sweep answers any subset and nothing is stored
twice.

A *unit* is what makes results comparable: mode, ranking, coverage, the calibration runs
(name and run id) and the layout of the result table (:func:`layout_key`). Its results sit in
one folder per captured run::

    <root>/<table>/model=…/bench=…/run=…/config=<unit hash>/_config.json
    <root>/<table>/model=…/bench=…/run=…/config=<unit hash>/block=<id>/part-<prompt>.parquet

``_config.json`` lists the unit, the captured run's ``run_id`` and the *blocks*: each covers a set
of layers × budgets (open loop) or budgets (closed loop) and is ``running`` until every prompt
is written, then ``complete``. A request for some layers × budgets computes only the cells no
complete block holds, as new blocks, so the same cell is never stored twice and ``--budget 24``
after a sweep recomputes nothing. Results of an older capture (another ``run_id``) or of an
interrupted block that is not being resumed are deleted, never reused. A lock per unit folder
(a file lock, or a lease on an object store: :func:`catalog.location.lock`) keeps two replays
from writing the same unit at once.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from filelock import Timeout

from moe_spec.catalog import atomic, commit, location, replay_metrics
from moe_spec.catalog.names import check_name
from moe_spec.catalog.runs import CatalogError, Run, legacy, read_json_file, run_dir
from moe_spec.catalog.schema import COMMITTED_VERSION, RESULT_CONFIG, SCHEMA_VERSION

RESULT_TABLES = tuple(replay_metrics.TABLES)  # every declared replay table (its record there)


def layout_key(table: str, unit: dict) -> dict:
    """``unit`` with the version of the table's metric layout
    (:data:`catalog.replay_metrics.LAYOUT_VERSION`; version 1 is left out, so keys written
    before the layout was versioned stay as they were). Results of another layout have another
    key: recomputed, and left out by readers (:func:`complete_blocks`), never read with NULLs."""
    version = replay_metrics.LAYOUT_VERSION[table]
    unit = {k: v for k, v in unit.items() if k != "layout"}
    return unit if version == 1 else dict(unit, layout=version)


def current_layout(table: str, unit: dict) -> bool:
    """Whether a stored unit's results have the table's current metric layout."""
    return unit.get("layout", 1) == replay_metrics.LAYOUT_VERSION[table]


def readable_layout(table: str, unit: dict) -> bool:
    """Whether readers read a stored unit's results: the current layout, or an older one its
    record still reads (``ReplayTable.reads``: key columns renamed since, which every reader
    renames back, :data:`catalog.schema.RENAMED`). A new replay recomputes such a unit under
    the current layout all the same (its key differs) and then drops it."""
    return current_layout(table, unit) or \
        unit.get("layout", 1) in replay_metrics.TABLES[table].reads


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class Block:
    """Cells computed together: ``layers`` (None in closed loop) × ``budgets``."""

    layers: list[int] | None
    budgets: list[int]
    status: str = "running"
    id: str = field(default="")
    prompts: list[int] | None = None  # the run's complete prompts when the block finished
    files: dict | None = None  # its commit record (catalog.commit): columns and parts
    committed_at: str | None = None  # when it was marked complete (UTC, ISO 8601)

    def __post_init__(self):
        self.layers = None if self.layers is None else sorted(int(x) for x in self.layers)
        self.budgets = sorted(int(b) for b in self.budgets)
        self.id = self.id or digest([self.layers, self.budgets])

    def cells(self) -> set[tuple[int | None, int]]:
        return {(layer, b) for layer in (self.layers or [None]) for b in self.budgets}

    def as_dict(self) -> dict:
        found = dict(id=self.id, layers=self.layers, budgets=self.budgets, status=self.status,
                     prompts=self.prompts)
        if self.files is not None:
            found.update(files=self.files, committed_at=self.committed_at)
        return found


def unit_lock(folder: Path):
    """The lock of the unit in ``folder`` (``…/config=<hash>``), kept beside it."""
    return location.lock(folder.parent / f".{folder.name}.lock")


class UnitResults:
    """The results of one unit for one captured run (one ``config=<hash>`` folder)."""

    def __init__(self, root: Path, table: str, run: Run, unit: dict):
        if table not in RESULT_TABLES:
            raise ValueError(f"unknown result table {table!r}")
        unit = layout_key(table, unit)
        self.run, self.unit, self.table, self.root = run, unit, table, location.root(root)
        self.folder = run_dir(root, table, run.model, run.bench, run.name) / f"config={digest(unit)}"
        self.lock = unit_lock(self.folder)

    # --- state on disk ---------------------------------------------------------------------
    def _read(self) -> dict | None:
        path = self.folder / RESULT_CONFIG
        if not path.is_file():
            return None
        fix = f"delete {self.folder} and replay again"
        state = read_json_file(path, "replay result config", fix)
        try:
            blocks = [Block(**b) for b in state["blocks"]]
            for b in blocks:  # a block id becomes a folder name
                check_name(b.id, "block id")
        except (KeyError, TypeError, ValueError) as exc:
            raise CatalogError(f"corrupt replay result config {path}; {fix}") from exc
        for b in blocks:
            if b.status == "complete" and b.files is None:
                uncommitted(state, b.as_dict(), path, fix)
        return dict(state, blocks=blocks)

    def blocks(self) -> list[Block]:
        state = self._read()
        if state is None or state.get("run_id") != self.run.run_id:
            return []
        return state["blocks"]

    def complete_blocks(self) -> list[Block]:
        current = self.run.prompt_indices()
        return [b for b in self.blocks() if b.status == "complete" and b.prompts == current]

    def _write(self, blocks: list[Block]) -> None:
        location.mkdir(self.folder)
        atomic.write_json(self.folder / RESULT_CONFIG, dict(
            unit=self.unit, run=self.run.name, run_id=self.run.run_id, table=self.table,
            schema_version=SCHEMA_VERSION, blocks=[b.as_dict() for b in blocks]))

    def block_dir(self, block: Block) -> Path:
        return self.folder / f"block={block.id}"

    # --- planning and writing --------------------------------------------------------------
    def plan(self, layers: list[int] | None, budgets: list[int]) -> list[Block]:
        """Blocks still to compute for the cells ``layers × budgets`` (layers None: closed loop).

        Call with :attr:`lock` held. Drops results of an older capture and interrupted blocks
        that are not resumed; a resumable block keeps its finished prompts."""
        state = self._read()
        if state is not None and state.get("run_id") != self.run.run_id:
            location.remove_tree(self.folder)  # computed from a capture that no longer exists
            state = None
        existing = state["blocks"] if state else []
        current = self.run.prompt_indices()
        for b in existing:  # the run's prompts changed since (parts deleted or restored)
            if b.status == "complete" and b.prompts != current:
                b.status = "stale"
        done: set[tuple[int | None, int]] = set()
        for b in existing:
            if b.status == "complete":
                done |= b.cells()
        by_missing: dict[tuple[int, ...], list[int | None]] = {}
        for layer in (layers if layers is not None else [None]):
            missing = tuple(b for b in sorted(set(budgets)) if (layer, b) not in done)
            if missing:
                by_missing.setdefault(missing, []).append(layer)
        todo = [Block(None if layers is None else ls, list(bs)) for bs, ls in by_missing.items()]
        keep = [b for b in existing if b.status == "complete"]
        resumed = {b.id for b in todo}
        for b in existing:
            if b.status != "complete" and b.id not in resumed:
                location.remove_tree(self.block_dir(b), ignore_errors=True)
        self._write(keep + todo)
        return todo

    def restart(self, block: Block) -> None:
        """Drop what an interrupted ``block`` wrote, so it is computed again from its first
        prompt rather than resumed (call with :attr:`lock` held): for results where a prompt's
        rows depend on the prompts before it."""
        location.remove_tree(self.block_dir(block), ignore_errors=True)

    def done_prompts(self, block: Block) -> set[int]:
        return {int(p.name.split("-")[1].split(".")[0])
                for p in self.block_dir(block).glob("part-*.parquet")}

    def write_part(self, block: Block, prompt_index: int, table) -> None:
        folder = self.block_dir(block)
        location.mkdir(folder)
        atomic.write_table(folder / f"part-{prompt_index:06d}.parquet", table)

    def finish(self, block: Block) -> None:
        """Mark ``block`` complete over the run's current prompts, listing its files (rows,
        bytes, content hash: :mod:`catalog.commit`) so readers read exactly those."""
        import datetime
        blocks = self.blocks()
        folder = self.block_dir(block)
        parts = [p for p in (location.iterdir(folder) if folder.is_dir() else [])
                 if commit.prompt_of(p.name) is not None and "-" not in p.name[5:]]
        record = commit.table_record(parts)
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for b in blocks:
            if b.id == block.id:
                b.status = "complete"
                b.prompts = self.run.prompt_indices()
                b.files, b.committed_at = record, now
        self._write(blocks)

    def parts(self, layers: list[int] | None = None, budgets: list[int] | None = None) \
            -> list[Path]:
        """Files of complete blocks that hold any of the given cells (all when None): the
        files each block committed, verified."""
        files = []
        for b in self.complete_blocks():
            if layers is not None and b.layers is not None and not set(layers) & set(b.layers):
                continue
            if budgets is not None and not set(budgets) & set(b.budgets):
                continue
            files += block_files(self.block_dir(b), b.files, self.root)
        return files

    def drop_superseded(self, identity: tuple[str, ...], side_by_side: tuple[str, ...] = ()
                        ) -> list[Path]:
        """Delete this run's result units that agree with this one on the ``identity`` keys but
        differ in another key outside ``side_by_side`` (an older definition of the ranking or of
        its statistics, whichever ``side_by_side`` variant it was): never reused, and readers
        must not see them beside this unit's rows. Units differing only in ``side_by_side`` keys
        (another dtype, seed, ...) are other experiments and stay. A unit another replay holds
        is left alone. Returns the folders deleted."""
        dropped = []
        for path in sorted(self.folder.parent.glob(f"config=*/{RESULT_CONFIG}")):
            if path.parent == self.folder:
                continue
            try:
                other = read_json_file(path, "replay result config", "")["unit"]
            except (CatalogError, KeyError, TypeError):
                continue  # a torn or foreign config: reported when its own unit is read
            if not isinstance(other, dict) or other == self.unit or \
                    any(other.get(k) != self.unit.get(k) for k in identity):
                continue
            versions = (set(other) | set(self.unit)) - set(identity) - set(side_by_side)
            if all(other.get(k) == self.unit.get(k) for k in versions):
                continue  # the same definition, another variant: kept beside this one
            lock = unit_lock(path.parent)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                location.remove_tree(path.parent, ignore_errors=True)
                dropped.append(path.parent)
            finally:
                lock.release()
        return dropped

    @contextmanager
    def locked(self, timeout: float = 0.5):
        """Hold the unit's lock for the block, or fail in one clear line when another replay
        holds it."""
        location.mkdir(self.folder.parent)
        try:
            self.lock.acquire(timeout=timeout)
        except Timeout:
            raise CatalogError(f"another replay is writing {self.folder}; wait for it to finish "
                               "or stop it") from None
        try:
            yield self
        finally:
            self.lock.release()


def block_files(folder: Path, record: dict | None, root: Path) -> list[Path]:
    """The files of a complete block: those its commit record lists, verified (a block
    committed before records existed: its parts as found)."""
    if record is None:
        return sorted(p for p in location.iterdir(folder)
                      if commit.prompt_of(p.name) is not None) if folder.is_dir() else []
    fix = f"delete {folder.parent} and replay again"
    paths = []
    for entry in record.get("parts", []):
        path = folder / entry[0]
        try:
            commit.verify(path, entry, record.get("columns"), root, fix)
        except commit.CommitError as exc:
            raise CatalogError(str(exc)) from None
        paths.append(path)
    return paths


def uncommitted(state: dict, block: dict, path, fix: str) -> None:
    """A complete block without a file list: refused when its config's layout commits file
    lists (``schema_version`` from :data:`schema.COMMITTED_VERSION`, or a ``committed_at``: its
    list was deleted), else an older block read only on ``--allow-legacy``
    (:func:`catalog.runs.legacy`)."""
    version = state.get("schema_version", 0)
    if (isinstance(version, int) and version >= COMMITTED_VERSION) or "committed_at" in block:
        raise CatalogError(f"replay result config {path}: complete block {block.get('id')} of "
                           "a layout that commits its files lists none (edited?); " + fix)
    legacy(f"replay results {path.parent}", fix)


def _record_ok(record) -> bool:
    return record is None or (isinstance(record, dict) and isinstance(record.get("parts"), list)
                              and all(isinstance(e, list) and len(e) == 4
                                      and isinstance(e[0], str)
                                      and commit.prompt_of(e[0]) is not None
                                      for e in record["parts"]))


def complete_blocks(root: Path, table: str, skipped: list[str] | None = None) -> list[dict]:
    """(model, bench, run, config, block) of every complete block under ``root``: what readers
    may treat as final (an interrupted sweep's blocks are left out, and so are blocks of an older
    metric layout: :func:`readable_layout`). A torn or foreign config is left out too, with one
    line saying so appended to ``skipped``, and so is the number of units of an older layout."""
    rows, older = [], 0
    for path in sorted(location.root(root).glob(f"{table}/model=*/bench=*/run=*/config=*/{RESULT_CONFIG}")):
        try:
            state = read_json_file(path, "replay result config", "")
            blocks = state["blocks"]
            if not isinstance(blocks, list):
                raise TypeError("blocks is not a list")
        except (CatalogError, KeyError, TypeError):
            if skipped is not None:
                skipped.append(f"corrupt replay result config {path}: its results are left out; "
                               f"delete {path.parent} and replay again")
            continue
        if isinstance(state.get("unit"), dict) and not readable_layout(table, state["unit"]):
            older += 1  # recomputed by the next replay, which deletes it (drop_superseded)
            continue
        parts = {p.split("=", 1)[0]: p.split("=", 1)[1] for p in path.parent.parts[-4:]}
        for b in blocks:
            if isinstance(b, dict) and b.get("status") == "complete" \
                    and isinstance(b.get("id"), str):
                if b.get("files") is None:
                    try:
                        uncommitted(state, b, path, f"delete {path.parent} and replay again")
                    except CatalogError as exc:
                        if "--allow-legacy" in str(exc):
                            raise
                        if skipped is not None:
                            skipped.append(f"{exc}: its results are left out")
                        continue
                if not _record_ok(b.get("files")):
                    if skipped is not None:
                        skipped.append(f"replay result config {path} has a damaged file list: "
                                       f"its results are left out; delete {path.parent} and "
                                       "replay again")
                    continue
                rows.append(dict(model=parts["model"], bench=parts["bench"], run=parts["run"],
                                 config=parts["config"], block=b.get("id"),
                                 run_id=state.get("run_id"), prompts=b.get("prompts"),
                                 files=b.get("files"), layers=b.get("layers"),
                                 budgets=b.get("budgets"), unit=state.get("unit"),
                                 committed_at=b.get("committed_at"),
                                 folder=path.parent / f"block={b.get('id')}"))
    if older and skipped is not None:
        skipped.append(f"{older} result unit(s) of {table} under {location.display(root)} hold "
                       "an older metric layout (catalog/replay_metrics.py): left out until "
                       "replay recomputes them (ask for the same cells again)")
    return rows
