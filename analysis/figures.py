"""plotly figure builders: each takes a computed polars frame and draws it, nothing more."""

from __future__ import annotations

import numpy as np
import plotly.express as px
import plotly.graph_objects as go
import polars as pl


def _style(fig: go.Figure, title: str) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", legend_title_text="",
                      margin=dict(l=60, r=20, t=60, b=50))
    return fig


def heavy_tails(summary: pl.DataFrame) -> go.Figure:
    long = summary.unpivot(index=["bench", "layer"], on=["experts_50", "experts_90", "experts_99"],
                           variable_name="mass", value_name="experts")
    fig = px.bar(long.to_pandas(), x="layer", y="experts", color="mass", barmode="group",
                 facet_col="bench")
    return _style(fig, "Experts holding 50 / 90 / 99% of a tree's router mass")


def coverage(curve: pl.DataFrame) -> go.Figure:
    fig = px.line(curve.to_pandas(), x="budget", y="coverage", color="bench", markers=True)
    fig.update_yaxes(range=[0, 1.01], tickformat=".0%")
    return _style(fig, "Router mass covered by the top-B experts of a tree")


def growth(frame: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    for (bench,), g in frame.group_by(["bench"], maintain_order=True):
        fig.add_scatter(x=g["tokens"], y=g["unique_experts"], mode="lines+markers",
                        name=f"{bench}: measured")
        fig.add_scatter(x=g["tokens"], y=g["marginal"], mode="lines", line=dict(dash="dot"),
                        name=f"{bench}: i.i.d. with measured marginals")
    first = frame.filter(pl.col("bench") == frame["bench"][0])
    fig.add_scatter(x=first["tokens"], y=first["uniform"], mode="lines",
                    line=dict(dash="dash", color="black"), name="MoESD uniform N(t)")
    fig.update_xaxes(title="tree tokens (breadth-first)")
    fig.update_yaxes(title="unique experts per layer")
    return _style(fig, "Expert activation growth vs tree size")


def coactivation(matrix: np.ndarray, order: np.ndarray | None, title: str) -> go.Figure:
    m = matrix if order is None else matrix[np.ix_(order, order)]
    labels = [str(i) for i in (order if order is not None else range(len(m)))]
    fig = go.Figure(go.Heatmap(z=m, x=labels, y=labels, colorscale="Viridis"))
    fig.update_yaxes(autorange="reversed")
    return _style(fig, title)


def error_vs_budget(curves: pl.DataFrame) -> go.Figure:
    fig = px.line(curves.to_pandas(), x="budget", y="rse", color="ranking", facet_col="coverage",
                  markers=True, log_y=True)
    return _style(fig, "Reconstruction error (RSE) vs expert budget")


def oracle_gap(gap: pl.DataFrame) -> go.Figure:
    fig = px.bar(gap.to_pandas(), x="reference_budget", y="saved_share", color="coverage",
                 barmode="group")
    fig.update_yaxes(tickformat=".0%", title="experts the oracle saves at the router's error")
    return _style(fig, "Oracle gap at matched error")


def closed_loop(frame: pl.DataFrame) -> go.Figure:
    fig = px.line(frame.to_pandas(), x="budget", y="tau", color="ranking", facet_col="coverage",
                  markers=True)
    fig.update_yaxes(title="accepted length under budget")
    return _style(fig, "Closed-loop acceptance vs budget")


def load_balance(frame: pl.DataFrame) -> go.Figure:
    fig = px.bar(frame.to_pandas(), x="layer", y="cv", color="bench", barmode="group",
                 hover_data=["entropy_ratio", "dead_experts"])
    return _style(fig, "Expert load imbalance (CV of selection counts)")


def speedup(frame: pl.DataFrame) -> go.Figure:
    fig = px.line(frame.to_pandas(), x="budget", y="speedup", color="hardware", markers=True)
    fig.update_yaxes(title="projected speedup over AR")
    return _style(fig, "Projected speedup vs budget")


def efficiency(frame: pl.DataFrame) -> go.Figure:
    fig = px.line(frame.to_pandas(), x="gamma", y="eta", color=frame["batch"].cast(str).to_list(),
                  markers=True, log_x=True, hover_data=["regime"] if "regime" in frame.columns
                  else None)
    fig.update_xaxes(title="tokens per sequence γ")
    fig.update_yaxes(title="η(b, γ) = T(b,1) / T(b,γ)")
    return _style(fig, "MoESD target efficiency")


def calibration(frame: pl.DataFrame, title: str) -> go.Figure:
    fig = px.scatter(frame.to_pandas(), x="predicted", y="measured", color="experts_loaded")
    lim = [0, float(max(frame["predicted"].max(), frame["measured"].max())) * 1.05]
    fig.add_scatter(x=lim, y=lim, mode="lines", line=dict(dash="dash", color="black"),
                    name="measured = predicted")
    fig.update_xaxes(title="calibrated roofline prediction (s)")
    fig.update_yaxes(title="measured verify time (s)")
    return _style(fig, title)
