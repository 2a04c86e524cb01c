"""Data access for the dashboard: a DuckDB connection per browser session, results cached per
dataset version.

The *version* of a traces folder is a digest of its manifests and Parquet files (names and file
versions: size, modification and change times, inode; the key the readers' verification
remembers a content hash under, :func:`catalog.dataset_version`). Connections and frames are
keyed by it, so a new capture or replay shows up on the next interaction without restarting the
app. Each session has its own read-only
connection (:func:`analysis.sql.connect`), and SQL typed in the console runs through
:func:`analysis.sql.run_query` (queries only): nothing one visitor types changes what another
sees. Frames cached for every visitor (:func:`overview`, :func:`frame`) are computed on a fresh
connection of their own (:func:`pristine`), never on the session's that missed the cache.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import streamlit as st

from moe_spec.analysis import summaries
from moe_spec.analysis.frames import ANALYSES, NEEDS
from moe_spec.analysis.sql import connect, run_query, views
from moe_spec.catalog import Catalog, CatalogError, dataset_version  # noqa: F401 - data.dataset_version

EVALUATION = ("evaluation",)


def connection(root: str, version: str, roles: tuple[str, ...] | None = EVALUATION,
               runs: tuple[str, ...] | None = None, variants: tuple[str, ...] = ()):
    """This session's connection with views over complete runs of ``roles`` (analysis pages:
    evaluation runs only, so calibration runs are never pooled into a figure; None: every
    role), and of the ``runs`` named (a page's chosen setting; None: every run); ``variants``:
    the replay variants the user picked (:func:`analysis.sql.connect`)."""
    store = st.session_state.setdefault("_connections", {})
    key = (root, version, roles, runs, variants)
    if key not in store:
        for old in [k for k in store if k[:2] != key[:2]]:
            store.pop(old).close()  # the data changed: drop this session's old connections
        store[key] = connect(root, roles=roles, runs=runs, variants=variants)
    return store[key]


@dataclass
class Dataset:
    root: Path
    version: str
    runs: pl.DataFrame  # one row per complete run
    views: list[str]

    @property
    def evaluation(self) -> pl.DataFrame:
        """Complete evaluation runs: what every analysis page draws."""
        return self.runs.filter(pl.col("role") == "evaluation")

    @property
    def con(self):
        """A cursor over evaluation runs (DuckDB connections are not shared across the threads
        Streamlit runs sessions on; cursors are, and see the same views)."""
        return connection(str(self.root), self.version).cursor()

    def con_for(self, roles: tuple[str, ...], runs: tuple[str, ...] | None = None,
                variants: tuple[str, ...] = ()):
        """A cursor over complete runs of ``roles`` (and of the ``runs`` named; ``variants``:
        the replay variants picked)."""
        roles = None if set(roles) >= {"evaluation", "calibration"} else tuple(roles)
        return connection(str(self.root), self.version, roles, runs, variants).cursor()


def _storage(manifest: dict) -> str:
    s = manifest.get("storage")
    if not s:
        return "—"
    layers = s["layers"]
    every = layers == manifest.get("moe_layers")
    return (f"{'all' if every else len(layers)} MoE layer(s), passes {s['passes']}, "
            f"{s['dtype']}, output {'stored' if s['output'] == 'store' else 'recomputed'}")


@st.cache_resource(show_spinner=False)
def tokenizer(location: str):
    """The run's tokenizer (to show token text), or None when it cannot be loaded. A local
    ``tokenizer.json`` loads with the ``tokenizers`` library (instant); only a hub id needs
    transformers."""
    folder = Path(location)
    try:
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer
            return Tokenizer.from_file(str(folder / "tokenizer.json"))
        if folder.is_dir():
            return None  # a local model without a fast tokenizer: token ids are shown
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(location)
    except Exception:  # noqa: BLE001 - any failure to load: show token ids
        return None


def load(root: Path) -> tuple[Dataset | None, str | None]:
    """(dataset, None) or (None, a message saying what is missing or broken)."""
    if not root.is_dir():
        return None, f"No traces folder at `{root}` yet."
    try:
        all_runs = Catalog(root).all_runs()
    except CatalogError as exc:
        return None, f"{exc}."
    rows = [dict(model=r.model, bench=r.bench, run=r.name, role=r.role, status=r.manifest["status"],
                 storage=_storage(r.manifest),
                 prompts=r.manifest.get("prompts_total"), num_experts=r.manifest["num_experts"],
                 top_k=r.manifest["top_k"], moe_layers=r.manifest["moe_layers"],
                 model_location=r.manifest["model_location"], draft=r.manifest.get("draft"),
                 budget=r.settings.get("budget"), depth=r.settings.get("depth"),
                 kind=r.kind, source_format=r.source_format,
                 setting=json.dumps(r.setting, sort_keys=True, default=str))
            for r in all_runs]
    complete = [r for r in rows if r["status"] == "complete"]
    if not complete:
        return None, "No complete capture yet." + (
            f" {len(rows)} run(s) still running or interrupted." if rows else "")
    try:
        with st.spinner("Summarising the routing of new runs (once per run)…"):
            summaries.ensure(root)
    except CatalogError as exc:
        return None, f"{exc}."
    version = dataset_version(root)
    try:
        con = connection(str(root), version, None).cursor()
        names = views(con)
        for table in ("trees", "routing_ids"):  # captures' and routing-only runs' (imported)
            if table in names:
                con.execute(f"SELECT count(*) FROM {table}").fetchall()[0]
    except Exception as exc:  # noqa: BLE001 - a broken table must become a page, not a traceback
        return None, f"A trace table could not be read ({type(exc).__name__}: " \
                     f"{str(exc).splitlines()[0]}); recapture the affected run."
    return Dataset(root, version, pl.DataFrame(complete), names), None


def current(root: Path) -> tuple[Dataset | None, str | None]:
    """The session's dataset, reloaded whenever the traces folder's version changes (a page
    script calls this on every rerun, so a capture that lands while the app is open shows up on
    the next interaction)."""
    held = st.session_state.get("dataset")
    if held is not None and held.root == root and held.version == dataset_version(root):
        return held, None
    dataset, problem = load(root)
    st.session_state["dataset"] = dataset
    return dataset, problem


@contextmanager
def pristine(root: str, roles: tuple[str, ...] | None, runs: tuple[str, ...] | None = None,
             variants: tuple[str, ...] = ()):
    """A fresh connection of its own, closed afterwards: what cached frames (shared by every
    visitor) are computed on, so nothing done on any session's connection can reach them."""
    con = connect(root, roles=roles, runs=runs, variants=variants)
    try:
        yield con
    finally:
        con.close()


@st.cache_data(show_spinner=False)
def overview(root: str, version: str) -> pl.DataFrame:
    with pristine(root, None) as con:
        if "trees" not in views(con):  # routing-only runs alone (imported): no trees to count
            return pl.DataFrame(schema=dict(
                model=pl.String, bench=pl.String, run=pl.String, role=pl.String,
                prompts=pl.Int64, trees=pl.Int64, tau=pl.Float64, unique_experts=pl.Float64,
                experts_loaded=pl.Float64, budget=pl.Int16))
        return con.sql("""
        SELECT model, bench, run, role, count(DISTINCT prompt_index) AS prompts, count(*) AS trees,
               avg(accepted_length) AS tau, avg(list_avg(unique_experts)) AS unique_experts,
               avg(list_avg(experts_loaded)) AS experts_loaded, any_value(budget) AS budget
        FROM trees GROUP BY ALL ORDER BY ALL""").pl()


@st.cache_data(show_spinner=False)
def frame(name: str, root: str, version: str,
          roles: tuple[str, ...] = EVALUATION, runs: tuple[str, ...] | None = None,
          variants: tuple[str, ...] = ()) -> pl.DataFrame:
    """One of :data:`analysis.frames.ANALYSES` (tails, coverage, growth, balance, errors,
    closed) over runs of ``roles`` (and the ``runs`` named; replay results of the ``variants``
    picked, else the default rule's), cached per dataset version."""
    roles_key = None if set(roles) >= {"evaluation", "calibration"} else tuple(roles)
    with pristine(root, roles_key, runs, variants) as con:  # never a session's connection (pristine)
        needs = NEEDS.get(name, "routing")
        if needs not in views(con):
            return pl.DataFrame()
        return ANALYSES[name](con)


@st.cache_data(show_spinner=False)
def truncation(root: str, version: str, model: str, bench: str, run: str) -> pl.DataFrame:
    """A routing-only run's truncation coverage of static and frequency budgets
    (:func:`analysis.ids.truncation`), cached per dataset version."""
    from moe_spec.analysis import ids
    found = Catalog(Path(root)).runs(model=model, bench=bench, names=[run], roles=None,
                                     kinds=None)
    if not found:
        return pl.DataFrame()
    return ids.truncation(ids.figures(found[0]))


def prompt_rows(root: Path, model: str, bench: str, run: str, table: str, prompt: int,
                columns: list[str], **equal) -> pl.DataFrame:
    """One prompt's rows of a trace table, read from that prompt's own part files (never a scan
    over the run), filtered by ``column=value`` pairs."""
    from moe_spec.catalog import reader
    found = Catalog(root).runs(model=model, bench=bench, names=[run], roles=None)
    if not found:
        raise CatalogError(f"run {run} of {model} / {bench} is gone; reload the page")
    frame = pl.from_arrow(reader.read_parts(found[0], table, prompt, columns))
    for column, value in equal.items():
        frame = frame.filter(pl.col(column) == value)
    return frame


def nested_columns(frame: pl.DataFrame) -> list[str]:
    """Columns CSV cannot hold (lists, arrays, structs)."""
    return [c for c, t in frame.schema.items() if t.is_nested()]


def to_csv(frame: pl.DataFrame) -> str:
    """CSV of a query result, nested columns (lists, arrays, structs) as JSON text."""
    return frame.with_columns(
        pl.when(pl.col(c).is_not_null()).then(pl.struct(pl.col(c).alias("v")).struct
                                               .json_encode().str.slice(5).str.strip_suffix("}"))
        .alias(c) for c in nested_columns(frame)).write_csv()


def to_parquet(frame: pl.DataFrame) -> bytes:
    import io
    buf = io.BytesIO()
    frame.write_parquet(buf)
    return buf.getvalue()


def query(root: str, version: str, sql: str) -> pl.DataFrame:
    """User SQL, read-only (raises :class:`analysis.sql.QueryRefused` for anything else)."""
    return pl.from_arrow(run_query(connection(root, version, None).cursor(), sql))
