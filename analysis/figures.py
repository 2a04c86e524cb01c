"""plotly figure builders: each takes a computed polars frame and draws it, nothing more.

Every figure has a title, axis titles with units (and N where a count of experts is plotted),
legend names in words, and the same style; heatmaps are square with a titled colour bar; log
axes show plain numbers and cut values below the float-noise floor (RSE < 1e-9 is rounding
noise, drawn at the floor). ``tests/test_figures.py`` walks every figure the report and the app
build and fails on a missing axis title.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl

NOISE_FLOOR = 1e-9  # RSE below this is float rounding, not an error
HEIGHT = 420
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]
NAMES = {"experts_50": "50% of mass", "experts_90": "90% of mass", "experts_99": "99% of mass",
         "truncation": "truncation", "substitution": "substitution"}


def _style(fig: go.Figure, title: str, height: int = HEIGHT) -> go.Figure:
    """Title, white template, a horizontal legend above the plot (and above subplot titles)."""
    subplot_titles = any(a.yref == "paper" and a.y >= 1 for a in fig.layout.annotations)
    fig.update_layout(title=title, template="plotly_white", height=height,
                      legend=dict(title_text="", orientation="h", yanchor="bottom",
                                  y=1.10 if subplot_titles else 1.02, xanchor="right", x=1),
                      margin=dict(l=70, r=30, t=110 if subplot_titles else 90, b=60))
    return fig


def _band(fig, x, mean, lo, hi, name, color, showlegend=True, **kw):
    """A line with a shaded 95% interval (the band never gets its own legend entry)."""
    x, mean, lo, hi = (np.asarray(v, dtype=float) for v in (x, mean, lo, hi))
    fig.add_scatter(x=np.r_[x, x[::-1]], y=np.r_[hi, lo[::-1]], fill="toself",
                    fillcolor=color, opacity=0.15, line=dict(width=0), hoverinfo="skip",
                    showlegend=False, **kw)
    fig.add_scatter(x=x, y=mean, mode="lines+markers", name=name, line=dict(color=color),
                    showlegend=showlegend, **kw)


def heavy_tails(summary: pl.DataFrame, n: int | None = None) -> go.Figure:
    fig = go.Figure()
    for i, col in enumerate(("experts_50", "experts_90", "experts_99")):
        for bench, g in summary.group_by("bench", maintain_order=True):
            fig.add_bar(x=g["layer"], y=g[col], name=f"{NAMES[col]} ({bench[0]})",
                        marker_color=COLORS[i])
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="MoE layer", dtick=1)
    fig.update_yaxes(title=f"experts needed (of {n})" if n else "experts needed")
    return _style(fig, "Heavy tails: experts holding 50 / 90 / 99% of a tree's router mass")


def coverage(curve: pl.DataFrame, budget: int | None = None) -> go.Figure:
    fig = go.Figure()
    n = int(curve["budget"].max())
    for i, (bench, g) in enumerate(curve.sort("budget").group_by("bench", maintain_order=True)):
        fig.add_scatter(x=g["budget"], y=g["coverage"], mode="lines+markers", name=bench[0],
                        line=dict(color=COLORS[i % len(COLORS)]))
    fig.add_scatter(x=[0, n], y=[0, 1], mode="lines", line=dict(dash="dot", color="gray"),
                    name="uniform routing (B/N)")
    if budget is not None:
        fig.add_vline(x=budget, line_dash="dash", line_color="black",
                      annotation_text=f"B = {budget}", annotation_position="top left")
    fig.update_xaxes(title=f"budget B (experts of {n})", range=[0, n + 0.5])
    fig.update_yaxes(title="router mass covered", range=[0, 1.01], tickformat=".0%")
    return _style(fig, "Router mass covered by the top-B experts of a tree")


def growth(frame: pl.DataFrame, n: int | None = None) -> go.Figure:
    fig = go.Figure()
    for i, (bench, g) in enumerate(frame.group_by(["bench"], maintain_order=True)):
        color = COLORS[i % len(COLORS)]
        fig.add_scatter(x=g["tokens"], y=g["unique_experts"], mode="lines+markers",
                        name=f"{bench[0]}: measured", line=dict(color=color))
        fig.add_scatter(x=g["tokens"], y=g["marginal"], mode="lines",
                        line=dict(dash="dot", color=color),
                        name=f"{bench[0]}: i.i.d. with each layer's marginals")
    first = frame.filter(pl.col("bench") == frame["bench"][0])
    fig.add_scatter(x=first["tokens"], y=first["uniform"], mode="lines",
                    line=dict(dash="dash", color="black"), name="MoESD uniform N(t)")
    fig.update_xaxes(title="tree tokens t (breadth-first)")
    fig.update_yaxes(title=f"unique experts per layer (of {n})" if n else
                     "unique experts per layer")
    return _style(fig, "Expert activation growth vs tree size (mean over layers and trees)")


def coactivation(matrix: np.ndarray, order: np.ndarray | None, title: str,
                 colorbar: str = "tokens with both experts") -> go.Figure:
    m = matrix if order is None else matrix[np.ix_(order, order)]
    labels = [str(i) for i in (order if order is not None else range(len(m)))]
    fig = go.Figure(go.Heatmap(z=m, x=labels, y=labels, colorscale="Viridis",
                               colorbar=dict(title=dict(text=colorbar, side="right"))))
    fig.update_yaxes(autorange="reversed", title="expert", scaleanchor="x", constrain="domain")
    fig.update_xaxes(title="expert", constrain="domain")
    fig = _style(fig, title, height=620)
    fig.update_layout(width=700)
    return fig


def error_vs_budget(curves: pl.DataFrame, n: int | None = None) -> go.Figure:
    """RSE vs budget per ranking, one panel per coverage, 95% interval bands over
    tree-layers; values under the noise floor are drawn at it."""
    from plotly.subplots import make_subplots
    covs = sorted(set(curves["coverage"]))
    fig = make_subplots(rows=1, cols=len(covs), shared_yaxes=True,
                        subplot_titles=[NAMES.get(c, c) for c in covs])
    rankings = sorted(set(curves["ranking"]))
    for col, cov in enumerate(covs, start=1):
        for i, ranking in enumerate(rankings):
            g = curves.filter((pl.col("coverage") == cov) & (pl.col("ranking") == ranking)) \
                .sort("budget")
            if g.height == 0:
                continue
            clip = lambda c: np.maximum(g[c].to_numpy(), NOISE_FLOOR)  # noqa: E731
            lo = clip("rse_lo") if "rse_lo" in g.columns else clip("rse")
            hi = clip("rse_hi") if "rse_hi" in g.columns else clip("rse")
            _band(fig, g["budget"], clip("rse"), lo, hi, ranking, COLORS[i % len(COLORS)],
                  row=1, col=col, legendgroup=ranking, showlegend=col == 1)
    fig.update_yaxes(type="log", exponentformat="power", title_text="RSE (log; floor 1e-9)",
                     col=1)
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(title_text=f"budget B (experts of {n})" if n else "budget B")
    fig.add_hline(y=NOISE_FLOOR, line_dash="dot", line_color="gray")
    return _style(fig, "Reconstruction error (RSE) vs expert budget, mean and 95% interval")


def oracle_gap(gap: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    for i, (cov, g) in enumerate(gap.sort("reference_budget").group_by(
            ["coverage"], maintain_order=True)):
        share = g["saved_share"].to_numpy()
        text = ["beyond the sweep" if not np.isfinite(v) else f"{v:.0%}" for v in share]
        fig.add_bar(x=g["reference_budget"], y=np.nan_to_num(share, nan=0.0), name=cov[0],
                    text=text, textposition="outside", marker_color=COLORS[i])
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="router's budget B")
    fig.update_yaxes(tickformat=".0%", title="experts the oracle saves at the router's error")
    return _style(fig, "Oracle gap at matched error (\"beyond the sweep\": the oracle never "
                       "reaches that error within the budgets replayed)")


def closed_loop(frame: pl.DataFrame, n: int | None = None) -> go.Figure:
    from plotly.subplots import make_subplots
    covs = sorted(set(frame["coverage"]))
    fig = make_subplots(rows=1, cols=len(covs), shared_yaxes=True,
                        subplot_titles=[NAMES.get(c, c) for c in covs])
    for col, cov in enumerate(covs, start=1):
        sub = frame.filter(pl.col("coverage") == cov)
        for i, (ranking, g) in enumerate(sub.sort("budget").group_by(
                ["ranking"], maintain_order=True)):
            lo = g["tau_lo"] if "tau_lo" in g.columns else g["tau"]
            hi = g["tau_hi"] if "tau_hi" in g.columns else g["tau"]
            _band(fig, g["budget"], g["tau"], lo, hi, ranking[0], COLORS[i % len(COLORS)],
                  row=1, col=col, legendgroup=ranking[0], showlegend=col == 1)
        captured = float(sub["tau_captured"].mean())
        fig.add_hline(y=captured, line_dash="dash", line_color="black", row=1, col=col,
                      annotation_text=f"captured τ {captured:.2f}")
    fig.update_xaxes(title_text=f"budget B (experts of {n})" if n else "budget B")
    fig.update_yaxes(title_text="accepted length τ under the budget (tokens per pass)", col=1)
    return _style(fig, "Closed-loop acceptance vs budget, mean and 95% interval over trees")


def load_balance(frame: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    for i, (bench, g) in enumerate(frame.group_by("bench", maintain_order=True)):
        fig.add_bar(x=g["layer"], y=g["cv"], name=bench[0], marker_color=COLORS[i],
                    customdata=np.c_[g["entropy_ratio"], g["dead_experts"]],
                    hovertemplate="layer %{x}: CV %{y:.2f}, entropy/log N %{customdata[0]:.2f},"
                                  " dead %{customdata[1]}<extra></extra>")
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="MoE layer", dtick=1)
    fig.update_yaxes(title="coefficient of variation of selections")
    return _style(fig, "Expert load imbalance (CV of top-k selection counts)")


def speedup(frame: pl.DataFrame, title: str = "Projected speedup vs budget") -> go.Figure:
    fig = go.Figure()
    for i, (hw, g) in enumerate(frame.sort("budget").group_by(["hardware"],
                                                              maintain_order=True)):
        fig.add_scatter(x=g["budget"], y=g["speedup"], mode="lines+markers", name=hw[0],
                        line=dict(color=COLORS[i % len(COLORS)]))
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray", annotation_text="1× (no gain)")
    n = frame["num_experts"][0] if "num_experts" in frame.columns else None
    fig.update_xaxes(title=f"budget B (experts of {n})" if n else "budget B")
    fig.update_yaxes(title="projected speedup over autoregressive decoding (×)")
    return _style(fig, title)


def efficiency(frame: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    for i, (batch, g) in enumerate(frame.sort("gamma").group_by(["batch"], maintain_order=True)):
        fig.add_scatter(x=g["gamma"], y=g["eta"], mode="lines+markers", name=f"batch {batch[0]}",
                        line=dict(color=COLORS[i % len(COLORS)]),
                        text=g["regime"] if "regime" in g.columns else None)
    fig.update_xaxes(title="tokens per sequence γ (log)", type="log")
    fig.update_yaxes(title="η(b, γ) = T(b,1) / T(b,γ)")
    return _style(fig, "MoESD target efficiency")


def calibration(frame: pl.DataFrame, title: str) -> go.Figure:
    fig = go.Figure(go.Scatter(x=frame["predicted"] * 1e3, y=frame["measured"] * 1e3,
                               mode="markers", name="verification passes",
                               marker=dict(color=frame["experts_loaded"], colorscale="Viridis",
                                           colorbar=dict(title="experts loaded"))))
    lim = [0, float(max(frame["predicted"].max(), frame["measured"].max())) * 1.05e3]
    fig.add_scatter(x=lim, y=lim, mode="lines", line=dict(dash="dash", color="black"),
                    name="measured = predicted")
    fig.update_xaxes(title="calibrated roofline prediction (ms)")
    fig.update_yaxes(title="measured verify time (ms)")
    fig = _style(fig, title)
    fig.update_layout(legend=dict(x=0, y=1.02, xanchor="left"))  # clear of the colour bar
    return fig


def frontier(frame: pl.DataFrame, y: str = "quality") -> go.Figure:
    """Speedup over plain EAGLE vs task quality (or output agreement), one point per budget."""
    labels = {"quality": f"task quality ({frame['metric'][0]})",
              "agreement": "outputs identical to unbudgeted EAGLE"}
    fig = go.Figure()
    for i, (ranking,), in enumerate([(r,) for r in sorted(set(frame["ranking"]))]):
        g = frame.filter(pl.col("ranking") == ranking).sort("budget")
        fig.add_scatter(x=g["speedup_vs_eagle"], y=g[y], mode="lines+markers+text",
                        text=[f"B={b}" for b in g["budget"]], textposition="top center",
                        name=str(ranking), line=dict(color=COLORS[i % len(COLORS)]))
    fig.add_vline(x=1.0, line_dash="dash", line_color="gray",
                  annotation_text="plain EAGLE", annotation_position="bottom right")
    fig.update_xaxes(title=f"projected speedup over plain EAGLE on {frame['hardware'][0]} (×)")
    fig.update_yaxes(title=labels[y])
    return _style(fig, "Speedup–quality frontier (MoE-Spec online mode vs its unbudgeted twin)")
