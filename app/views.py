"""The dashboard's pages: selectors, then an analysis frame, then a figure. No computation of
their own beyond wiring (all numbers come from :mod:`analysis` through :mod:`app.data`).

Each page is one function here; ``app/screens/<name>.py`` calls it, so every page has its own URL
(``/coverage``, ``/tree-viewer``, …) that can be linked. Analysis pages draw evaluation runs by
default; a sidebar selector switches the role.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
import polars as pl
import streamlit as st

from analysis import coactivation, cost, figures, replay_views
from analysis.frames import (
    batch_fit,
    batch_projection,
    calibration_frame,
    efficiency_frame,
    frontier_frame,
    headline,
    model_shape,
    real_targets,
    routing_statistics,
    routing_warnings,
    speedup_frame,
    speedup_note,
)
from analysis.sql import run_query
from app import data
from catalog import partition_value

# Run on the console's views, which hold evaluation runs unless the user widens them (a
# ``role`` column says which run is which either way).
EXAMPLES = {  # each gives one row per run (and variant): nothing pooled across runs or settings
    "τ and experts by run": "SELECT model, bench, run, role, avg(accepted_length) AS tau, "
                            "avg(list_avg(unique_experts)) AS unique_experts FROM trees "
                            "GROUP BY ALL ORDER BY ALL",
    "Unique experts per layer (first tree)": "SELECT run, prompt_index, unique_experts FROM trees "
                                             "WHERE step = 0 ORDER BY run, prompt_index LIMIT 20",
    "Accepted path of one tree": "SELECT node, parent, depth, token_id, draft_logprob FROM nodes "
                                 "WHERE accepted AND (run, prompt_index, step) = (SELECT (run, "
                                 "prompt_index, step) FROM nodes ORDER BY run, prompt_index, "
                                 "step LIMIT 1) ORDER BY depth",
    "Error vs budget (replay)": "SELECT run, ranking, coverage, budget, avg(rse) AS rse FROM "
                                "replay_open GROUP BY ALL ORDER BY ALL",
    "Replay variants": "SELECT * FROM variants",
    "Runs and their settings": "SELECT run, role, max_new_tokens, temperature, tree_total_tokens, "
                               "tree_depth, batch_size, storage FROM runs ORDER BY run",
}


def dataset() -> data.Dataset:
    """The traces this session looks at, fresh if a run landed since the last interaction."""
    root = st.session_state["root"]
    ds, problem = data.current(root)
    if ds is None:
        no_data(root, problem)
        st.stop()
    return ds


def _roles(key: str) -> tuple[str, ...]:
    """The role(s) a page draws (evaluation unless the user picks otherwise)."""
    choice = st.sidebar.selectbox("Runs to draw", ["evaluation", "calibration", "all roles"],
                                  key=f"{key}_role",
                                  help="analyses draw evaluation runs; calibration runs are never "
                                       "pooled into them unless you choose so here")
    return ("evaluation", "calibration") if choice == "all roles" else (choice,)


def _runs(ds: data.Dataset, roles: tuple[str, ...]) -> pl.DataFrame:
    return ds.runs.filter(pl.col("role").is_in(list(roles)))


def _url_select(container, label: str, options: list, key: str, param: str, index: int = 0,
                **kw):
    """A selectbox whose choice lives in the URL (``?param=value``): a deep link restores it,
    and picking another option updates the address bar."""
    options = list(options)
    labels = [str(o) for o in options]
    wanted = st.query_params.get(param)
    if key not in st.session_state and wanted in labels:
        index = labels.index(wanted)
    value = container.selectbox(label, options, index=min(index, max(len(options) - 1, 0)),
                                key=key, **kw)
    if value is not None:
        st.query_params[param] = str(value)
    return value


def _url_multiselect(label: str, options: list, key: str, param: str):
    """A multiselect (all options by default) kept in the URL as ``?param=a,b``."""
    default = list(options)
    wanted = st.query_params.get(param)
    if key not in st.session_state and wanted is not None:
        default = [o for o in options if str(o) in wanted.split(",")]
    value = st.multiselect(label, options, default=default, key=key)
    st.query_params[param] = ",".join(str(v) for v in value)
    return value


def _dataset_picker(ds: data.Dataset, key: str, roles=("evaluation",),
                    prefer: set | None = None) -> tuple[str, str] | None:
    """The dataset (model / benchmark) a page draws; starts at the first one in ``prefer`` (the
    datasets that have what the page shows) unless the URL names one."""
    pairs = sorted({(r["model"], r["bench"]) for r in _runs(ds, roles).iter_rows(named=True)})
    if not pairs:
        st.info(f"No complete {' or '.join(roles)} run yet.")
        return None
    first = next((i for i, p in enumerate(pairs) if prefer is None or p in prefer), 0)
    label = _url_select(st, "Dataset (model / benchmark)", [f"{m} / {b}" for m, b in pairs],
                        key, "dataset", index=first)
    model, bench = label.split(" / ")
    return model, bench


def _datasets(frame: pl.DataFrame, ds: data.Dataset) -> set:
    """The (model, bench) pairs, as the picker names them, that have rows in ``frame``."""
    if frame.is_empty():
        return set()
    have = {(m, b) for m, b in frame.select("model", "bench").unique().iter_rows()}
    return {(r["model"], r["bench"]) for r in ds.runs.iter_rows(named=True)
            if (partition_value(r["model"]), r["bench"]) in have}


def _setting_picker(runs: pl.DataFrame, key: str, across: tuple[str, ...] = ()) -> pl.DataFrame:
    """The runs of one setting: runs of one model and benchmark whose capture settings (the
    prompt range aside) are equal are one experiment; runs that differ are never pooled. With
    several settings a selector (in the URL) picks one, the one with most prompts first, and a
    note says what the others are. ``across``: settings the page itself draws on an axis (the
    batch page: ``batch_size``), which do not split the runs."""
    if runs.is_empty() or "setting" not in runs.columns:
        return runs
    runs = runs.with_columns(pl.col("setting").map_elements(
        lambda s: json.dumps({k: v for k, v in json.loads(s).items() if k not in across},
                             sort_keys=True), return_dtype=pl.String).alias("_group"))
    groups = runs.group_by("_group", maintain_order=True).agg(pl.col("run"),
                                                              pl.col("prompts").sum())
    if groups.height == 1:
        return runs.drop("_group")
    settings = [json.loads(s) for s in groups["_group"]]
    differ = sorted({k for s in settings for k in s
                     if any(s.get(k) != other.get(k) for other in settings)})
    labels = [", ".join(f"{k} {s.get(k)}" for k in differ) + f" — runs {', '.join(names)}"
              for s, names in zip(settings, groups["run"])]
    first = max(range(groups.height),  # most prompts, then the plain capture (b = 1)
                key=lambda i: (groups["prompts"][i] or 0, settings[i].get("batch_size") == 1))
    label = _url_select(st, "Setting (runs with other settings are never pooled)", labels, key,
                        "setting", index=first)
    st.caption(f"This dataset has {groups.height} capture settings (they differ in "
               f"{', '.join(differ)}); the page draws one at a time. The *Compare runs* page "
               "sets them side by side.")
    return runs.filter(pl.col("run").is_in(groups["run"][labels.index(label)])).drop("_group")


class Page(NamedTuple):
    """What a one-dataset page works on, once the user picked roles, a dataset and a
    setting."""

    ds: data.Dataset
    roles: tuple[str, ...]
    model: str
    bench: str
    runs: pl.DataFrame  # the chosen roles' complete runs of this model, benchmark and setting

    @property
    def n(self) -> int:
        return int(self.runs["num_experts"][0])

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.runs["run"].to_list()))

    @property
    def con(self):
        """A cursor whose views hold these runs only."""
        return self.ds.con_for(self.roles, self.names)

    def frame(self, name: str) -> pl.DataFrame:
        """The analysis frame ``name`` of these roles, for this dataset and setting only."""
        return _pick(data.frame(name, str(self.ds.root), self.ds.version, self.roles,
                                self.names), self.model, self.bench)


def _page(title: str, key: str, caption: str | None = None, prefer=None,
          across: tuple[str, ...] = ()) -> Page | None:
    """Header, the sidebar's role choice and the dataset picker every one-dataset page starts
    with; None (with a note shown) when there is nothing to draw. ``prefer(ds, roles)``: the
    datasets the picker should start at (those with this page's results)."""
    ds = dataset()
    st.header(title)
    if caption:
        st.caption(caption)
    roles = _roles(key)
    picked = _dataset_picker(ds, f"{key}_ds", roles, prefer(ds, roles) if prefer else None)
    if picked is None:
        return None
    model, bench = picked
    runs = _runs(ds, roles).filter((pl.col("model") == model) & (pl.col("bench") == bench))
    return Page(ds, roles, model, bench, _setting_picker(runs, f"{key}_setting", across))


def _pick(frame: pl.DataFrame, model: str, bench: str) -> pl.DataFrame:
    return frame.filter((pl.col("model") == partition_value(model)) & (pl.col("bench") == bench))


def overview() -> None:
    ds = dataset()
    st.header("Runs overview")
    st.caption("How to read this: one row per complete run; τ is the mean accepted length per "
               "verification tree, unique experts the experts a tree's tokens route to in one "
               "layer (averaged over layers and trees). The tiles average evaluation runs only.")
    frame = data.overview(str(ds.root), ds.version)
    for model, line in routing_warnings(ds.runs):
        st.warning(f"{model}: {line}")
    c1, c2, c3, c4 = st.columns([0.8, 1, 1.2, 2])  # room for the long labels in full
    c1.metric("runs", ds.runs.height)
    c2.metric("verification trees", int(frame["trees"].sum()))
    ev = frame.filter(pl.col("role") == "evaluation")
    c3.metric("mean τ (evaluation runs)", f"{ev['tau'].mean():.2f}" if ev.height else "—")
    c4.metric("unique experts / layer / tree (evaluation runs)",
              f"{ev['unique_experts'].mean():.1f}" if ev.height else "—")
    if frame["budget"].is_null().all():  # without a budget every tree loads what it uses
        frame = frame.drop("experts_loaded", "budget")
    st.dataframe(frame, hide_index=True, width="stretch")
    storage = ds.runs.select("model", "bench", "run", "role", "storage")
    st.caption("What each run keeps of the MoE hidden states (routing, trees and nodes are "
               "always complete):")
    st.dataframe(storage, hide_index=True, width="stretch")
    st.caption(f"traces: `{ds.root}` · dataset version {ds.version}")


def heavy_tails() -> None:
    page = _page("Heavy tails", "tails",
                 "How to read this: how many experts a verification tree needs to hold 50 / 90 / "
                 "99% of its router mass in one layer; a curve far below N means a budget can "
                 "drop most experts and keep most of the mass.")
    if page is None:
        return
    frame = page.frame("tails")
    st.plotly_chart(figures.heavy_tails(frame, page.n), width="stretch")
    st.dataframe(frame, hide_index=True)


def coverage() -> None:
    ds = dataset()
    st.header("Coverage curves")
    st.caption("How to read this: the share of a tree's router mass held by its B most-used "
               "experts, per benchmark; the dotted diagonal is uniform routing (B/N), and the "
               "higher a curve sits above it, the more a budget of B keeps.")
    roles = _roles("cov")
    frame = data.frame("coverage", str(ds.root), ds.version, roles)
    if frame.height == 0:
        st.info("No routing of the chosen runs yet.")
        return
    models = sorted(set(frame["model"]))
    model = _url_select(st, "Model", models, "cov_model", "model")
    sel = frame.filter(pl.col("model") == model)
    b = st.slider("Budget B", 1, int(sel["budget"].max()), min(32, int(sel["budget"].max())),
                  key="cov_b")
    st.plotly_chart(figures.coverage(sel, b), width="stretch")
    at = sel.filter(pl.col("budget") == b).select("bench", "coverage")
    st.write(f"Router mass held by the top-{b} experts:")
    st.dataframe(at, hide_index=True)


def growth() -> None:
    page = _page("Activation growth", "growth",
                 "How to read this: unique experts among the first t tree tokens vs MoESD's "
                 "N(t) and the i.i.d. expectation with each layer's own marginals (averaged over "
                 "layers); a measured curve below them means trees reuse experts.")
    if page is None:
        return
    frame, n = page.frame("growth"), page.n
    st.plotly_chart(figures.growth(frame, n), width="stretch")
    last = frame.sort("tokens").tail(1).row(0, named=True)
    st.write(f"At {last['tokens']} tree tokens: measured {last['unique_experts']:.1f}, "
             f"i.i.d. per-layer marginals {last['marginal']:.1f}, uniform N(t) "
             f"{last['uniform']:.1f} (of {n}).")


def batch_regime() -> None:
    page = _page("Batch regime", "batch",
                 "How to read this: each point is the mean over verification passes that verified "
                 "b sequences' trees at once (capture --batch-size b); the union of their experts "
                 "is what a pass loads. MoESD's argument: as b grows the union saturates at N, so "
                 "extra tokens come nearly free until compute takes over.",
                 prefer=lambda ds, roles: _datasets(
                     data.frame("batch", str(ds.root), ds.version, roles), ds),
                 across=("batch_size",))  # runs that differ only in b: the page's x axis
    if page is None:
        return
    frame, n = page.frame("batch"), page.n
    if frame.height == 0:
        st.info("No unbudgeted verification passes here; capture with `capture --batch-size 4`.")
        return
    st.plotly_chart(figures.batch_regime(frame, n), width="stretch")
    table = frame.select(
        pl.col("batch_size").alias("b"), pl.col("tokens").alias("tokens a pass (b·M)"),
        pl.col("unique_experts").round(1).alias("unique experts / layer (measured)"),
        pl.col("uniform").round(1).alias("MoESD uniform N(b·M)"),
        (pl.col("seconds") * 1e3).round(2).alias("verify ms (median)"), "passes")
    st.dataframe(table, hide_index=True)
    if frame["batch_size"].n_unique() >= 2:
        from analysis import warmup
        from analysis.frames import capture_batch_fit
        fit = capture_batch_fit(page.con, page.model, page.bench)
        coef = fit["coef"] if fit else None
        rule = f"{fit['dropped'] if fit else 0} passes dropped by the {warmup.RULE}"
        if coef is None or coef["refused"]:
            st.warning(f"MoESD's pass-time model {coef['refused'] if coef else 'not fitted'} "
                       f"({rule}).")
        else:
            left = f"; left out: {', '.join(coef['left_out'])}" if coef["left_out"] else ""
            st.write(f"MoESD's pass-time model fitted to these passes: T = {coef['c0'] * 1e3:.2f} "
                     f"ms + {coef['c1'] * 1e3:.3f} ms × E(b·M) + {coef['c2'] * 1e3:.4f} ms × b·M,"
                     f" relative RMSE {coef['relative_rmse']:.1%} over {coef['points']} batch "
                     f"sizes ({rule}{left}).")
    else:
        st.caption("Capture at two or more batch sizes to fit MoESD's pass-time model here.")
    _batch_errors(page)
    _batch_speed(page)
    st.caption("Budgets across a batch: `capture --batch-size b --budget B` caps the union over "
               "the whole pass; `replay --batch-size b` replays every ranking's budget over "
               "each pass's union; `python bench/batch_regime.py` tabulates both.")


def _batch_errors(page: Page) -> None:
    """RSE vs B with one shortlist per (virtual) batch pass, per b (replay --batch-size)."""
    every = data.frame("batch_errors", str(page.ds.root), page.ds.version, page.roles)
    errors = _pick(every, page.model, page.bench) if every.height else every
    st.subheader("A budget shared by a batch's trees")
    if errors.height == 0 or errors["batch_size"].max() == 1:
        st.caption("Not replayed over batches yet: `replay --batch-size 4 --ranking router coact "
                   "oracle --budget sweep` gives each pass of 4 trees one shortlist (virtual "
                   "batches of b = 1 captures: same decoding step, grouped by --batch-seed).")
        return
    cover = st.radio("coverage", sorted(set(errors["coverage"])), horizontal=True,
                     key="batch_cover")
    shown = errors.filter(pl.col("coverage") == cover)
    st.plotly_chart(figures.batch_errors(shown, page.n), width="stretch")
    st.dataframe(shown.select(
        pl.col("batch_size").alias("b"), "ranking", pl.col("budget").alias("B"),
        pl.col("rse").round(4).alias("mean RSE"),
        pl.col("trees").round(2).alias("trees a pass"),
        pl.col("experts_loaded").round(1).alias("experts loaded")), hide_index=True)


def _batch_speed(page: Page) -> None:
    """profile-batch's measured speedup vs b, with MoESD's fit and a roofline projection."""
    every = data.frame("batch_speed", str(page.ds.root), page.ds.version, page.roles)
    speed = _pick(every, page.model, page.bench) if every.height else every
    st.subheader("Speedup over autoregressive decoding vs b")
    if speed.height == 0:
        st.caption("Not measured for this dataset: `profile-batch --model … --bench … "
                   "--batch-sizes 1,2,4,8,16 --budget 16` decodes the same prompts b at a time "
                   "autoregressively and with EAGLE, with and without a budget.")
        return
    runs = speed["run"].unique(maintain_order=True).to_list()
    run = runs[-1] if len(runs) == 1 else st.selectbox("profile run", runs, key="batch_run")
    speed = speed.filter(pl.col("run") == run)
    with data.pristine(str(page.ds.root), None) as con:
        fit = batch_fit(con, page.model, page.bench, run, speed)
    targets = real_targets()
    left, right = st.columns(2)
    shape_name = left.selectbox("roofline projection for", list(targets), key="batch_shape")
    hw_name = right.selectbox("on", list(cost.PROFILES), key="batch_hw")
    target = targets[shape_name]
    gamma = fit["gamma"] if fit else 63
    projection = batch_projection(speed, target, cost.PROFILES[hw_name], gamma)
    shown = fit if fit and not fit["refused"] else None  # a refused fit is never drawn
    st.plotly_chart(figures.batch_speedup(speed, shown, projection, f"{shape_name} on {hw_name}"),
                    width="stretch")
    st.dataframe(speed.select(
        pl.col("batch_size").alias("b"), pl.col("budget").alias("budget B"),
        pl.col("ar_tokens_per_s").round(1).alias("AR tok/s"),
        pl.col("eagle_tokens_per_s").round(1).alias("EAGLE tok/s"),
        pl.col("tau").round(2).alias("τ"), pl.col("speedup").round(2).alias("speedup")),
        hide_index=True)
    if fit:
        from analysis import warmup
        c = fit["coef"]
        rule = f"{fit['dropped']} passes dropped by the {warmup.RULE}"
        if fit["refused"]:
            st.warning(f"MoESD's pass-time model {fit['refused']} ({rule}).")
        else:
            left = f"; left out: {', '.join(fit['left_out'])}" if fit["left_out"] else ""
            st.write(f"MoESD's pass-time model fitted to {c['points']} measured (sequences, γ) "
                     f"points: T = {c['c0'] * 1e3:.2f} ms + {c['c1'] * 1e3:.3f} ms × E(bγ) + "
                     f"{c['c2'] * 1e3:.4f} ms × bγ, relative RMSE {c['relative_rmse']:.1%} "
                     f"({rule}{left}).")
    st.caption(f"Measured on {speed['device'][0]}; tokens/s over each whole decoding (prefill and "
               "drafting included). The fit and the roofline are verification-only (τ·T(b,1)/"
               "T(b,M)); the roofline assumes MoESD's uniform routing for the experts a pass "
               "loads, capped at the budget.")


def coact() -> None:
    page = _page("Co-activation", "coact",
                 "How to read this: how often two experts of one layer are picked for the same "
                 "token, against independent picks; bright blocks are experts that travel "
                 "together, which a co-activation-aware budget keeps together.")
    if page is None:
        return
    model, bench = page.model, page.bench
    run = page.runs.row(0, named=True)
    c1, c2, c3 = st.columns(3)
    layer = _url_select(c1, "Layer", run["moe_layers"], "coact_layer", "layer")
    convention = c2.selectbox("Convention", ["all_pairs", "adjacent"], key="coact_conv",
                              help="all pairs: joint counts; adjacent: OLMoE's adjacent-rank "
                                   "pairs, row-normalised P(b|a)")
    ordering = c3.selectbox("Ordering", ["cluster", "index"], key="coact_order")
    colour = st.radio("Colour", ["lift (observed / expected)", "observed"], key="coact_scale",
                      horizontal=True,
                      help="lift: pair counts over what independent selection with each "
                           "expert's measured frequency would give (log scale, 1 = "
                           "independent); observed: the counts (or P(b|a)) themselves. The "
                           "diagonal (an expert with itself) is masked in both.")
    where = f"model = '{partition_value(model)}' AND bench = '{bench}'"
    c = coactivation.coactivation(page.con, int(layer), run["num_experts"], convention,
                                  where)
    order = coactivation.cluster_order(c.matrix) if ordering == "cluster" else None
    st.metric(f"concentration ({convention.replace('_', ' ')}: {c.concentration_rule})",
              f"{c.concentration:.1f}×")
    bar = "tokens with both experts" if convention == "all_pairs" else "P(b | a)"
    lift = colour.startswith("lift")
    st.plotly_chart(figures.coactivation(
        c.matrix, order, f"Co-activation, layer {layer}, {convention.replace('_', ' ')}, "
        f"{'lift over independent selection' if lift else 'observed'}, {ordering} order", bar,
        lift=c.lift if lift else None), width="content")
    if lift:
        st.caption("Lift: the pair's count over the count expected if each expert were picked "
                   "independently with its own measured frequency (1 = independent; red above, "
                   "blue below). Light grey: never seen together (no count, so no lift: not "
                   "avoidance); whole light-grey rows and columns are experts never selected in "
                   "this layer. Dark grey: the diagonal (an expert with itself), masked. Every "
                   "expert id is ticked; zoom (drag a box) for a block.")
    else:
        st.caption("Light grey: never seen together (not the bottom of the scale); dark grey: the "
                   "diagonal (an expert with itself), masked. Every expert id is ticked; zoom "
                   "(drag a box) for a block.")


def replay() -> None:
    ds = dataset()
    st.header("Replay results")
    st.caption("How to read this: replay re-runs the captured MoE layers with only B experts "
               "per layer allowed; the error (relative squared error of the MoE output, open "
               "loop) or the share of unchanged tree paths (closed loop) says what each ranking's "
               "choice of B experts costs. Lower error at a smaller B is better.")
    roles = _roles("replay")
    if "replay_open" not in ds.views and "replay_closed" not in ds.views:
        st.info("No replay results yet. Run for example\n\n"
                f"`replay --traces {ds.root} --ranking router oracle --budget sweep`")
        return
    have = {name: data.frame(name, str(ds.root), ds.version, roles)
            for name in ("errors", "closed")}
    picked = _dataset_picker(ds, "replay_ds", roles,
                             _datasets(have["errors"], ds) | _datasets(have["closed"], ds))
    if picked is None:
        return
    runs = _setting_picker(_runs(ds, roles).filter((pl.col("model") == picked[0])
                                                   & (pl.col("bench") == picked[1])),
                           "replay_setting")
    names = tuple(sorted(runs["run"].to_list()))
    n = int(runs["num_experts"][0])
    have = {name: data.frame(name, str(ds.root), ds.version, roles, names)
            for name in ("errors", "closed")}
    curves = _pick(have["errors"], *picked) if have["errors"].height else have["errors"]
    cl = _pick(have["closed"], *picked) if have["closed"].height else have["closed"]
    _variants_note(ds.con_for(roles, names))
    if curves.is_empty() and cl.is_empty():
        st.info(f"No replay results for {picked[0]} / {picked[1]} yet. Produce them with\n\n"
                f"`replay --traces {ds.root} --model {picked[0]} --bench {picked[1]} "
                "--ranking router oracle --budget sweep`")
        return
    if curves.height:
        rank = _url_multiselect("Rankings", sorted(set(curves["ranking"])), "replay_rank",
                                "ranking")
        curves = curves.filter(pl.col("ranking").is_in(rank))
        if curves.height:
            st.plotly_chart(figures.error_vs_budget(curves, n), width="stretch")
            if {"oracle", "router"} <= set(curves["ranking"]):
                gap = replay_views.oracle_gap(curves)
                st.plotly_chart(figures.oracle_gap(gap), width="stretch")  # notes its labels
            steps = replay_views.ablation(curves)
            if not steps.is_empty():
                st.subheader("Where coact's gain comes from")
                st.caption(replay_views.ABLATION_NOTE)
                st.dataframe(steps, hide_index=True, column_config={
                    c: st.column_config.NumberColumn(c, format="percent")
                    for c in steps.columns[2:]})
    if cl.height:
        st.plotly_chart(figures.closed_loop(cl, n), width="stretch")
        st.dataframe(cl, hide_index=True)
    saved = [data.frame(name, str(ds.root), ds.version, roles, names)
             for name in ("saved_open", "saved_closed")]
    saved = [f for f in (_pick(f, *picked) for f in saved if f.height) if f.height]
    if saved:
        st.subheader("Experts saved at matched quality vs router")
        st.caption(replay_views.SAVED_NOTE)
        st.dataframe(replay_views.experts_saved_display(pl.concat(saved)), hide_index=True,
                     column_config={c: st.column_config.NumberColumn(c, format="percent")
                                    for c in ("saved", "saved_lo", "saved_hi")})


def _variants_note(con) -> None:
    """Say when the replay tables hold more variants than the page draws (one per cell)."""
    from analysis.sql import DEFAULT_VARIANT_RULE
    try:
        hidden = con.execute("SELECT count(*) FROM variants WHERE NOT shown_by_default"
                             ).fetchall()[0][0]
    except Exception:  # noqa: BLE001 - no results, no variants view
        return
    if hidden:
        st.caption(f"{hidden} other stored variant(s) of these results are not drawn; the page "
                   f"shows {DEFAULT_VARIANT_RULE}. The SQL console's `SELECT * FROM variants` "
                   "lists them; `replay_open_all` holds their rows.")


def speedup() -> None:
    """The what-if: this capture's routing statistics on a real model shape and hardware."""
    page = _page("Speedup projection", "speed",
                 "How to read this: this capture's routing (experts a tree loads, τ, quality "
                 "under each budget) put on a real model's shape and hardware with a roofline "
                 "cost model; a speedup above 1× beats autoregressive decoding, and the bold "
                 "budget is the fastest one within the quality bound.",
                 prefer=lambda ds, roles: {(r["model"], r["bench"]) for r in
                                           _runs(ds, roles).iter_rows(named=True)
                                           if r["budget"] is None})
    if page is None:
        return
    ds, roles, model, bench = page.ds, page.roles, page.model, page.bench
    run = page.runs.filter(pl.col("budget").is_null())
    if run.height == 0:
        st.info("Needs a plain EAGLE capture (no budget) of this dataset.")
        return
    run = run.row(0, named=True)
    stats = routing_statistics(page.con, model, bench)
    captured = model_shape(run["model_location"])
    if stats is None or captured is None:
        st.warning("The model's config could not be read for the cost model.")
        return
    targets = {f"captured shape ({model})": captured, **real_targets()}
    c1, c2 = st.columns(2)
    target_name = _url_select(c1, "Target model shape", list(targets), "speed_target", "target",
                              index=min(1, len(targets) - 1),
                               help="the capture's routing statistics (unique experts, experts "
                                    "under budget, τ and quality under budget) put on this "
                                    "model's widths and depth; budgets are mapped by share of N "
                                    "onto its own experts, never below its top-k")
    names = c2.multiselect("Hardware", [*cost.PROFILES, "custom"],
                           default=list(cost.PROFILES), key="speed_hw")
    hardware = [cost.PROFILES[h] for h in names if h in cost.PROFILES]
    if "custom" in names:
        c3, c4 = st.columns(2)
        hardware.append(cost.custom(c3.number_input("bandwidth TB/s", 0.1, 20.0, 3.35,
                                                    key="speed_bw"),
                                    c4.number_input("peak TFLOP/s", 1.0, 5000.0, 989.0,
                                                    key="speed_tf")))
    if not hardware:
        st.info("Pick at least one hardware profile.")
        return
    target = targets[target_name]
    on_captured = target_name.startswith("captured shape")
    fitted = calibration_frame(page.con, model, bench,
                               dict(model_location=run["model_location"]), hardware[0])
    cal = fitted[1] if fitted is not None else None
    use_cal = False
    if cal is None or not cal.usable:
        why = ("no measured verification passes (or no readable config) to fit one"
               if cal is None else f"the fit to this capture's timings is {cal.verdict}"
               if not cal.refused else f"this capture's timings were {cal.verdict}")
        st.caption(f"Cost model: datasheet roofline. A calibrated cost model is not offered: "
                   f"{why}.")
    else:
        mode = st.radio("Cost model", ["datasheet roofline",
                                       "calibrated on this capture's timings"],
                        key="speed_m", horizontal=True, help=cal.verdict)
        use_cal = mode.startswith("calibrated")
    if use_cal:
        frame, _ = fitted
        st.plotly_chart(figures.calibration(frame, (
            f"Calibration on {cal.points} passes, {cal.dropped} dropped as warm-up "
            f"({hardware[0].name} datasheet shape): "
            f"T ≈ {cal.alpha:.3g}·T_mem + {cal.beta:.3g}·T_flop + {cal.gamma * 1e3:.3g} ms, "
            f"R² {cal.r2:.2f}, relative RMSE {cal.relative_rmse:.1%}")), width="stretch")
        st.caption("A calibration describes the capturing device on the captured model: with "
                   "the captured shape as target it adds a \"capturing device (calibrated)\" "
                   "line; projections onto other shapes and hardware use the datasheet "
                   "roofline." + ("" if on_captured else " (Pick the captured shape to see it.)"))
    frame = speedup_frame(stats, target, hardware, run["depth"],
                          calibration=(cal, hardware[0]) if use_cal and on_captured else None)
    top = headline(frame, hardware[0].name)
    best = top["row"]
    n_t = best["target_experts"]
    st.plotly_chart(figures.speedup(frame, f"Projected speedup on {target_name} (τ from "
                                           f"{stats['tau_source']})", speedup_note(frame),
                                    best["budget"]), width="stretch")
    if not on_captured and target != captured:
        st.warning(f"τ = {stats['tau']:.2f} (accepted length, from the {stats['tau_source']}) "
                   f"and the routing statistics were measured on the captured model {model}, "
                   f"not on {target_name}: this projection assumes they carry over to the "
                   "target shape. A real model's draft acceptance and routing can differ; "
                   "capture the target model itself to measure them.")
    budgeted = best["captured_budget"] != best["num_experts"]
    st.markdown(f"**Best projected speedup within the quality bound** ({top['bound']}) on "
                f"{best['hardware']}: **{best['speedup']:.2f}×** at B = {best['budget']} of "
                f"{n_t}" + (f" ({best['quality']})" if budgeted else " (no budget)")
                + (f"; {top['note']}" if top["note"] else "") + ".")
    if set(frame["bound"]) == {"compute"}:
        st.info("Every verification pass here is compute-bound: the projection does not depend "
                "on memory bandwidth, only on peak FLOP/s.")
    elif set(frame["bound"]) == {"memory"} and len(hardware) > 1:
        st.caption("Every pass here is memory-bound on every profile, so the speedup is a ratio "
                   "of bytes moved and the same on each: the hardware lines coincide.")
    budgets = sorted(set(frame["budget"].to_list()))
    b = st.select_slider(f"Budget (experts of {n_t}, the target's)", budgets,
                         value=best["budget"], key=f"speed_b:{target_name}",
                         help="starts at the best budget within the quality bound")
    rows = frame.filter(pl.col("budget") == b).to_dicts()
    same = {f"{r['speedup']:.2f}" for r in rows}
    if len(rows) > 1 and len(same) == 1:  # one tile when every profile gives the same number
        rows = [dict(rows[0], hardware=", ".join(r["hardware"] for r in rows))]
    for row in rows:
        st.metric(f"projected speedup at B={b} of {n_t} on {row['hardware']}",
                  f"{row['speedup']:.2f}×",
                  help=f"τ = {row['tau']:.2f} from {row['tau_source']} (captured budget "
                       f"{row['captured_budget']} of {row['num_experts']}); "
                       f"{row['experts_loaded']:.1f} experts loaded per layer of the target; "
                       f"{row['bound']}-bound")
    at = frame.filter(pl.col("budget") == b).row(0, named=True)
    verdict = {True: "within", False: "outside", None: "not measured against"}[at["within_bound"]]
    st.caption(f"Quality at B = {b} of {n_t} (the capture's B = {at['captured_budget']} of "
               f"{at['num_experts']}): {at['quality']}; {verdict} the bound ({top['bound']}).")
    table = frame.pivot(on="hardware", index=["budget", "captured_budget", "tau", "quality",
                                              "within_bound"], values="speedup")
    st.dataframe(table.rename({h: f"speedup on {h} (×)" for h in set(frame["hardware"])}
                              | {"budget": f"B (of {n_t})",
                                 "captured_budget": f"captured B (of {best['num_experts']})",
                                 "tau": "τ", "quality": "quality at this budget",
                                 "within_bound": "within the bound"}),
                 hide_index=True)
    quality_frontier(ds, roles, model, bench, target, hardware[0])
    eta = efficiency_frame(ds.root, model)
    if eta is not None:
        st.plotly_chart(figures.efficiency(eta), width="stretch")
        st.caption("MoESD's target efficiency η(b, γ) = T(b, 1) / T(b, γ) measured by "
                   "`profile-target` on this device: near 1, verifying γ tokens per sequence costs "
                   "about as much as one (memory-bound); it falls as compute takes over.")
    else:
        st.caption(f"MoESD's target efficiency η(b, γ) appears here once `profile-target --model "
                   f"{model} --out {ds.root}` has measured this model on this device.")


def quality_frontier(ds, roles, model, bench, target, hw) -> None:
    front = frontier_frame(ds.con_for(roles), model, bench, target, hw)
    if front is None:
        st.caption("A speedup–quality frontier appears here once budgeted captures "
                   "(`capture --budget B`) and their unbudgeted twin are scored with `evaluate`.")
        return
    flat = front["quality"].drop_nulls().n_unique() <= 1
    st.plotly_chart(figures.frontier(front, "agreement" if flat else "quality"), width="stretch")
    if flat:
        st.caption("Task quality is flat here (tiny models score ≈ 0), so output agreement "
                   "with the unbudgeted run carries the signal.")


def tree_viewer() -> None:
    page = _page("Tree viewer", "tree",
                 "How to read this: one verification tree of one prompt and step, drafted "
                 "tokens by depth; red is the path the target accepted, orange nodes lose one of "
                 "their experts in this layer if only the router's top-B experts are kept.")
    if page is None:
        return
    ds, roles, model, bench, runs = page
    c1, c2, c3 = st.columns(3)
    run = _url_select(c1, "Run", runs["run"].to_list(), "tree_run", "run")
    info = runs.filter(pl.col("run") == run).row(0, named=True)
    part = partition_value(model)
    con = page.con
    steps = con.execute(f"""SELECT prompt_index, any_value(prompt_id), max(step) FROM trees
                            WHERE run = '{run}' AND model = '{part}' AND bench = '{bench}'
                            GROUP BY prompt_index ORDER BY 1""").fetchall()
    labels = {p: f"{p} ({pid})" for p, pid, _ in steps}
    prompt = c2.selectbox("Prompt", list(labels), format_func=labels.get, key="tree_prompt")
    last = {p: s for p, _, s in steps}[prompt]
    step = c3.number_input("Step", 0, last, 0, key="tree_step")
    c4, c5 = st.columns(2)
    layer = c4.selectbox("Layer", info["moe_layers"], key="tree_layer")
    budget = c5.slider("Budget B (router ranking)", 1, info["num_experts"],
                       min(info["num_experts"], max(info["top_k"], info["num_experts"] // 2)),
                       key="tree_budget")
    where = (ds.root, model, bench, run)  # one prompt's part files, not a scan of the run
    nodes = data.prompt_rows(*where, "nodes", int(prompt), ["step", "node", "parent", "depth",
                             "token_id", "draft_logprob", "accepted"], step=int(step)) \
        .drop("step").sort("node")
    rout = data.prompt_rows(*where, "routing", int(prompt), ["step", "layer", "node",
                            "router_probs", "topk_ids"], step=int(step), layer=int(layer)) \
        .select("node", "router_probs", "topk_ids").sort("node")
    tokenizer = data.tokenizer(info["model_location"])
    text = [tokenizer.decode([t]) if tokenizer else str(t) for t in nodes["token_id"].to_list()]
    with st.expander(f"Prompt {labels[prompt]} of {bench}", expanded=False):
        prompt_ids = data.prompt_rows(*where, "sequences", int(prompt),
                                      ["prompt_token_ids"])["prompt_token_ids"][0].to_list()
        st.text(tokenizer.decode(prompt_ids) if tokenizer else str(prompt_ids))
    probs = np.stack(rout["router_probs"].to_list())
    shortlist = set(np.argsort(-probs.sum(0), kind="stable")[:budget].tolist())
    dropped = [sorted(set(t) - shortlist) for t in rout["topk_ids"].to_list()]
    st.plotly_chart(_tree_figure(nodes, dropped, text), width="stretch")
    table = nodes.with_columns(text=pl.Series([_visible(t) for t in text], dtype=pl.String),
                               experts=rout["topk_ids"],
                               dropped_at_budget=pl.Series(dropped, dtype=pl.List(pl.Int64)))
    lost_accepted = sum(1 for a, d in zip(nodes["accepted"], dropped) if a and d)
    st.write(f"{sum(1 for d in dropped if d)} of {len(dropped)} nodes lose experts at B={budget} "
             f"({lost_accepted} of them on the accepted path); the tree touches "
             f"{len({e for t in rout['topk_ids'].to_list() for e in t})} experts in layer "
             f"{layer}.")
    st.dataframe(table, hide_index=True)


_WHITESPACE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def _visible(token: str) -> str:
    """A token with its whitespace drawn (space ␣, newline ⏎, tab ⇥, carriage return ␍; the
    empty string ∅), so a whitespace token is never a blank label."""
    return token.translate(_WHITESPACE) if token else "∅"


def _tidy_x(parent: np.ndarray) -> np.ndarray:
    """Each node's x in a tidy tree (rows in node order, ``parent`` by row, −1 for a root):
    leaves at 0, 1, 2, … in depth-first order (children in node order), every other node at
    the centre of its children's span, ``x = (x(first child) + x(last child)) / 2``. Subtrees
    hold disjoint, contiguous ranges of leaves, so a parent sits above its children and no two
    edges cross."""
    n = len(parent)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for j, p in enumerate(parent):
        (children[p] if 0 <= p < n and p != j else roots).append(j)
    x, leaf = np.zeros(n), 0
    stack = [(r, False) for r in reversed(roots)]
    while stack:  # iterative post-order: a tree can be deeper than the recursion limit
        j, done = stack.pop()
        if done:
            x[j] = (x[children[j][0]] + x[children[j][-1]]) / 2
        elif not children[j]:
            x[j], leaf = leaf, leaf + 1
        else:
            stack.append((j, True))
            stack.extend((c, False) for c in reversed(children[j]))
    return x


def _tree_figure(nodes: pl.DataFrame, dropped: list, text: list[str]) -> go.Figure:
    """The draft tree, parent above its children (:func:`_tidy_x`), depth down. Labels are the
    first 4 characters of the token with whitespace visible (:func:`_visible`; the hover has
    the whole token); within a depth, neighbours closer than 2 leaf widths put their labels on
    alternate sides (above, below) so they do not overlap."""
    import html
    depth = nodes["depth"].to_numpy()
    row = {int(n): j for j, n in enumerate(nodes["node"].to_list())}
    parent = np.array([row.get(int(p), -1) for p in nodes["parent"].to_list()], dtype=int)
    x = _tidy_x(parent)
    where = np.full(len(depth), "top center", dtype=object)
    for d in np.unique(depth):
        idx = np.flatnonzero(depth == d)
        idx = idx[np.argsort(x[idx], kind="stable")]
        for a, b in zip(idx, idx[1:]):
            if x[b] - x[a] < 2 and where[a] == "top center":
                where[b] = "bottom center"
    fig = go.Figure()
    ex, ey = [], []
    for j, p in enumerate(parent):
        if p >= 0:
            ex += [x[p], x[j], None]
            ey += [-depth[p], -depth[j], None]
    fig.add_scatter(x=ex, y=ey, mode="lines", line=dict(color="#bbb"), hoverinfo="skip",
                    showlegend=False)
    acc = nodes["accepted"].to_numpy()
    lose = np.array([bool(d) for d in dropped])
    kinds = [("accepted path", acc & ~lose, "#d62728", "circle"),
             ("accepted, loses experts at this budget", acc & lose, "#d62728", "x"),
             ("loses experts at this budget", ~acc & lose, "#ff7f0e", "circle"),
             ("other drafted nodes", ~acc & ~lose, "#1f77b4", "circle")]
    for name, sel, color, symbol in kinds:
        if not sel.any():
            continue
        hover = [f"node {n}: {html.escape(_visible(t), False)} ({html.escape(repr(t), False)})<br>"
                 f"log q {s:.2f}<br>dropped {d}" for n, t, s, d, k in
                 zip(nodes["node"], text, nodes["draft_logprob"], dropped, sel) if k]
        labels = [_visible(t) for t, k in zip(text, sel) if k]
        fig.add_scatter(x=x[sel], y=-depth[sel], mode="markers+text", name=name,
                        marker=dict(size=12, color=color, symbol=symbol),
                        text=[html.escape(t if len(t) <= 4 else t[:4] + "…", quote=False)
                              for t in labels],
                        textposition=list(where[sel]), textfont=dict(size=10, color="#222"),
                        hovertext=hover, hoverinfo="text")
    fig.update_layout(template="plotly_white", height=max(480, 80 * int(depth.max(initial=0)) + 180),
                      margin=dict(l=10, r=10, t=100, b=10),
                      title="Draft tree, parents above children (␣ space, ⏎ newline, ⇥ tab; "
                            "hover: whole token)",
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0))
    fig.update_xaxes(visible=False, title="leaves in depth-first order, parents centred")
    fig.update_yaxes(title="depth", tickvals=-np.unique(depth), ticktext=np.unique(depth),
                     range=[-depth.max(initial=0) - 0.6, 0.6])  # room for the outer labels
    return fig


def sql_console() -> None:
    ds = dataset()
    st.header("SQL console")
    st.caption("How to read this: read-only SQL (SELECT, WITH … SELECT, EXPLAIN) over the views " +
               ", ".join(ds.views) + "; hive partitions (model, bench, run) and each run's role "
               "are columns. Pick an example to start from, edit it, download the result.")
    c1, c2 = st.columns([3, 1])
    example = _url_select(c1, "Example", list(EXAMPLES), "sql_example", "example")
    scope = c2.radio("Views hold", ["evaluation runs", "all roles"], key="sql_roles",
                     help="evaluation runs: calibration runs are not pooled into results; all "
                          "roles: every run, told apart by the role column")
    roles = ("evaluation",) if scope == "evaluation runs" else ("evaluation", "calibration")
    sql = st.text_area("Query", EXAMPLES[example], height=120, key=f"sql_{example}")
    try:
        frame = pl.from_arrow(run_query(ds.con_for(roles), sql))
    except Exception as exc:  # noqa: BLE001 - show the database's message, not a traceback
        st.error(f"Query failed: {str(exc).splitlines()[0]}")
        return
    st.dataframe(frame, hide_index=True, width="stretch")
    nested = data.nested_columns(frame)
    c1, c2, c3 = st.columns(3)
    c1.download_button("Download Parquet", lambda: data.to_parquet(frame), "query.parquet",
                       "application/vnd.apache.parquet", key="sql_download_parquet")
    c2.download_button("Download JSON", lambda: frame.write_json(), "query.json",
                       "application/json", key="sql_download_json")
    c3.download_button("Download CSV", lambda: data.to_csv(frame), "query.csv", "text/csv",
                       key="sql_download", help="list and struct columns as JSON text"
                       if nested else None)
    if nested:
        st.caption("CSV cannot hold lists: in the CSV download the column(s) "
                   + ", ".join(f"`{c}`" for c in nested) + " are JSON text; Parquet and JSON "
                   "keep them as they are.")


def compare_runs() -> None:
    """Runs side by side (analysis.compare): settings diffed, key numbers, one line per run."""
    from analysis import compare
    from analysis.sql import DEFAULT_VARIANT_RULE
    from catalog import Catalog
    ds = dataset()
    st.header("Compare runs")
    st.caption("How to read this: the runs you pick, side by side as experiment trackers show "
               "them: the capture settings in which they differ, their key numbers, and the same "
               "figures with one line per run on shared axes. Nothing is pooled across runs; "
               "replay results show one variant per cell.")
    roles = _roles("cmp")
    runs = _runs(ds, roles)
    names = runs["run"].to_list()
    if len(names) < 2:
        st.info("Compare needs two or more complete runs; capture another setting, e.g. "
                "`capture --model tiny-olmoe --bench mbpp --max-new-tokens 32`.")
        st.dataframe(runs.select("model", "bench", "run", "role", "prompts"), hide_index=True)
        return
    default = names[:2]
    for (model, bench), group in runs.group_by(["model", "bench"], maintain_order=True):
        if group["setting"].n_unique() > 1:  # a dataset with several settings: those first
            default = group.unique("setting", keep="first", maintain_order=True)["run"][:2]
            default = default.to_list()
            break
    wanted = (st.query_params.get("runs") or "").split(",")
    start = [n for n in names if n in wanted] or default
    picked = st.multiselect("Runs", names, default=start, key="cmp_runs")
    st.query_params["runs"] = ",".join(picked)
    if len(picked) < 2:
        st.info("Pick two or more runs.")
        return
    found = {r.name: r for r in Catalog(ds.root).runs(names=picked, roles=None)}
    chosen = [found[n] for n in picked if n in found]
    con = ds.con_for(roles, tuple(sorted(picked)))
    st.subheader("Settings that differ")
    diff = compare.settings_diff(chosen)
    if diff.height:
        st.dataframe(diff, hide_index=True)
    else:
        st.caption("None: these runs are one experiment (their prompt ranges may differ).")
    st.subheader("Key numbers")
    st.dataframe(compare.key_numbers(con), hide_index=True)
    err = compare.errors(con)
    c1, c2 = st.columns(2)
    rankings = sorted(set(err["ranking"])) if err.height else ["router"]
    ranking = c1.selectbox("Ranking", rankings, index=rankings.index("router")
                           if "router" in rankings else 0, key="cmp_rank")
    cover = c2.selectbox("Coverage", ["truncation", "substitution"], key="cmp_cover")
    for fig in compare.compare_figures(con, ranking, cover):
        st.plotly_chart(fig, width="stretch")
    st.caption(f"Replay results: {DEFAULT_VARIANT_RULE}.")


def no_data(root, message: str) -> None:
    st.title("MoE-Spec workbench")
    st.warning(message)
    st.markdown(
        "Create data with a capture (the embedded model runs offline on a CPU):\n\n"
        f"```bash\ncapture --model tiny-olmoe --bench mbpp --limit 8 --out {root}\n```\n\n"
        "then, optionally, `replay --traces {root} --ranking router oracle --budget sweep`. "
        "This page updates when the data appears.".replace("{root}", str(root)))


# page file name (app/screens/<name>.py) -> (title, function)
PAGES = {
    "overview": ("Runs overview", overview),
    "heavy_tails": ("Heavy tails", heavy_tails),
    "coverage": ("Coverage curves", coverage),
    "growth": ("Activation growth", growth),
    "batch_regime": ("Batch regime", batch_regime),
    "coactivation": ("Co-activation", coact),
    "replay": ("Replay results", replay),
    "speedup": ("Speedup projection", speedup),
    "tree_viewer": ("Tree viewer", tree_viewer),
    "compare": ("Compare runs", compare_runs),
    "sql_console": ("SQL console", sql_console),
}
