"""Data access for the dashboard: one cached DuckDB connection, results cached per dataset version.

The *version* of a traces folder is a digest of its manifests and Parquet files (names, sizes,
modification times). Cached connections and frames are keyed by it, so a new capture or replay
shows up on the next interaction without restarting the app.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import streamlit as st

from analysis.frames import ANALYSES
from analysis.sql import connect, views
from catalog import Catalog, CatalogError


def dataset_version(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith((".parquet", "_manifest.json", "config.json")):
                st_ = os.stat(os.path.join(dirpath, f))
                h.update(f"{dirpath}/{f}:{st_.st_size}:{st_.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


EVALUATION = ("evaluation",)


@st.cache_resource(show_spinner=False)
def connection(root: str, version: str, roles: tuple[str, ...] | None = EVALUATION):
    """Views over complete runs of ``roles`` (analysis pages: evaluation runs only, so
    calibration runs are never pooled into a figure; None: every role)."""
    return connect(root, roles=roles)


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

    @property
    def all_con(self):
        """A cursor over every complete run, calibration included (``role`` is a column)."""
        return connection(str(self.root), self.version, None).cursor()


def load(root: Path) -> tuple[Dataset | None, str | None]:
    """(dataset, None) or (None, a message saying what is missing or broken)."""
    if not root.is_dir():
        return None, f"No traces folder at `{root}` yet."
    try:
        all_runs = Catalog(root).all_runs()
    except CatalogError as exc:
        return None, f"{exc}."
    rows = [dict(model=r.model, bench=r.bench, run=r.name, role=r.role, status=r.manifest["status"],
                 prompts=r.manifest.get("prompts_total"), num_experts=r.manifest["num_experts"],
                 top_k=r.manifest["top_k"], moe_layers=r.manifest["moe_layers"],
                 model_location=r.manifest["model_location"], draft=r.manifest.get("draft"),
                 budget=r.settings.get("budget"), depth=r.settings["depth"]) for r in all_runs]
    complete = [r for r in rows if r["status"] == "complete"]
    if not complete:
        return None, "No complete capture yet." + (
            f" {len(rows)} run(s) still running or interrupted." if rows else "")
    version = dataset_version(root)
    try:
        con = connection(str(root), version, None).cursor()
        names = views(con)
        con.execute("SELECT count(*) FROM trees").fetchall()[0]
    except Exception as exc:  # noqa: BLE001 - a broken table must become a page, not a traceback
        return None, f"A trace table could not be read ({type(exc).__name__}: " \
                     f"{str(exc).splitlines()[0]}); recapture the affected run."
    return Dataset(root, version, pl.DataFrame(complete), names), None


@st.cache_data(show_spinner=False)
def overview(root: str, version: str) -> pl.DataFrame:
    return connection(root, version, None).cursor().sql("""
        SELECT model, bench, run, role, count(DISTINCT prompt_index) AS prompts, count(*) AS trees,
               avg(accepted_length) AS tau, avg(list_avg(unique_experts)) AS unique_experts,
               avg(list_avg(experts_loaded)) AS experts_loaded, any_value(budget) AS budget
        FROM trees GROUP BY ALL ORDER BY ALL""").pl()


@st.cache_data(show_spinner=False)
def frame(name: str, root: str, version: str) -> pl.DataFrame:
    """One of :data:`analysis.frames.ANALYSES` (tails, coverage, growth, balance, errors,
    closed), over evaluation runs, cached per dataset version."""
    return ANALYSES[name](connection(root, version).cursor())


@st.cache_data(show_spinner=False)
def query(root: str, version: str, sql: str) -> pl.DataFrame:
    return connection(root, version, None).cursor().sql(sql).pl()
