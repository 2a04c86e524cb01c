"""Runs side by side, the way experiment trackers compare runs: their settings diffed, their key
numbers in one table, and the same figures with one line per run on the same axes.

Used by the dashboard's *Compare runs* page and by ``report --compare RUN RUN …``. Every frame
is grouped by run (never pooled across runs), and replay results come from the default-variant
views (one whole variant per curve, :data:`analysis.sql.DEFAULT_VARIANT_RULE`, or the variants
picked: :func:`analysis.sql.connect`) with the variant's calibration shown beside each line.
A run keeps one colour in every figure (its place among the runs compared), and a figure that
has no line for a run says so on the figure.
"""

from __future__ import annotations

import json

import plotly.graph_objects as go
import polars as pl

from moe_spec.analysis import figures, replay_views, routing
from moe_spec.analysis.sql import views
from moe_spec.catalog import CatalogError, Run
from moe_spec.catalog.replay_metrics import OPEN_TABLE

BY = "model, bench, run"


def is_import(setting: dict) -> bool:
    """Whether a run's setting is a routing-only import's (top-k ids from a serving engine)."""
    return setting.get("kind") == "routing-only" or bool(setting.get("source_format"))


def differing_keys(settings: list[dict]) -> list[str]:
    """The setting keys whose values differ among the captures of ``settings`` (imports, whose
    settings are of another kind, are labelled as imports instead and do not count)."""
    captures = [s for s in settings if not is_import(s)]
    return sorted({k for s in captures for k in s
                   if any(s.get(k) != other.get(k) for other in captures)})


def setting_words(setting: dict, differ: list[str]) -> str:
    """A setting in a few words: an import as an import (its format), a capture by every value
    that differs among the captures (unset ones left out), else "capture"."""
    if is_import(setting):
        return f"routing-only import ({setting.get('source_format') or 'serving engine'})"
    return ", ".join(f"{k} {setting[k]}" for k in differ
                     if setting.get(k) is not None and k not in ("kind", "source_format")) \
        or "capture"


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
    """Per run: prompts, trees, τ, unique experts per layer per tree (unbudgeted trees); none
    for routing-only imports (no trees)."""
    if "trees" not in views(con):
        return pl.DataFrame(schema=dict(run=pl.String, prompts=pl.Int64, trees=pl.Int64,
                                        tau=pl.Float64, unique_experts=pl.Float64))
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
    """Open-loop mean RSE per run × ranking × coverage × fixed budget, with each curve's
    variant's calibration (the default views: one variant per curve); adaptive budgets, whose
    B̄ is no B, are left out (never averaged with a fixed B)."""
    if OPEN_TABLE not in views(con):
        return pl.DataFrame()
    fixed = f"{replay_views.budget_mode(con, OPEN_TABLE)} = '{replay_views.FIXED}'"
    return con.sql(f"""
        SELECT run, ranking, coverage, budget, avg(rse) AS rse, count(*) AS tree_layers,
               string_agg(DISTINCT coalesce(calibration, 'none'), ', ') AS calibration
        FROM {OPEN_TABLE} WHERE {fixed} GROUP BY ALL ORDER BY ALL""").pl()


def run_colors(runs: list[str]) -> dict[str, str]:
    """One colour per run, by its place among the runs compared: the same in every figure."""
    return {run: figures.COLORS[i % len(figures.COLORS)] for i, run in enumerate(runs)}


def lines(frame: pl.DataFrame, x: str, y: str, title: str, x_title: str, y_title: str,
          log_y: bool = False, runs: list[str] | None = None,
          why: str | dict[str, str] = "no rows") -> go.Figure:
    """One line per run on shared axes, each run in its colour (:func:`run_colors` of
    ``runs``, default: the frame's runs); a run of ``runs`` without a line is named on the
    figure, with ``why`` (one reason, or run -> reason)."""
    present = frame["run"].unique(maintain_order=True).to_list()
    runs = list(runs or present)
    colors = run_colors(runs + [r for r in present if r not in runs])
    fig = go.Figure()
    for run in [r for r in runs if r in present] + [r for r in present if r not in runs]:
        mine = frame.filter(pl.col("run") == run)
        fig.add_scatter(x=mine[x], y=mine[y], mode="lines+markers", name=f"run {run}",
                        line=dict(color=colors[run]),
                        showlegend=True)  # (named even when only one run has this figure)
    fig.update_xaxes(title=x_title)
    if frame[x].dtype.is_integer():
        figures.integer_axis(fig, frame[x])  # integer axes: no fractional ticks
    fig.update_yaxes(title=y_title, type="log" if log_y else None)
    fig = figures._style(fig, title)
    left = [r for r in runs if r not in present]
    if left:
        reasons = why if isinstance(why, dict) else {}
        fig = figures._note(fig, "Left out: " + "; ".join(
            f"run {r} ({reasons.get(r, why if isinstance(why, str) else 'no rows')})"
            for r in left) + ".")
    return fig


def compare_figures(con, ranking: str = "router", cover: str = "truncation",
                    runs: list[str] | None = None) -> list:
    """The figures a comparison draws: coverage curves, and error vs budget of ``ranking``
    under ``cover``, one line per run, each run in one colour throughout (``runs``: the runs
    compared, in order); every run a figure leaves out is named on it."""
    figs = []
    curve = coverage(con)
    imported = {r for (r,) in con.execute("SELECT run FROM runs WHERE kind = 'routing-only'")
                .fetchall()} if "runs" in views(con) else set()
    curve = curve.filter(~pl.col("run").is_in(list(imported))) if curve.height else curve
    if curve.height:
        per_run = curve.group_by(["run", "budget"], maintain_order=True).agg(
            pl.col("coverage").mean()).sort(["run", "budget"])
        figs.append(lines(per_run, "budget", "coverage", "Coverage: router mass held by the "
                          "top-B experts of a tree, per run", "budget B (experts)",
                          "share of router mass", runs=runs,
                          why={**{r: "no routing summary" for r in runs or []},
                               **{r: "routing-only import: no router mass; the ids-only figures "
                                     "set it beside the captures" for r in imported}}))
    err = errors(con)
    mine = err.filter((pl.col("ranking") == ranking) & (pl.col("coverage") == cover)) \
        if err.height else err
    if mine.height:
        figs.append(lines(mine.with_columns(pl.col("rse").clip(figures.NOISE_FLOOR)),
                          "budget", "rse", f"Open-loop error of {ranking} ({cover}) vs "
                          "budget, per run", "budget B (experts)",
                          "mean RSE (log)", log_y=True, runs=runs,
                          why=f"no open-loop replay of {ranking}, {cover}"))
    return figs


def left_out(con, runs: list[str], ranking: str, cover: str) -> list[str]:
    """The runs of ``runs`` the error figure has no line for (no open-loop replay of
    ``ranking`` under ``cover``), in words for the page and the report."""
    err = errors(con)
    have = set(err.filter((pl.col("ranking") == ranking) & (pl.col("coverage") == cover))["run"]) \
        if err.height else set()
    return [r for r in runs if r not in have]


IDS_NOTE = ("Ids only: every run's top-k expert ids, tokens grouped into the same batch passes "
            "(the import's), so a capture and the import exported from it give identical "
            "lines (analysis.ids). Router mass, trees and replay do not apply to an import.")


def ids_figures(runs: list[Run]) -> list[go.Figure]:
    """Where the runs compared include a routing-only import: every run's ids-only figures side
    by side (:mod:`analysis.ids`, a capture's decode tokens grouped into the import's batch
    passes): the share of token-expert assignments outside each pass's own top-B, and outside
    the run's top-B, vs B (means over MoE layers), one line per run. Empty without an import."""
    from moe_spec.analysis import ids
    from moe_spec.catalog import tokens
    imports = [r for r in runs if r.routing_only]
    if not imports:
        return []
    kind, b = tokens.resolve_batching(imports[0])
    frames = []
    for r in runs:
        try:
            found = ids.figures(r, batching=kind, batch_size=b)
        except CatalogError:  # a capture without the import's recorded passes: its own
            found = ids.figures(r)
        frames.append(ids.truncation(found).group_by("budget").agg(
            pl.col("frequency_outside").mean(), pl.col("static_outside").mean())
            .with_columns(run=pl.lit(r.name)).sort("budget"))
    frame = pl.concat(frames)
    names = [r.name for r in runs]
    passes = "recorded forward passes" if kind == "recorded" else f"virtual batches of b = {b}"
    return [lines(frame, "budget", column, f"Ids only ({passes}): assignments outside {what}, "
                  "per run", "budget B (experts)", "share of token-expert assignments",
                  runs=names)
            for column, what in (("frequency_outside", "each pass's own top-B"),
                                 ("static_outside", "the run's top-B"))]
