"""The run catalog: which captured runs exist under a traces root, what they are for, where their
files live.

Every stage (capture, replay, analysis, app) finds runs here and nowhere else::

    >>> cat = Catalog("traces")
    >>> [r.name for r in cat.runs(role="evaluation")]        # complete evaluation runs
    >>> cat.run_dir("routing", "tiny-olmoe", "mbpp", "demo-eval")

A run's manifest (``runs/model=…/bench=…/run=…/_manifest.json``) says ``status`` (``running``
until every prompt is written, then ``complete``), its ``role`` (``evaluation`` or
``calibration``), a ``run_id`` that changes when a run is recaptured from scratch (results
computed from an older capture are never reused), and the schema version, which is checked on
every read.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from moe_spec.catalog import columns, commit, location, parts, schema
from moe_spec.catalog.names import InvalidName, check_name, partition_value
from moe_spec.errors import UserError


class CatalogError(UserError, RuntimeError):
    """Missing, corrupt or incompatible traces; the message is one line for the user."""


def run_dir(root: Path, table: str, model: str, bench: str, run: str) -> Path:
    """The one place partition paths are built: ``<root>/<table>/model=…/bench=…/run=…``."""
    return location.root(root) / table / f"model={partition_value(model)}" / f"bench={bench}" / \
        f"run={run}"


def profile_dir(root: Path, model: str, device: str) -> Path:
    """Where ``profile-target`` stores a model's timings on one device type (``cpu``, ``cuda``):
    ``<root>/profile/model=…/device=…`` (:data:`catalog.schema.PROFILE`)."""
    return location.root(root) / schema.PROFILE_TABLE / f"model={partition_value(model)}" / \
        f"device={device}"


def profile_parts(root: Path, model: str) -> list[Path]:
    """The stored profiles of ``model``, one per device type, sorted by device."""
    return sorted(p for p in (location.root(root) / schema.PROFILE_TABLE /
                              f"model={partition_value(model)}").glob(f"device=*/{WHOLE_PART}"))


def batch_profile_dir(root: Path, table: str, model: str, bench: str, run: str) -> Path:
    """Where ``profile-batch`` stores one run's ``table`` (:data:`catalog.schema.BATCH_PROFILE_TABLES`):
    ``<root>/<table>/model=…/bench=…/run=…``."""
    if table not in schema.BATCH_PROFILE_TABLES:
        raise ValueError(f"{table!r} is not a profile-batch table")
    return location.root(root) / table / f"model={partition_value(model)}" / f"bench={bench}" / \
        f"run={run}"


def batch_part(measurement: str) -> str:
    """The file of one ``profile-batch`` measurement in its run's folder."""
    if not measurement or "/" in measurement or measurement.startswith((".", "_")):
        raise ValueError(f"{measurement!r} is not a measurement id")
    return f"part-{measurement}.parquet"


# --- part files: the one place their names are built and parsed ------------------------------
PART_GLOB = "part-*.parquet"  # every part of a table in one run folder
WHOLE_PART = "part-0.parquet"  # a table written whole, in one file (runs, profile)


def part_name(prompt_index: int, chunk: int = 0) -> str:
    """One chunk of one prompt's rows of a trace table: ``part-<prompt>-<chunk>.parquet``, both
    zero-padded (``part-000012-0003.parquet``), so names sort by prompt, then chunk."""
    return f"part-{prompt_index:06d}-{chunk:04d}.parquet"


def prompt_parts_glob(prompt_index: int) -> str:
    """Every chunk of one prompt: ``part-<prompt>-*.parquet``."""
    return f"part-{prompt_index:06d}-*.parquet"


def prompt_of_part(path: Path) -> int:
    """The prompt index in a part's name (:func:`part_name`); a file named otherwise is not one
    capture writes."""
    try:
        return int((path if hasattr(path, "name") else Path(path)).name.split("-")[1])
    except (IndexError, ValueError):
        raise CatalogError(f"{path} is not a part capture writes (part-<prompt>-<chunk>.parquet)"
                           "; remove it or recapture the run") from None


REQUIRED = ("model", "bench", "run", "status", "role", "settings", "schema_version")


def write_manifest(root: Path, manifest: dict) -> Path:
    """Write a run's manifest (atomically) where the catalog looks for it; checks the required
    keys. Capture writes its own through this; so do synthetic data sets (tests, benchmarks)."""
    from moe_spec.catalog import atomic
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ValueError(f"a manifest needs {', '.join(missing)}")
    path = run_dir(root, "runs", manifest["model"], manifest["bench"], manifest["run"]) / \
        schema.MANIFEST
    location.mkdir(path.parent)
    atomic.write_json(path, manifest)
    return path


LEGACY_ENV = "MOESPEC_ALLOW_LEGACY"  # "1": read complete runs (and replay blocks) committed
# before file lists existed, as found, each named in a warning (query/report --allow-legacy)
_WARNED: set[str] = set()


def legacy(what: str, fix: str) -> None:
    """``what`` (a run or replay result of a layout before committed file lists) may be read
    only when ``$MOESPEC_ALLOW_LEGACY`` is 1 (``--allow-legacy``): then with a warning naming
    it (once per process), else refused in one line."""
    if os.environ.get(LEGACY_ENV) != "1":
        raise CatalogError(f"{what} predates committed file lists, so its files cannot be "
                           f"verified; {fix}, or read it as found with --allow-legacy "
                           f"(${LEGACY_ENV}=1)")
    if what not in _WARNED:
        _WARNED.add(what)
        print(f"warning: {what} predates committed file lists: its folders are read as found "
              "(--allow-legacy); recapture it to protect its answers", file=sys.stderr)


def add_legacy_argument(parser) -> None:
    """``--allow-legacy``: what a reading command adds to read runs committed before file lists
    (:func:`allow_legacy` applies it)."""
    parser.add_argument("--allow-legacy", action="store_true",
                        help="also read complete runs and replay results written before "
                             "committed file lists (trace schema < 5), as found, each named in "
                             f"a warning (default: refused; also ${LEGACY_ENV}=1)")


def allow_legacy(args) -> None:
    """Apply ``--allow-legacy`` to this process's readers."""
    if getattr(args, "allow_legacy", False):
        os.environ[LEGACY_ENV] = "1"


def read_json_file(path, what: str, fix: str):
    """A manifest or config as JSON, read only as a regular file of bounded size
    (:func:`catalog.location.read_small`): anything else is one line naming it."""
    try:
        return json.loads(location.read_small(path))
    except OSError as exc:
        raise CatalogError(f"{what} {path} cannot be read ({exc.strerror or exc}); {fix}") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError):
        raise CatalogError(f"corrupt {what} {path}; {fix}") from None


def read_manifest(path: Path) -> dict:
    """A run manifest, checked: a regular file of bounded size holding a JSON object, this
    tool's schema version, required keys; a complete run of a committed schema
    (:data:`schema.COMMITTED_VERSION`) holds its file list and digest, an older one is read
    only on ``--allow-legacy`` (:func:`legacy`)."""
    manifest = read_json_file(path, "manifest", "delete that run folder or recapture it")
    if not isinstance(manifest, dict):
        raise CatalogError(f"corrupt manifest {path} (not an object); recapture that run")
    version = manifest.get("schema_version")
    if not _is_int(version):
        raise CatalogError(f"manifest {path}: schema_version is {version!r}, not a whole number; "
                           "fix that field or recapture the run")
    if version not in schema.READABLE_VERSIONS:
        raise CatalogError(f"{path} has trace schema version {version}, "
                           f"this tool reads {', '.join(map(str, schema.READABLE_VERSIONS))}; "
                           "recapture the run")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise CatalogError(f"manifest {path} lacks {', '.join(missing)}; recapture that run")
    problem = manifest_problem(manifest) or commit_problem(manifest)
    if problem:
        raise CatalogError(f"manifest {path}: {problem}; fix that field or recapture the run")
    if manifest["status"] == "complete" and manifest.get("files") is None:
        if version >= schema.COMMITTED_VERSION or "commit_digest" in manifest:
            raise CatalogError(f"manifest {path}: a complete run of trace schema {version} "
                               "lists its committed files and their digest, this one does not "
                               "(edited?); recapture the run")
        legacy(f"run {manifest['run']} ({manifest['model']} / {manifest['bench']}, trace schema "
               f"{version})", "recapture it")
    return manifest


# what a run's commit digest covers: everything but the fields the writer updates as it goes
_UNDIGESTED = ("status", "prompts_done", "files", "commit_digest")


def commit_digest(manifest: dict) -> str:
    """Digest of a committed manifest's facts (model, N, k, layers, settings, prompts, …) and
    its file list: a manifest edited after its run was committed no longer matches it."""
    import hashlib
    body = {k: v for k, v in manifest.items() if k not in _UNDIGESTED}
    body["files"] = manifest.get("files")
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


def commit_problem(manifest: dict) -> str | None:
    """What is wrong with a committed manifest's file list, or None (runs committed before
    trace schema 5 have none: their folders are read as found)."""
    files = manifest.get("files")
    if files is None:
        return None
    if "commit_digest" not in manifest:
        return "it lists committed files but no commit digest"

    def entry_ok(e) -> bool:
        return (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
                and (commit.prompt_of(e[0]) is not None or e[0] == WHOLE_PART)
                and all(_is_int(v) for v in e[1:3]) and isinstance(e[3], str))

    if not isinstance(files, dict) or not all(
            isinstance(t, dict) and isinstance(t.get("parts"), list)
            and isinstance(t.get("columns"), list) and all(entry_ok(e) for e in t["parts"])
            for t in files.values()):
        return "files is not a commit record (table -> columns and parts)"
    if manifest.get("commit_digest") != commit_digest(manifest):
        return ("its facts or file list were edited after the run was committed (commit "
                "digest differs)")
    seqs = files.get(schema.COMPLETION_TABLE, {}).get("parts", [])
    total = manifest.get("prompts_total", len(manifest.get("prompt_ids", [])))
    if manifest["status"] == "complete" and sum(e[1] for e in seqs) != total:
        return (f"it lists {total} prompts but its committed sequences parts hold "
                f"{sum(e[1] for e in seqs)} rows")
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# fields that become numbers or lists of numbers downstream: their types are checked at read
_INT_FIELDS = ("num_experts", "top_k", "num_layers", "hidden_size", "prompts_done",
               "prompts_total")
_INT_LIST_FIELDS = ("moe_layers", "feature_layers")


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest's fields (names that become paths, values of the wrong
    type), or None. Names get the same check as the command line's (:func:`check_name`)."""
    for key in ("run", "bench"):
        try:
            check_name(manifest[key], key)
        except InvalidName as exc:
            return str(exc)
    model = manifest["model"]
    if not isinstance(model, str) or not model.strip() or "\n" in model:
        return f"model {model!r} is not a model name"
    if len(partition_value(model).encode()) > 200:  # a path component: at most 255 bytes
        return f"model {model[:40]!r}… is {len(model)} characters, longer than a model name"
    if manifest["role"] not in schema.ROLES:
        return f"role {manifest['role']!r} is not one of {', '.join(schema.ROLES)}"
    if manifest["status"] not in ("running", "complete"):
        return f"status {manifest['status']!r} is not running or complete"
    if manifest.get("kind", schema.CAPTURE) not in schema.KINDS:
        return f"kind {manifest.get('kind')!r} is not one of {', '.join(schema.KINDS)}"
    if not isinstance(manifest["settings"], dict):
        return "settings is not an object"
    if not isinstance(manifest.get("run_id", ""), str):
        return "run_id is not a string"
    for key in _INT_FIELDS:
        if key in manifest and not _is_int(manifest[key]):
            return f"{key} is {manifest[key]!r}, not a whole number"
    for key in _INT_LIST_FIELDS:
        if key in manifest and not (isinstance(manifest[key], list)
                                    and all(_is_int(v) for v in manifest[key])):
            return f"{key} is {manifest[key]!r}, not a list of whole numbers"
    ids = manifest.get("prompt_ids", [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return "prompt_ids is not a list of strings"
    return None


@dataclass(frozen=True)
class Run:
    """One captured run: its manifest and the folder of each of its tables."""

    root: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.manifest["run"]

    @property
    def model(self) -> str:
        return self.manifest["model"]

    @property
    def bench(self) -> str:
        return self.manifest["bench"]

    @property
    def role(self) -> str:
        return self.manifest["role"]

    @property
    def run_id(self) -> str:
        return self.manifest.get("run_id", "")

    @property
    def complete(self) -> bool:
        return self.manifest["status"] == "complete"

    @property
    def settings(self) -> dict:
        return self.manifest["settings"]

    @property
    def kind(self) -> str:
        """``capture`` or ``routing-only`` (imported from a serving engine: top-k ids only)."""
        return self.manifest.get("kind", schema.CAPTURE)

    @property
    def routing_only(self) -> bool:
        return self.kind == schema.ROUTING_ONLY

    @property
    def source_format(self) -> str | None:
        """The serving engine's format a routing-only run was imported from (vllm, sglang,
        megatron, llamacpp); None for a capture."""
        source = self.manifest.get("source")
        return source.get("format") if isinstance(source, dict) else None

    def refusal(self, what: str = "nothing to replay, evaluate or calibrate from") -> str:
        """One line: why a routing-only run cannot be replayed, evaluated or used as
        calibration, and where its analyses are."""
        return (f"run {self.name} is routing-only (imported from "
                f"{self.source_format or 'a serving engine'}): it holds top-k expert ids only, no "
                f"router probabilities, trees or hidden states, so there is {what}; its ids-only "
                "analyses are in `report`, the dashboard and `query` (views routing_ids, "
                "summary_layers)")

    PROMPT_RANGE = ("offset", "limit")  # settings that choose prompts, not how they are decoded

    @property
    def setting(self) -> dict:
        """The capture settings that make this run's data what it is (everything but the
        prompt range): runs of one model and benchmark with equal settings are one experiment
        and may be pooled; runs whose settings differ never are (views and pages say which)."""
        found = {k: v for k, v in self.settings.items() if k not in self.PROMPT_RANGE}
        return {"batch_size": 1, **found}  # (b = 1 is left out of a capture's identity)

    @property
    def ref(self) -> dict:
        """Name and run id: how results and statistics say which capture they came from."""
        return dict(run=self.name, run_id=self.run_id)

    def dir(self, table: str) -> Path:
        return run_dir(self.root, table, self.model, self.bench, self.name)

    @property
    def committed(self) -> dict | None:
        """The run's commit record (table -> columns and parts), or None for a run committed
        before trace schema 5 (or still running): its folders are read as found."""
        files = self.manifest.get("files")
        return files if isinstance(files, dict) and self.complete else None

    def _entries(self, table: str) -> list[list]:
        return (self.committed or {}).get(table, {}).get("parts", [])

    def _verified(self, table: str, entries: list[list]) -> list[Path]:
        """The paths of committed ``entries`` of ``table``, each checked against its record."""
        listed = (self.committed or {}).get(table, {}).get("columns")
        fix = f"the trace of run {self.name} was damaged; recapture the run"

        def types(path):  # checked when a file is first verified, remembered with its hash
            try:
                columns.check_footer(path, table)
            except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
                raise CatalogError(f"{path}: corrupt or unreadable {table} part "
                                   f"({columns.reason(exc, path)}); recapture the run") from None
            try:
                parts.check_part(self.manifest, table, path)  # its numbers against the manifest
            except parts.PartError as exc:
                raise CatalogError(str(exc)) from None
        types = types if table in schema.ALL_TABLES else None
        paths = []
        for entry in entries:
            path = self.dir(table) / entry[0]
            try:
                commit.verify(path, entry, listed, self.root, fix, types)
            except commit.CommitError as exc:
                raise CatalogError(str(exc)) from None
            paths.append(path)
        return paths

    def files(self, table: str) -> list[Path]:
        """Every part of ``table`` that the run committed, verified (a run without a commit
        record: the parts capture names, as found)."""
        if self.committed is None:
            folder = self.dir(table)
            if not folder.is_dir():
                return []
            return sorted(p for p in location.iterdir(folder)
                          if commit.prompt_of(p.name) is not None)
        return self._verified(table, self._entries(table))

    def prompt_keys(self) -> set[tuple[str, str]]:
        """(bench, prompt id) of every prompt the run covers: what calibration must not share."""
        return {(self.bench, pid) for pid in self.manifest.get("prompt_ids", [])}

    def prompt_indices(self) -> list[int]:
        """Prompts written completely (their ``sequences`` part exists, and is committed), in
        order."""
        if self.committed is not None:
            return sorted({commit.prompt_of(e[0])
                           for e in self._entries(schema.COMPLETION_TABLE)})
        folder = self.dir(schema.COMPLETION_TABLE)
        return sorted(prompt_of_part(p) for p in folder.glob(PART_GLOB))

    def parts(self, table: str, prompt_index: int) -> list[Path]:
        """One prompt's parts of ``table``: the committed ones, verified."""
        if self.committed is None:
            return sorted(self.dir(table).glob(prompt_parts_glob(prompt_index)))
        return self._verified(table, [e for e in self._entries(table)
                                      if commit.prompt_of(e[0]) == prompt_index])

    def expected_prompts(self) -> list[int]:
        offset = self.settings.get("offset", 0)
        return list(range(offset, offset + len(self.manifest.get("prompt_ids", []))))

    def check(self) -> Run:
        """A complete run must hold every prompt it lists in every table that is always
        complete; raise one line naming the folder that lacks one."""
        if not self.complete:
            return self
        expected = self.expected_prompts()
        if self.routing_only:  # imported: committed whole, parts of bounded size (not per prompt)
            missing = [t for t in schema.ROUTING_ONLY_TABLES if t not in (self.committed or {})]
            if missing:
                raise CatalogError(f"the commit record of routing-only run {self.name} lacks its "
                                   f"{missing[0]} table; import the routing again")
        if self.committed is not None:  # the record lists every part; readers verify them
            for table, record in self.committed.items():  # a folder gone or moved behind
                folder = self.dir(table)  # a link (its files are verified as they are read)
                if record.get("parts") and (location.is_remote(folder) is False and (
                        not folder.is_dir() or not commit.inside(folder / "x", self.root))):
                    raise CatalogError(f"{folder / record['parts'][0][0]} is missing or reached "
                                       "through a symbolic link (listed in its commit record): "
                                       f"the trace of run {self.name} was damaged; recapture "
                                       "the run")
            for table in ("sequences", "trees", "nodes", "routing"):
                if self.routing_only:
                    break
                present = {commit.prompt_of(e[0]) for e in self._entries(table)}
                missing = sorted(set(expected) - present)
                if missing:
                    raise CatalogError(f"the commit record of run {self.name} lacks prompt "
                                       f"{missing[0]} of {table} ({len(missing)} missing); "
                                       "recapture the run")
            return self
        for table in ("sequences", "trees", "nodes", "routing"):
            present = {prompt_of_part(p) for p in self.dir(table).glob(PART_GLOB)}
            missing = sorted(set(expected) - present)
            if missing:
                raise CatalogError(f"{self.dir(table)} lacks prompt {missing[0]} of complete run "
                                   f"{self.name} ({len(missing)} missing); the trace was damaged, "
                                   "recapture the run")
        if not self.dir("moe_io").is_dir():  # a synthetic run without MoE tensors
            return self
        routing = {p.name for p in self.dir("routing").glob(PART_GLOB)
                   if prompt_of_part(p) in set(expected)}
        io = {p.name for p in self.dir("moe_io").glob(PART_GLOB)}
        lost = sorted(routing - io)
        if lost:  # capture writes a moe_io part (empty where nothing is kept) for every chunk
            raise CatalogError(f"{self.dir('moe_io') / lost[0]} is missing ({len(lost)} moe_io "
                               f"part(s) of complete run {self.name}); the trace was damaged, "
                               "recapture the run")
        return self




class Catalog:
    """Every run under one traces root."""

    def __init__(self, root: str | Path):
        self.root = location.root(root)

    def manifests(self) -> list[Path]:
        return sorted(self.root.glob(f"runs/model=*/bench=*/run=*/{schema.MANIFEST}"))

    def orphans(self, manifests: list[Path]) -> list[Path]:
        """Folders of runs started here (their ``runs`` folder exists) that hold Parquet parts
        while the run has no manifest: the manifest was deleted. A run being started holds only
        its lock until the manifest is written, and an abandoned import removes its ``runs``
        folder last, so neither is an orphan. Parts under a run no ``runs`` folder names are
        strays no reader lists (issue 38), not a damaged run."""
        known = {p.parent for p in manifests}
        tables = (*dict.fromkeys((*schema.TRACE_TABLES, *schema.ROUTING_ONLY_TABLES)), "runs")
        found = []
        for started in sorted(self.root.glob("runs/model=*/bench=*/run=*")):
            if started in known:
                continue
            model, bench, run = started.parent.parent.name, started.parent.name, started.name
            folders = [self.root / table / model / bench / run for table in tables]
            found += [f for f in folders if next(iter(f.glob("*.parquet")), None)]
        return found

    def all_runs(self) -> list[Run]:
        """Every run with a manifest, complete or not (manifests are checked). A run folder
        with data but no manifest is refused, never skipped: readers would silently answer
        without it."""
        manifests = self.manifests()
        orphans = self.orphans(manifests)
        if orphans:
            raise CatalogError(
                f"{orphans[0]} holds trace parts but its run has no {schema.MANIFEST} "
                f"({len(orphans)} such folder(s)); the trace was damaged: recapture the run "
                "or delete its folders")
        return [Run(self.root, read_manifest(p)) for p in manifests]

    def runs(self, *, model: str | None = None, bench: str | None = None,
             names: list[str] | None = None, roles: tuple[str, ...] | None = None,
             complete: bool = True,
             kinds: tuple[str, ...] | None = (schema.CAPTURE,)) -> list[Run]:
        """Runs matching every given filter; only complete ones unless ``complete=False``. Only
        captures unless ``kinds`` says otherwise (None: every kind): what needs router
        probabilities, trees or hidden states (replay, evaluate, calibration) never gets a
        routing-only run, and one named in ``names`` is refused in one line
        (:meth:`Run.refusal`)."""
        found = []
        for run in self.all_runs():
            if complete and not run.complete:
                continue
            if kinds is not None and run.kind not in kinds:
                if names and run.name in names and (model is None or run.model == model) \
                        and (bench is None or run.bench == bench):
                    raise CatalogError(run.refusal())
                continue
            if model and run.model != model:
                continue
            if bench and run.bench != bench:
                continue
            if names and run.name not in names:
                continue
            if roles and run.role not in roles:
                continue
            found.append(run.check())
        return found

    def run_dir(self, table: str, model: str, bench: str, run: str) -> Path:
        return run_dir(self.root, table, model, bench, run)

    def calibration_runs(self, names: list[str], model: str,
                         evaluated: set[tuple[str, str]]) -> list[Run]:
        """The named complete runs of ``model``, checked to share no prompt with ``evaluated``
        (bench, prompt id) keys."""
        found = self.runs(model=model, names=names)
        missing = set(names) - {r.name for r in found}
        if missing:
            raise CatalogError(f"calibration run(s) {', '.join(sorted(missing))} not found "
                               f"complete under {self.root} for {model}")
        overlap = evaluated & set().union(*(r.prompt_keys() for r in found))
        if overlap:
            bench, pid = sorted(overlap)[0]
            raise CatalogError(f"calibration and evaluated prompts overlap ({len(overlap)} "
                               f"prompts, e.g. {bench} {pid}); calibrate on other prompts "
                               "(another --offset or benchmark)")
        return found


def dataset_version(root: Path) -> str:
    """A digest of a traces folder's manifests, result configs and Parquet files (names and
    file versions, :func:`catalog.location.file_version`: the key under which readers remember
    a verified content hash, so a byte flipped in place with its modification time restored
    changes it): it changes whenever a capture, replay or summary writes, and only then. The
    dashboard keys its held connections and caches by it and ``report`` skips a report whose
    traces did not change; a changed version makes them read again through the readers'
    verification."""
    import hashlib
    h = hashlib.sha256()
    for name, size, version in location.listing(location.root(root)):
        if name.endswith((".parquet", "_manifest.json", "config.json")):
            h.update(f"{name}:{size}:{version}".encode())
    return h.hexdigest()[:16]
