"""Runs side by side, the way experiment trackers compare runs: their settings diffed, their key
numbers in one table, and the same figures with one line per run on the same axes.

Used by the dashboard's *Compare runs* page and by ``report --compare RUN RUN …``. Every frame
is grouped by run (never pooled across runs), and replay results come from the default-variant
views (one variant per cell, :data:`analysis.sql.DEFAULT_VARIANT_RULE`) with the variant's
calibration shown beside each line.
"""

from __future__ import annotations

import json

import plotly.graph_objects as go
import polars as pl

from moe_spec.analysis import figures, routing
from moe_spec.analysis.sql import views
from moe_spec.catalog import Run

BY = "model, bench, run"


def settings_diff(runs: list[Run]) -> pl.DataFrame:
    """One row per setting (capture settings and model facts) whose value differs between the
    runs, one column per run: what makes them different experiments."""
    facts = {r.name: {**{k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
                         for k, v in {"batch_size": 1, **r.settings}.items()},
                      "model": r.model, "bench": r.bench, "role": r.role,
                      "dtype": r.manifest.get("dtype"), "device": r.manifest.get("device"),
                      "prompts": r.manifest.get("prompts_total")} for r in runs}
    keys = sorted({k for f in facts.values() for k in f})
    rows = [{"setting": k, **{name: None if f.get(k) is None else str(f.get(k))
                              for name, f in facts.items()}}
            for k in keys if len({str(f.get(k)) for f in facts.values()}) > 1]
    schema = {"setting": pl.String, **{r.name: pl.String for r in runs}}
    return pl.DataFrame(rows, schema=schema)


def key_numbers(con) -> pl.DataFrame:
    """Per run: prompts, trees, τ, unique experts per layer per tree (unbudgeted trees)."""
    return con.sql("""
        SELECT run, count(DISTINCT prompt_index) AS prompts, count(*) AS trees,
               avg(accepted_length) AS tau, avg(list_avg(unique_experts)) AS unique_experts
        FROM trees GROUP BY run ORDER BY run""").pl()


def coverage(con) -> pl.DataFrame:
    """Coverage curves per run (routing summaries; empty where none are built)."""
    if "summary_layers" not in views(con):
        return pl.DataFrame()
    return routing.coverage_curve(con, by=BY)


def errors(con) -> pl.DataFrame:
    """Open-loop mean RSE per run × ranking × coverage × budget, with each cell's variant's
    calibration (the default views: one variant per cell)."""
    if "replay_open" not in views(con):
        return pl.DataFrame()
    return con.sql("""
        SELECT run, ranking, coverage, budget, avg(rse) AS rse, count(*) AS tree_layers,
               string_agg(DISTINCT coalesce(calibration, 'none'), ', ') AS calibration
        FROM replay_open GROUP BY ALL ORDER BY ALL""").pl()


def lines(frame: pl.DataFrame, x: str, y: str, title: str, x_title: str, y_title: str,
          log_y: bool = False) -> go.Figure:
    """One line per run on shared axes."""
    fig = go.Figure()
    for i, run in enumerate(frame["run"].unique(maintain_order=True).to_list()):
        mine = frame.filter(pl.col("run") == run)
        fig.add_scatter(x=mine[x], y=mine[y], mode="lines+markers", name=f"run {run}",
                        line=dict(color=figures.COLORS[i % len(figures.COLORS)]),
                        showlegend=True)  # (named even when only one run has this figure)
    fig.update_xaxes(title=x_title)
    fig.update_yaxes(title=y_title, type="log" if log_y else None)
    return figures._style(fig, title)


def compare_figures(con, ranking: str = "router", cover: str = "truncation") -> list:
    """The figures a comparison draws: coverage curves, and error vs budget of ``ranking``
    under ``cover``, one line per run."""
    figs = []
    curve = coverage(con)
    if curve.height:
        per_run = curve.group_by(["run", "budget"], maintain_order=True).agg(
            pl.col("coverage").mean()).sort(["run", "budget"])
        figs.append(lines(per_run, "budget", "coverage", "Coverage: router mass held by the "
                          "top-B experts of a tree, per run", "budget B (experts)",
                          "share of router mass"))
    err = errors(con)
    if err.height:
        mine = err.filter((pl.col("ranking") == ranking) & (pl.col("coverage") == cover))
        if mine.height:
            figs.append(lines(mine.with_columns(pl.col("rse").clip(figures.NOISE_FLOOR)),
                              "budget", "rse", f"Open-loop error of {ranking} ({cover}) vs "
                              "budget, per run", "budget B (experts)",
                              "mean RSE (log)", log_y=True))
    return figs
