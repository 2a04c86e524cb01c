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

from moe_spec.policy import index  # torch-free: the budget modes

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


def batch_regime(frame: pl.DataFrame, n: int | None = None) -> go.Figure:
    """Unique experts per layer per verification pass vs the batch size b (the union over b
    trees), measured, beside MoESD's uniform ``N(t) = N·[1 − ((N−k)/N)^t]`` at the same tokens
    per pass t = b·M. ``N(t)`` reaches 99% of N at ``t₉₉ = ln 0.01 / ln((N−k)/N)`` tokens (35 for
    N = 64, k = 8); when every pass verifies at least that many, the uniform line lies on N at
    every b, and the legend and a note under the plot say so (a saturated expectation, not a
    clipped one)."""
    fig = go.Figure()
    notes = []
    for i, (bench, g) in enumerate(frame.group_by(["bench"], maintain_order=True)):
        color = COLORS[i % len(COLORS)]
        fig.add_scatter(x=g["batch_size"], y=g["unique_experts"], mode="lines+markers",
                        name=f"{bench[0]}: measured (union over the pass)",
                        line=dict(color=color), customdata=np.c_[g["tokens"], g["passes"]],
                        hovertemplate="b=%{x}: %{y:.1f} experts<br>%{customdata[0]:.0f} tokens "
                                      "a pass, %{customdata[1]} passes<extra></extra>")
        big_n = int(g["n"][0]) if "n" in g.columns else n
        k = int(g["k"][0]) if "k" in g.columns else None
        saturated = bool(big_n) and float(g["uniform"].min()) >= 0.99 * big_n
        fig.add_scatter(x=g["batch_size"], y=g["uniform"], mode="lines",
                        line=dict(dash="dash", color=color), customdata=g["tokens"],
                        name=f"{bench[0]}: MoESD uniform N(b·M)"
                             + (" (saturated: ≈ N at every b)" if saturated else ""),
                        hovertemplate="b=%{x}: uniform routing expects %{y:.2f} experts at "
                                      "b·M = %{customdata:.0f} tokens<extra></extra>")
        if saturated and k and 0 < k < big_n:
            t99 = np.log(0.01) / np.log((big_n - k) / big_n)
            notes.append((f"{bench[0]}: " if frame["bench"].n_unique() > 1 else "")
                         + f"uniform routing saturates: N(b·M) = N·[1 − ((N−k)/N)^(b·M)] is ≥ 99% "
                         f"of N = {big_n} from b·M ≈ {t99:.0f} tokens (k = {k}),<br>and every "
                         f"pass here verifies ≥ {float(g['tokens'].min()):.0f}, so MoESD's line "
                         "lies on N at every b (saturated, not clipped).<br>The measured union "
                         "stays below it: real routing is skewed.")
    if n:
        fig.add_hline(y=n, line=dict(dash="dot", color="grey"), annotation_text=f"N = {n}")
    _batch_axis(fig, frame["batch_size"])
    fig.update_yaxes(title=f"unique experts per layer per pass (of {n})" if n else
                     "unique experts per layer per pass")
    fig = _style(fig, "Experts a verification pass loads vs batch size (no budget)")
    return _note(fig, "<br>".join(notes)) if notes else fig


def _batch_axis(fig: go.Figure, sizes) -> None:
    """A log x axis ticked at the batch sizes measured (never fractional b)."""
    ticks = sorted({int(b) for b in sizes})
    fig.update_xaxes(title="batch size b (sequences verified in one pass)", type="log",
                     tickvals=ticks, ticktext=[str(b) for b in ticks])


def batch_errors(frame: pl.DataFrame, n: int | None = None) -> go.Figure:
    """RSE vs budget with one shortlist per pass of b trees (``replay --batch-size b``), one
    colour per ranking, one dash per b (b = 1: each tree its own shortlist, solid), so the
    rankings at one b stay apart and each ranking's lines at every b share its colour."""
    fig = go.Figure()
    dashes = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
    frame = frame.filter(pl.col("rse") > 1e-9)  # zero error (S holds every selected expert,
    # up to float rounding): off the log axis
    sizes = sorted(set(frame["batch_size"].to_list()))
    rankings_ = list(dict.fromkeys(frame["ranking"].to_list()))
    for j, ranking in enumerate(rankings_):
        for i, b in enumerate(sizes):
            g = frame.filter((pl.col("batch_size") == b) & (pl.col("ranking") == ranking)) \
                .sort("budget")
            if not g.height:
                continue
            fig.add_scatter(x=g["budget"], y=g["rse"], mode="lines+markers",
                            name=f"{ranking}, b = {b}", legendgroup=ranking,
                            line=dict(color=COLORS[j % len(COLORS)],
                                      dash=dashes[i % len(dashes)]),
                            hovertemplate=f"{ranking}, b={b}: B=%{{x}}, RSE %{{y:.4f}}"
                                          "<extra></extra>")
    fig.update_xaxes(title=f"expert budget B per layer per pass (of {n})" if n else
                     "expert budget B per layer per pass")
    fig.update_yaxes(title="mean RSE over (pass, layer); below 1e-9 not drawn", type="log",
                     exponentformat="power")
    fig = _style(fig, "Error of a budget shared by a batch's trees vs B (colour: ranking, "
                      "dash: b)", HEIGHT + 60)
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0),
                      margin=dict(t=60, b=150))
    return fig


def batch_speedup(speed: pl.DataFrame, fit: dict | None = None,
                  projection: pl.DataFrame | None = None, projection_name: str = "") -> go.Figure:
    """Measured speedup of EAGLE over autoregressive decoding vs b (``profile-batch``, equal work:
    :mod:`analysis.timing`), without and with each budget, each point with its 95% interval as
    an error bar (the interval's rule under the title: paired or not); beside it MoESD's fitted
    verification-only speedup and the roofline's projection for a real shape (dashed, same
    colour per budget)."""
    fig = go.Figure()
    budgets = list(dict.fromkeys(speed["budget"].to_list()))
    for i, budget in enumerate(budgets):
        g = speed.filter(pl.col("budget").is_null() if budget is None
                         else pl.col("budget") == budget)
        color = COLORS[i % len(COLORS)]
        label = "no budget" if budget is None else f"B = {budget}"
        low = g["speedup_low"] if "speedup_low" in g.columns else g["speedup"] * np.nan
        high = g["speedup_high"] if "speedup_high" in g.columns else g["speedup"] * np.nan
        fig.add_scatter(x=g["batch_size"], y=g["speedup"], mode="lines+markers",
                        name=f"measured, {label} (95% CI bars)", line=dict(color=color),
                        error_y=dict(type="data", symmetric=False,
                                     array=(high - g["speedup"]).fill_nan(None).to_list(),
                                     arrayminus=(g["speedup"] - low).fill_nan(None).to_list()),
                        customdata=np.c_[g["eagle_tokens_per_s"], g["ar_tokens_per_s"], g["tau"],
                                         low.to_numpy(), high.to_numpy()],
                        hovertemplate="b=%{x}: %{y:.2f}× (95% CI %{customdata[3]:.2f}–"
                                      "%{customdata[4]:.2f}×)<br>EAGLE %{customdata[0]:.1f} "
                                      "tok/s, AR %{customdata[1]:.1f} tok/s, τ %{customdata[2]:.2f}"
                                      "<extra></extra>")
        if projection is not None and projection.height:
            p = projection.filter(pl.col("budget").is_null() if budget is None
                                  else pl.col("budget") == budget)
            fig.add_scatter(x=p["batch_size"], y=p["projected"], mode="lines",
                            line=dict(color=color, dash="dash"),
                            name=f"roofline {projection_name}, {label}")
    if fit is not None:
        f = fit["predicted"]
        fig.add_scatter(x=f["batch_size"], y=f["predicted"], mode="lines",
                        line=dict(color="grey", dash="dot"),
                        name=f"MoESD fit (verify only), rel. RMSE {fit['coef']['relative_rmse']:.0%}")
    fig.add_hline(y=1, line=dict(color="#999", width=1))
    _batch_axis(fig, speed["batch_size"])
    fig.update_yaxes(title="speedup over AR decoding (×, s/token)")
    equal = "equal_work" in speed.columns and bool(speed["equal_work"].all())
    from moe_spec.analysis import timing
    paired = "paired" in speed.columns and bool(speed["paired"].all())
    # a short title, what the work was and the interval's rule on a line under it, clear of
    # the chart's toolbar at a normal window's width
    fig = _style(fig, "Speculative decoding's speedup vs batch size (measured on " + (
        "equal work)<br><sup>every way decodes the same tokens, EOS ignored" if equal else
        "UNEQUAL work)<br><sup>the decodings produced different numbers of tokens") + "; " + (
        timing.INTERVAL_SHORT if paired else "unpaired repeats (stored before interleaving): "
        "ratio of medians, Bonferroni order-statistic 95% CI") + "</sup>", HEIGHT + 100)
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0),
                      margin=dict(t=100, b=170))  # many entries: below the plot, not on the title
    return fig


LIFT_TITLE = "lift: observed / expected if independent (log scale)"
NEVER_SEEN = "#c4c4c4"  # a pair never selected together: no colour of the scale
SELF_PAIR = "#5a5a5a"  # the masked diagonal (an expert with itself)


def coactivation(matrix: np.ndarray, order: np.ndarray | None, title: str,
                 colorbar: str = "tokens with both experts",
                 lift: np.ndarray | None = None) -> go.Figure:
    """Expert × expert heatmap with the diagonal masked (selection counts, or 0 under the
    adjacent convention, are not pairs and would take the colour scale). With ``lift`` the
    colour is observed / expected under independent selection on a log₂ scale centred at 1
    (diverging: red above independence, blue below); else the observed ``matrix``. A pair never
    selected together (observed = 0, so lift = 0 or undefined) is no point of the scale: it is
    drawn in its own grey (a scale-less trace, ``NEVER_SEEN``) and the diagonal in a dark grey
    (another, ``SELF_PAIR``), each named in the legend. Experts never selected with any other
    (an all-zero row: not routed to in this layer's sample) are left out and named under the
    plot, never drawn as a grey band. Tick labels are at least 10 px: every id where the cells
    (at least 7 px an expert) are that large, else every k-th id (the hover names every cell).
    The hover gives observed and lift."""
    idx = np.arange(len(matrix)) if order is None else np.asarray(order)
    full = np.array(matrix, dtype=float)
    quiet = {i for i in range(len(full))
             if not (np.nan_to_num(np.delete(full[i], i)) > 0).any()}
    absent = sorted(int(i) for i in idx if int(i) in quiet)
    idx = np.array([i for i in idx if int(i) not in quiet] or list(idx))
    pick = lambda a: np.array(a, dtype=float)[np.ix_(idx, idx)]  # noqa: E731
    observed = pick(matrix)
    labels = [str(i) for i in idx]
    off = ~np.eye(len(idx), dtype=bool)
    never = off & ~(observed > 0)  # NaN counts as never seen too
    if lift is not None:
        ratio = pick(lift)
        finite = ratio[off & ~never & np.isfinite(ratio) & (ratio > 0)]
        span = int(np.clip(np.ceil(np.abs(np.log2(finite)).max()), 1, 5)) if finite.size else 1
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.log2(np.clip(ratio, 2.0 ** -span, 2.0 ** span))
        z[~off | never] = np.nan
        ticks = np.arange(-span, span + 1)
        text = [f"1/{2 ** -t:g}" if t < 0 else f"{2 ** t:g}" for t in ticks]
        heat = go.Heatmap(z=z, x=labels, y=labels, colorscale="RdBu_r", zmid=0, zmin=-span,
                          hoverongaps=False,
                          zmax=span, customdata=np.dstack([observed, ratio]),
                          hovertemplate="experts %{y} & %{x}: observed %{customdata[0]:.3g}, "
                                        "lift %{customdata[1]:.2f}<extra></extra>",
                          colorbar=dict(title=dict(text=LIFT_TITLE, side="right"),
                                        tickvals=ticks, ticktext=text))
    else:
        z = observed.copy()
        z[~off | never] = np.nan
        heat = go.Heatmap(z=z, x=labels, y=labels, colorscale="Viridis", hoverongaps=False,
                          hovertemplate="experts %{y} & %{x}: %{z:.3g}<extra></extra>",
                          colorbar=dict(title=dict(text=f"{colorbar} (diagonal masked)",
                                                   side="right")))
    fig = go.Figure(heat)
    for mask, color, name, hover in (
            (never, NEVER_SEEN, "never seen together", "experts %{y} & %{x}: never seen together"),
            (~off, SELF_PAIR, "diagonal", "expert %{y} with itself (masked)")):
        fig.add_heatmap(z=np.where(mask, 1.0, np.nan), x=labels, y=labels, showscale=False,
                        colorscale=[[0, color], [1, color]], zmin=0, zmax=1, name=name,
                        hoverongaps=False, hovertemplate=hover + "<extra></extra>")
    for name, color in (("never seen together", NEVER_SEEN),
                        ("diagonal: an expert with itself", SELF_PAIR)):
        fig.add_scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                        marker=dict(symbol="square", size=12, color=color))
    cell = max(560 / max(len(idx), 1), 7.0)  # px per expert
    side = int(round(cell * len(idx)))
    font = 11 if cell >= 11 else 10
    step = max(1, int(np.ceil(font * 1.2 / cell)))  # every k-th id where the cells are small
    shown = labels[::step]
    ticks = dict(tickmode="array", tickvals=shown, ticktext=shown, tickfont=dict(size=font),
                 showgrid=False, zeroline=False)  # no grid lines across the masked cells
    fig.update_yaxes(autorange="reversed", title="expert", scaleanchor="x", constrain="domain",
                     **ticks)
    fig.update_xaxes(title="expert", constrain="domain", tickangle=-90 if cell < 14 else 0,
                     **ticks)
    fig = _style(fig, title, height=side + 200)
    fig.update_layout(width=side + 250, plot_bgcolor="white")
    notes = []
    if step > 1:
        every = "every other" if step == 2 else f"every {step}th"
        notes.append(f"{every} expert id labelled (the hover names each cell)")
    if absent:
        rows = [", ".join(map(str, absent[i:i + 16])) for i in range(0, min(len(absent), 48), 16)]
        notes.append(f"{len(absent)} of {len(full)} experts never selected with another here, "
                     "left out:<br>" + ",<br>".join(rows) + (" …" if len(absent) > 48 else ""))
    if notes:
        fig = _note(fig, ";<br>".join(notes) + ".")
    return fig


def integer_axis(fig: go.Figure, values, **kw) -> None:
    """An axis of integers (budgets, batch sizes) ticked at integers only: at the values drawn
    where there are few, else integer-formatted ticks; never 23.5."""
    values = sorted({int(v) for v in values if v is not None})
    if 0 < len(values) <= 12:
        fig.update_xaxes(tickmode="array", tickvals=values, ticktext=[str(v) for v in values],
                         **kw)
    else:
        fig.update_xaxes(tickformat="d", **kw)


def first(listed: set[str], name: str) -> bool:
    """Whether ``name``'s legend entry is still to be drawn (then noted in ``listed``): a curve
    is listed in the first panel that draws it, not only if the first panel does (adaptive
    budgets are often replayed under one coverage only)."""
    new = name not in listed
    listed.add(name)
    return new


def error_vs_budget(curves: pl.DataFrame, n: int | None = None) -> go.Figure:
    """RSE vs budget per ranking, one panel per coverage, 95% interval bands over
    tree-layers; values under the noise floor are drawn at it."""
    from plotly.subplots import make_subplots
    covs = sorted(set(curves["coverage"]))
    fig = make_subplots(rows=1, cols=len(covs), shared_yaxes=True,
                        subplot_titles=[NAMES.get(c, c) for c in covs])
    rankings = sorted(set(curves["ranking"]))
    listed: set[str] = set()  # a curve's legend entry where it is first drawn
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
                  row=1, col=col, legendgroup=ranking, showlegend=first(listed, ranking))
    fig.update_yaxes(type="log", exponentformat="power", title_text="RSE (log; floor 1e-9)",
                     col=1)
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(title_text=f"budget B (experts of {n})" if n else "budget B")
    integer_axis(fig, curves["budget"])
    if (curves["rse"] <= 10 * NOISE_FLOOR).any():  # the floor only where a value is near it
        fig.add_hline(y=NOISE_FLOOR, line_dash="dot", line_color="gray")
    return _style(fig, "Reconstruction error (RSE) vs expert budget, mean and 95% interval")


FIXED_MODE = index.FIXED  # the budget mode of one B at every layer (the others: adaptive)
MODE_DASHES = ["dash", "dot", "dashdot", "longdash", "longdashdot"]  # adaptive modes; fixed: solid
EXPERTS_AXIS = "mean experts loaded per layer"


def _letter(mode: str) -> str:
    """B for a fixed budget, B̄ for an adaptive mode's mean budget asked."""
    return "B" if mode == FIXED_MODE else "B̄"


def _prices(g: pl.DataFrame) -> list[str]:
    """Each point's price λ as hover text (", λ 0.0321"), empty for a fixed budget or a frame
    without prices (an adaptive point's λ: ``replay_views.price``)."""
    if "price" not in g.columns:
        return [""] * g.height
    return ["" if p is None or p != p else f", λ {p:.4g}" for p in g["price"]]


def _mode_curves(frame: pl.DataFrame, coverage: str):
    """(key (ranking, mode), rows, name, color, dash) of each curve of a frame with
    ``budget_mode`` under ``coverage``: a colour per curve (the same in every panel), a solid
    line for the fixed budget and a dash per adaptive mode; a mode is never averaged with
    another."""
    modes = sorted(set(frame["budget_mode"]), key=lambda m: (m != FIXED_MODE, m))
    drawn = set(frame.select("ranking", "budget_mode").unique().iter_rows())  # in any panel
    pairs = [(ranking, mode) for ranking in sorted(set(frame["ranking"])) for mode in modes
             if (ranking, mode) in drawn]  # colours count drawn curves only: none repeats early
    for i, (ranking, mode) in enumerate(pairs):
        g = frame.filter((pl.col("ranking") == ranking) & (pl.col("budget_mode") == mode)
                         & (pl.col("coverage") == coverage))
        if g.height:
            dash = "solid" if mode == FIXED_MODE else MODE_DASHES[
                (modes.index(mode) - (FIXED_MODE in modes)) % len(MODE_DASHES)]
            yield ((ranking, mode), g.sort("experts_loaded"), f"{ranking} · {mode}",
                   COLORS[i % len(COLORS)], dash)


def error_vs_experts(curves: pl.DataFrame, n: int | None = None) -> go.Figure:
    """Mean RSE against the mean experts loaded per tree-layer (the bytes a budget costs), one
    curve per ranking × budget mode (fixed: solid; each adaptive mode dashed), one panel per
    coverage, 95% interval bands over tree-layers; the fixed-B oracle's curve, the bound of
    every fixed budget, drawn black. Rows: :func:`analysis.replay_views.error_vs_budget`."""
    from plotly.subplots import make_subplots
    covs = sorted(set(curves["coverage"]))
    fig = make_subplots(rows=1, cols=len(covs), shared_yaxes=True,
                        subplot_titles=[NAMES.get(c, c) for c in covs])
    listed: set[str] = set()
    for col, cov in enumerate(covs, start=1):
        for (ranking, mode), g, name, color, dash in _mode_curves(curves, cov):
            bound = ranking == "oracle" and mode == FIXED_MODE
            clip = lambda c: np.maximum(g[c].to_numpy(), NOISE_FLOOR)  # noqa: E731
            lo = clip("rse_lo") if "rse_lo" in g.columns else clip("rse")
            hi = clip("rse_hi") if "rse_hi" in g.columns else clip("rse")
            x, y = g["experts_loaded"].to_numpy(), clip("rse")
            fig.add_scatter(x=np.r_[x, x[::-1]], y=np.r_[hi, lo[::-1]], fill="toself",
                            fillcolor=color, opacity=0.12, line=dict(width=0),
                            hoverinfo="skip", showlegend=False, row=1, col=col)
            fig.add_scatter(x=x, y=y, mode="lines+markers",
                            name="fixed-B oracle (bound)" if bound else name,
                            line=dict(color="black" if bound else color, dash=dash,
                                      width=3 if bound else 2),
                            customdata=np.c_[g["budget"], _prices(g)], legendgroup=name,
                            showlegend=first(listed, name),
                            hovertemplate=f"{name}: {_letter(mode)} = %{{customdata[0]}}"
                                          "%{customdata[1]} → %{x:.2f} experts loaded, "
                                          "RSE %{y:.3g}<extra></extra>", row=1, col=col)
    fig.update_yaxes(type="log", exponentformat="power", title_text="RSE (log; floor 1e-9)",
                     col=1)
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(title_text=f"{EXPERTS_AXIS} (of {n})" if n else EXPERTS_AXIS)
    fig = _style(fig, "Reconstruction error vs mean experts loaded per layer, fixed and "
                      "adaptive budgets")
    # one entry per ranking × mode: a column right of the panels, never wrapping over the title
    fig.update_layout(legend=dict(orientation="v", yanchor="top", y=1, xanchor="left", x=1.02),
                      margin=dict(r=200))
    return _note(fig, "x: mean of experts_loaded over tree-layers (bytes actually loaded), the "
                      "same for fixed and adaptive; a point is a budget B (fixed) or a mean B̄ "
                      "asked (adaptive).<br>Solid: fixed B; dashed: an adaptive mode; black: "
                      "the fixed-B oracle, the bound of fixed budgets. Bands: 95% over "
                      "tree-layers.")


def speedup_vs_experts(frame: pl.DataFrame, title: str, note: str | None = None) -> go.Figure:
    """Projected speedup against the mean experts loaded per layer on the target, one line per
    budget mode (:func:`analysis.frames.mode_speedup_frame`, one hardware profile: the frame's
    first), the unbudgeted pass a star; filled marker: within the quality bound, open: outside
    it or unmeasured; bars: 95% interval from τ."""
    hw = frame["hardware"][0]
    mine = frame.filter(pl.col("hardware") == hw)
    fig = go.Figure()
    plain = mine.filter(pl.col("budget_mode") == "none (B = N)")
    modes = sorted(set(mine["budget_mode"]) - {"none (B = N)"},
                   key=lambda m: (m != FIXED_MODE, m))
    for i, mode in enumerate(modes):
        g = mine.filter(pl.col("budget_mode") == mode).sort("experts_loaded")
        ok = g["within_bound"].fill_null(False).to_list()
        color = COLORS[i % len(COLORS)]
        fig.add_scatter(
            x=g["experts_loaded"], y=g["speedup"], mode="lines+markers", name=mode,
            line=dict(color=color, dash="solid" if mode == FIXED_MODE else
                      MODE_DASHES[(i - (FIXED_MODE in modes)) % len(MODE_DASHES)]),
            marker=dict(size=9, color=color,
                        symbol=["circle" if o else "circle-open" for o in ok]),
            error_y=dict(type="data", symmetric=False, thickness=1,
                         array=(g["speedup_high"] - g["speedup"]).fill_nan(None).to_list(),
                         arrayminus=(g["speedup"] - g["speedup_low"]).fill_nan(None).to_list()),
            customdata=np.c_[g["budget"], g["tau"], g["quality"], g["experts_p10"],
                             g["experts_p90"], _prices(g)],
            hovertemplate=f"{_letter(mode)} = %{{customdata[0]}}%{{customdata[5]}}: %{{x:.2f}} "
                          "experts per layer (p10–p90 %{customdata[3]:.1f}–%{customdata[4]:.1f})"
                          " → %{y:.2f}×<br>τ %{customdata[1]:.2f}<br>%{customdata[2]}<extra>"
                          + mode + "</extra>")
    if plain.height:
        fig.add_scatter(x=plain["experts_loaded"], y=plain["speedup"], mode="markers",
                        name="no budget (B = N)", marker=dict(symbol="star", size=13,
                                                              color="black"))
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray", annotation_text="1× (no gain)",
                  annotation_position="bottom left")
    r = mine.row(0, named=True)
    fig.update_xaxes(title=f"{EXPERTS_AXIS} on the target (of {r['target_experts']}, "
                           f"top-{r['target_top_k']})")
    fig.update_yaxes(title="projected speedup over AR (×)")
    fig = _style(fig, f"{title} ({hw})")
    return _note(fig, note) if note else fig


def oracle_gap(gap: pl.DataFrame) -> go.Figure:
    """Share of experts the oracle saves at the router's error. A value the sweep cannot pin
    down is labelled, never drawn as a number: "beyond the sweep" (the oracle never reaches the
    error; bar at 0) and "below the sweep" (the oracle beats it at its smallest budget, so the
    saving is only a lower bound, drawn hatched at that bound)."""
    fig = go.Figure()
    for i, (cov, g) in enumerate(gap.sort("reference_budget").group_by(
            ["coverage"], maintain_order=True)):
        share = g["saved_share"].to_numpy()
        where = g["sweep"].to_list() if "sweep" in g.columns else ["inside"] * g.height
        text = []
        for v, w in zip(share, where):
            if w == "beyond" or not np.isfinite(v):
                text.append("beyond<br>the<br>sweep")  # narrow: two bars' labels side by side
            elif w == "below":
                text.append(f"≥ {v:.0%},<br>below<br>the<br>sweep" if v > 0
                            else "below<br>the<br>sweep")
            else:
                text.append(f"{v:.0%}")
        fig.add_bar(x=g["reference_budget"], y=np.nan_to_num(share, nan=0.0), name=cov[0],
                    text=text, textposition="outside", marker_color=COLORS[i],
                    constraintext="none", cliponaxis=False, textfont=dict(size=11),
                    marker_pattern_shape=["/" if w == "below" else "" for w in where])
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="router's budget B")
    integer_axis(fig, gap["reference_budget"])
    fig.update_yaxes(tickformat=".0%", title="experts the oracle saves at the router's error")
    fig = _style(fig, "Oracle gap at matched error (experts the oracle saves at the router's "
                      "RSE)")
    return _note(fig, "\"beyond the sweep\": the oracle never reaches the router's error within "
                      "the budgets replayed.<br>\"below the sweep\": the oracle beats it already "
                      "at its smallest budget replayed, so the saving is unknown (at least the "
                      "hatched bar).")


def closed_loop(frame: pl.DataFrame, n: int | None = None) -> go.Figure:
    """Accepted length under the budget per ranking, one panel per coverage; against B where
    every row is a fixed budget, else one curve per ranking × budget mode against the mean
    experts loaded per layer (:func:`_mode_curves`)."""
    from plotly.subplots import make_subplots
    covs = sorted(set(frame["coverage"]))
    fig = make_subplots(rows=1, cols=len(covs), shared_yaxes=True,
                        subplot_titles=[NAMES.get(c, c) for c in covs])
    modes = set(frame["budget_mode"]) if "budget_mode" in frame.columns else {FIXED_MODE}
    listed: set[str] = set()
    for col, cov in enumerate(covs, start=1):
        sub = frame.filter(pl.col("coverage") == cov)
        if modes != {FIXED_MODE}:
            for (_, mode), g, name, color, dash in _mode_curves(frame, cov):
                _band(fig, g["experts_loaded"], g["tau"], g["tau_lo"], g["tau_hi"], name,
                      color, row=1, col=col, legendgroup=name, showlegend=first(listed, name))
                fig.data[-1].update(
                    line_dash=dash, customdata=np.c_[g["budget"], _prices(g)],
                    hovertemplate=f"{name}: {_letter(mode)} = %{{customdata[0]}}%{{customdata[1]}}"
                                  " → %{x:.2f} experts loaded, τ %{y:.2f}<extra></extra>")
        else:
            for i, (ranking, g) in enumerate(sub.sort("budget").group_by(
                    ["ranking"], maintain_order=True)):
                lo = g["tau_lo"] if "tau_lo" in g.columns else g["tau"]
                hi = g["tau_hi"] if "tau_hi" in g.columns else g["tau"]
                _band(fig, g["budget"], g["tau"], lo, hi, ranking[0], COLORS[i % len(COLORS)],
                      row=1, col=col, legendgroup=ranking[0],
                      showlegend=first(listed, ranking[0]))
        captured = float(sub["tau_captured"].mean())
        fig.add_hline(y=captured, line_dash="dash", line_color="black", row=1, col=col,
                      annotation_text=f"captured τ {captured:.2f}",  # clear of the curves' ends
                      annotation_position="top left")
    if modes != {FIXED_MODE}:
        fig.update_xaxes(title_text=f"{EXPERTS_AXIS} (of {n})" if n else EXPERTS_AXIS)
    else:
        fig.update_xaxes(title_text=f"budget B (experts of {n})" if n else "budget B")
        integer_axis(fig, frame["budget"])
    fig.update_yaxes(title_text="accepted length τ under the budget (tokens per pass)", col=1)
    return _style(fig, "Closed-loop acceptance vs budget, mean and 95% interval over trees"
                  if modes == {FIXED_MODE} else "Closed-loop acceptance vs mean experts loaded "
                  "per layer, fixed and adaptive budgets<br><sup>mean and 95% interval over "
                  "trees</sup>")  # two lines: clear of the legend in a 1280 px window


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


def _note(fig: go.Figure, text: str) -> go.Figure:
    """A caption under the plot (how the figure's numbers were made), inside the figure so that
    it travels with it into the report."""
    lines = text.count("<br>") + 1
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0, y=0, yshift=-52,
                       xanchor="left", yanchor="top", showarrow=False, align="left",
                       font=dict(size=11, color="#444"))
    fig.update_layout(margin=dict(b=70 + 16 * lines), height=fig.layout.height + 16 * lines)
    return fig


def speedup(frame: pl.DataFrame, title: str = "Projected speedup vs budget",
            note: str | None = None, best: int | None = None) -> go.Figure:
    """Projected speedup vs the target's own budget, one line per hardware profile. Each point's
    hover gives the quality the budget costs (the ``quality`` column), the first line's points
    are labelled with it (closed-loop path unchanged, or open-loop RSE), and a filled marker is
    a budget within the quality bound (``within_bound``), an open one outside it or unmeasured.
    ``best`` marks the headline budget; ``note`` goes under the plot."""
    fig = go.Figure()
    for i, (hw, g) in enumerate(frame.sort("budget").group_by(["hardware"],
                                                              maintain_order=True)):
        ok = (g["within_bound"].fill_null(False).to_list() if "within_bound" in g.columns
              else [True] * g.height)
        quality = g["quality"].to_list() if "quality" in g.columns else [""] * g.height
        label = []
        for r in g.iter_rows(named=True):
            if r.get("captured_budget") == r.get("num_experts"):
                label.append("")
            elif r.get("path_unchanged") is not None:
                label.append(f"{r['path_unchanged']:.0%}")
            elif r.get("rse") is not None:
                label.append(f"RSE {r['rse']:.2g}")
            else:
                label.append("")
        color = COLORS[i % len(COLORS)]
        fig.add_scatter(x=g["budget"], y=g["speedup"], mode="lines+markers+text" if i == 0
                        else "lines+markers", name=hw[0], line=dict(color=color),
                        text=label if i == 0 else None, textposition="top center",
                        textfont=dict(size=10, color="#444"),
                        marker=dict(size=9, color=color, symbol=["circle" if o else "circle-open"
                                                                 for o in ok]),
                        error_y=dict(type="data", symmetric=False,
                                     array=(g["speedup_high"] - g["speedup"]).fill_nan(None)
                                     .to_list(),
                                     arrayminus=(g["speedup"] - g["speedup_low"]).fill_nan(None)
                                     .to_list(), thickness=1)
                        if "speedup_low" in g.columns else None,
                        customdata=np.c_[g["tau"], quality],
                        hovertemplate="B = %{x}: %{y:.2f}× (bars: 95% CI from τ)<br>τ "
                                      "%{customdata[0]:.2f}<br>%{customdata[1]}<extra>"
                                      + hw[0] + "</extra>")
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray", annotation_text="1× (no gain)",
                  annotation_position="bottom left")  # clear of the headline's label
    if best is not None:
        fig.add_vline(x=best, line_dash="dot", line_color="black",
                      annotation_text=f"headline B = {best}", annotation_position="top left")
    if "target_experts" in frame.columns:
        r = frame.row(0, named=True)
        fig.update_xaxes(title=f"budget B on the target (experts of {r['target_experts']}, "
                               f"top-{r['target_top_k']})")
    else:
        n = frame["num_experts"][0] if "num_experts" in frame.columns else None
        fig.update_xaxes(title=f"budget B (experts of {n})" if n else "budget B")
    fig.update_yaxes(title="projected speedup over autoregressive decoding (×)")
    fig = _style(fig, title)
    return _note(fig, note) if note else fig


def efficiency(frame: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    for i, (b, g) in enumerate(frame.sort("gamma").group_by(["batch_size"], maintain_order=True)):
        fig.add_scatter(x=g["gamma"], y=g["eta"], mode="lines+markers", name=f"b = {b[0]}",
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


def truncation_coverage(frame: pl.DataFrame, n: int | None = None) -> go.Figure:
    """Share of token-expert assignments outside a budget's shortlist S (mean over layers):
    static S (the run's top-B experts by selection count) and frequency S (each batch pass's
    own top-B by count); ``frame``: :func:`analysis.ids.truncation`'s rows."""
    mean = frame.group_by("budget").agg(pl.col("static_outside").mean(),
                                        pl.col("frequency_outside").mean()).sort("budget")
    fig = go.Figure()
    for i, (col, name) in enumerate((("static_outside", "static: the run's top-B by count"),
                                     ("frequency_outside", "frequency: each pass's top-B"))):
        fig.add_scatter(x=mean["budget"], y=mean[col], mode="lines+markers", name=name,
                        line=dict(color=COLORS[i]))
    fig.update_xaxes(title=f"budget B (experts of {n})" if n else "budget B (experts)")
    fig.update_yaxes(title="assignments outside S (truncated)", tickformat=".0%", rangemode="tozero")
    return _style(fig, "Truncation coverage: share of token-expert assignments a budget drops")


IDS_WORDS = (("a tree's router mass", "a batch pass's routed-token counts"),
             ("Router mass covered by the top-B experts of a tree",
              "Routed-token counts covered by the top-B experts of a batch pass"),
             ("router mass covered", "assignments covered (routed-token counts)"),
             ("vs tree size (mean over layers and trees)",
              "vs batch-pass size (mean over layers and passes)"),
             ("tree tokens t (breadth-first)", "batch-pass tokens t (request order)"))


def as_ids_only(fig: go.Figure) -> go.Figure:
    """A routing figure of a routing-only run says what it measures: routed-token counts (ids
    only, no router probabilities) over batch passes, not router mass over trees."""
    def swap(text):
        for old, new in IDS_WORDS:
            text = text.replace(old, new)
        return text
    if fig.layout.title.text:
        fig.update_layout(title=swap(fig.layout.title.text) + " — routing-only (ids)")
    for trace in fig.data:
        if trace.name and "of mass" in trace.name:
            trace.name = trace.name.replace("of mass", "of assignments")
    for axis in ("xaxis", "yaxis"):
        title = fig.layout[axis].title.text
        if title:
            fig.layout[axis].title.text = swap(title)
    return fig
