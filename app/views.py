"""The dashboard's pages: selectors, then an analysis frame, then a figure. No computation of
their own beyond wiring (all numbers come from :mod:`analysis` through :mod:`app.data`)."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl
import streamlit as st

from analysis import coactivation, cost, figures, replay_views
from analysis.frames import calibration_frame, speedup_frame
from app import data
from catalog import partition_value

EXAMPLES = {
    "τ and experts by benchmark": "SELECT model, bench, avg(accepted_length) AS tau, "
                                  "avg(list_avg(unique_experts)) AS unique_experts FROM trees "
                                  "GROUP BY ALL ORDER BY ALL",
    "Unique experts per layer (first tree)": "SELECT run, unique_experts FROM trees "
                                             "WHERE step = 0 ORDER BY run, prompt_index LIMIT 20",
    "Accepted path of one tree": "SELECT node, parent, depth, token_id, draft_logprob FROM nodes "
                                 "WHERE accepted AND step = 0 ORDER BY run, prompt_index, depth "
                                 "LIMIT 20",
    "Error vs budget (replay)": "SELECT ranking, coverage, budget, avg(rse) AS rse FROM "
                                "replay_open GROUP BY ALL ORDER BY ALL",
}


def _dataset_picker(ds: data.Dataset, key: str) -> tuple[str, str]:
    pairs = sorted({(r["model"], r["bench"]) for r in ds.evaluation.iter_rows(named=True)})
    label = st.selectbox("Dataset (model / benchmark)", [f"{m} / {b}" for m, b in pairs], key=key)
    model, bench = label.split(" / ")
    return model, bench


def _pick(frame: pl.DataFrame, model: str, bench: str) -> pl.DataFrame:
    return frame.filter((pl.col("model") == partition_value(model)) & (pl.col("bench") == bench))


def overview(ds: data.Dataset) -> None:
    st.header("Runs overview")
    frame = data.overview(str(ds.root), ds.version)
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("runs", ds.runs.height)
    c2.metric("verification trees", int(frame["trees"].sum()))
    c3.metric("mean τ", f"{frame['tau'].mean():.2f}")
    c4.metric("unique experts / layer / tree", f"{frame['unique_experts'].mean():.1f}")
    st.dataframe(frame, hide_index=True, width="stretch")
    st.caption(f"traces: `{ds.root}` · dataset version {ds.version}")


def heavy_tails(ds: data.Dataset) -> None:
    st.header("Heavy tails")
    model, bench = _dataset_picker(ds, "tails_ds")
    frame = _pick(data.frame("tails", str(ds.root), ds.version), model, bench)
    st.plotly_chart(figures.heavy_tails(frame), width="stretch")
    st.dataframe(frame, hide_index=True)


def coverage(ds: data.Dataset) -> None:
    st.header("Coverage curves")
    frame = data.frame("coverage", str(ds.root), ds.version)
    models = sorted(set(frame["model"]))
    model = st.selectbox("Model", models, key="cov_model")
    sel = frame.filter(pl.col("model") == model)
    st.plotly_chart(figures.coverage(sel), width="stretch")
    b = st.slider("Budget B", 1, int(sel["budget"].max()), min(32, int(sel["budget"].max())),
                  key="cov_b")
    at = sel.filter(pl.col("budget") == b).select("bench", "coverage")
    st.write(f"Router mass held by the top-{b} experts:")
    st.dataframe(at, hide_index=True)


def growth(ds: data.Dataset) -> None:
    st.header("Activation growth")
    st.caption("Unique experts among the first t tree tokens vs MoESD's N(t).")
    model, bench = _dataset_picker(ds, "growth_ds")
    frame = _pick(data.frame("growth", str(ds.root), ds.version), model, bench)
    st.plotly_chart(figures.growth(frame), width="stretch")
    last = frame.sort("tokens").tail(1).row(0, named=True)
    st.write(f"At {last['tokens']} tree tokens: measured {last['unique_experts']:.1f}, "
             f"i.i.d. marginals {last['marginal']:.1f}, uniform N(t) {last['uniform']:.1f}.")


def coact(ds: data.Dataset) -> None:
    st.header("Co-activation")
    model, bench = _dataset_picker(ds, "coact_ds")
    run = ds.evaluation.filter((pl.col("model") == model) & (pl.col("bench") == bench)).row(
        0, named=True)
    c1, c2, c3 = st.columns(3)
    layer = c1.selectbox("Layer", run["moe_layers"], key="coact_layer")
    convention = c2.selectbox("Convention", ["all_pairs", "adjacent"], key="coact_conv",
                              help="all pairs: joint counts; adjacent: OLMoE's adjacent-rank "
                                   "pairs, row-normalised P(b|a)")
    ordering = c3.selectbox("Ordering", ["cluster", "index"], key="coact_order")
    where = f"model = '{partition_value(model)}' AND bench = '{bench}'"
    c = coactivation.coactivation(ds.con, int(layer), run["num_experts"], convention, where)
    order = coactivation.cluster_order(c.matrix) if ordering == "cluster" else None
    conc = coactivation.coactivation(ds.con, int(layer), run["num_experts"], "all_pairs", where)
    st.metric("concentration (max pair / uniform expectation)", f"{conc.concentration:.1f}×")
    st.plotly_chart(figures.coactivation(c.matrix, order, f"layer {layer}, {convention}, "
                                         f"{ordering} order"), width="stretch")


def replay(ds: data.Dataset) -> None:
    st.header("Replay results")
    if "replay_open" not in ds.views and "replay_closed" not in ds.views:
        st.info("No replay results yet. Run for example\n\n"
                "`replay --ranking router oracle --budget sweep`")
        return
    model, bench = _dataset_picker(ds, "replay_ds")
    if "replay_open" in ds.views:
        curves = _pick(data.frame("errors", str(ds.root), ds.version), model, bench)
        rank = st.multiselect("Rankings", sorted(set(curves["ranking"])),
                              default=sorted(set(curves["ranking"])), key="replay_rank")
        curves = curves.filter(pl.col("ranking").is_in(rank))
        if curves.height:
            st.plotly_chart(figures.error_vs_budget(curves), width="stretch")
            if {"oracle", "router"} <= set(curves["ranking"]):
                st.plotly_chart(figures.oracle_gap(replay_views.oracle_gap(curves)),
                                width="stretch")
    if "replay_closed" in ds.views:
        cl = _pick(data.frame("closed", str(ds.root), ds.version), model, bench)
        if cl.height:
            st.plotly_chart(figures.closed_loop(cl), width="stretch")
            st.dataframe(cl, hide_index=True)


def speedup(ds: data.Dataset) -> None:
    st.header("Speedup projection")
    model, bench = _dataset_picker(ds, "speed_ds")
    run = ds.evaluation.filter((pl.col("model") == model) & (pl.col("bench") == bench)
                               & pl.col("budget").is_null())
    if run.height == 0:
        st.info("Needs a plain EAGLE capture (no budget) of this dataset.")
        return
    run = run.row(0, named=True)
    profile = st.selectbox("Hardware", [*cost.PROFILES, "custom"], key="speed_hw")
    if profile == "custom":
        c1, c2 = st.columns(2)
        hw = cost.custom(c1.number_input("bandwidth TB/s", 0.1, 20.0, 3.35, key="speed_bw"),
                         c2.number_input("peak TFLOP/s", 1.0, 5000.0, 989.0, key="speed_tf"))
    else:
        hw = cost.PROFILES[profile]
    manifest = dict(model_location=run["model_location"], draft=run["draft"],
                    settings=dict(depth=run["depth"]))
    frame = speedup_frame(ds.con, model, bench, manifest, [hw])
    if frame is None:
        st.warning("The model's config could not be read for the cost model.")
        return
    st.plotly_chart(figures.speedup(frame), width="stretch")
    b = st.select_slider("Budget", frame["budget"].to_list(), key="speed_b")
    row = frame.filter(pl.col("budget") == b).row(0, named=True)
    st.metric(f"projected speedup at B={b} on {hw.name}", f"{row['speedup']:.2f}×",
              help=f"τ = {row['tau']:.2f} from {row['tau_source']}")
    mode = st.radio("Model", ["datasheet", "calibrated on this capture's timings"], key="speed_m",
                    horizontal=True)
    if mode != "datasheet":
        fitted = calibration_frame(ds.con, model, bench, manifest, hw)
        if fitted is None:
            st.warning("Too few measured passes (or no readable config) to calibrate.")
            return
        cal = fitted[1]
        st.write(f"Fit T ≈ {cal.alpha:.3g}·T_mem + {cal.beta:.3g}·T_flop + {cal.gamma * 1e3:.3g} ms "
                 f"over {cal.points} passes: relative RMSE {cal.relative_rmse:.1%}, "
                 f"R² {cal.r2:.3f}. (Timings are those of the capturing device.)")


def tree_viewer(ds: data.Dataset) -> None:
    st.header("Tree viewer")
    model, bench = _dataset_picker(ds, "tree_ds")
    runs = ds.evaluation.filter((pl.col("model") == model) & (pl.col("bench") == bench))
    c1, c2, c3 = st.columns(3)
    run = c1.selectbox("Run", runs["run"].to_list(), key="tree_run")
    info = runs.filter(pl.col("run") == run).row(0, named=True)
    part = partition_value(model)
    steps = ds.con.execute(f"""SELECT prompt_index, max(step) FROM trees WHERE run = '{run}'
                               AND model = '{part}' AND bench = '{bench}' GROUP BY ALL
                               ORDER BY 1""").fetchall()
    prompt = c2.selectbox("Prompt", [p for p, _ in steps], key="tree_prompt")
    step = c3.number_input("Step", 0, dict(steps)[prompt], 0, key="tree_step")
    c4, c5 = st.columns(2)
    layer = c4.selectbox("Layer", info["moe_layers"], key="tree_layer")
    budget = c5.slider("Budget B (router ranking)", 1, info["num_experts"],
                       min(info["num_experts"], max(info["top_k"], info["num_experts"] // 2)),
                       key="tree_budget")
    cond = (f"run = '{run}' AND model = '{part}' AND bench = '{bench}' AND prompt_index = "
            f"{int(prompt)} AND step = {int(step)}")
    nodes = ds.con.sql(f"SELECT node, parent, depth, token_id, draft_logprob, accepted "
                           f"FROM nodes WHERE {cond} ORDER BY node").pl()
    rout = ds.con.sql(f"SELECT node, router_probs, topk_ids FROM routing WHERE {cond} AND "
                          f"layer = {int(layer)} ORDER BY node").pl()
    probs = np.stack(rout["router_probs"].to_list())
    shortlist = set(np.argsort(-probs.sum(0), kind="stable")[:budget].tolist())
    dropped = [sorted(set(t) - shortlist) for t in rout["topk_ids"].to_list()]
    st.plotly_chart(_tree_figure(nodes, dropped), width="stretch")
    table = nodes.with_columns(experts=rout["topk_ids"],
                               dropped_at_budget=pl.Series(dropped, dtype=pl.List(pl.Int64)))
    st.write(f"{sum(1 for d in dropped if d)} of {len(dropped)} nodes lose experts at B={budget}; "
             f"the tree touches {len({e for t in rout['topk_ids'].to_list() for e in t})} "
             f"experts in layer {layer}.")
    st.dataframe(table, hide_index=True)


def _tree_figure(nodes: pl.DataFrame, dropped: list) -> go.Figure:
    depth = nodes["depth"].to_numpy()
    parent = nodes["parent"].to_numpy()
    x = np.zeros(len(depth))
    for d in np.unique(depth):  # children ordered by their parent's place: fewer crossings
        idx = np.flatnonzero(depth == d)
        idx = idx[np.lexsort((idx, x[np.maximum(parent[idx], 0)]))]
        x[idx] = np.linspace(-1, 1, len(idx)) if len(idx) > 1 else 0
    fig = go.Figure()
    ex, ey = [], []
    for j, p in enumerate(nodes["parent"].to_list()):
        if p >= 0:
            ex += [x[p], x[j], None]
            ey += [-depth[p], -depth[j], None]
    fig.add_scatter(x=ex, y=ey, mode="lines", line=dict(color="#bbb"), hoverinfo="skip",
                    showlegend=False)
    acc = nodes["accepted"].to_numpy()
    colors = np.where(acc, "#d62728", np.where([bool(d) for d in dropped], "#ff7f0e", "#1f77b4"))
    text = [f"node {n}<br>token {t}<br>log q {s:.2f}<br>dropped {d}" for n, t, s, d in
            zip(nodes["node"], nodes["token_id"], nodes["draft_logprob"], dropped)]
    fig.add_scatter(x=x, y=-depth, mode="markers", marker=dict(size=11, color=colors),
                    text=text, hoverinfo="text", showlegend=False)
    fig.update_layout(template="plotly_white", height=420, margin=dict(l=10, r=10, t=30, b=10),
                      title="red: accepted path · orange: loses experts at this budget")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(title="depth", tickvals=-np.unique(depth), ticktext=np.unique(depth))
    return fig


def sql_console(ds: data.Dataset) -> None:
    st.header("SQL console")
    st.caption("Views: " + ", ".join(ds.views) + ". Hive partitions (model, bench, run) are "
               "columns.")
    example = st.selectbox("Example", list(EXAMPLES), key="sql_example")
    sql = st.text_area("Query", EXAMPLES[example], height=120, key=f"sql_{example}")
    try:
        frame = data.query(str(ds.root), ds.version, sql)
    except Exception as exc:  # noqa: BLE001 - show the database's message, not a traceback
        st.error(f"Query failed: {str(exc).splitlines()[0]}")
        return
    st.dataframe(frame, hide_index=True, width="stretch")
    st.download_button("Download CSV", frame.write_csv(), "query.csv", "text/csv",
                       key="sql_download")


def no_data(root, message: str) -> None:
    st.title("MoE-Spec workbench")
    st.warning(message)
    st.markdown(
        "Create data with a capture (the embedded model runs offline on a CPU):\n\n"
        f"```bash\ncapture --model tiny-olmoe --bench mbpp --limit 8 --out {root}\n```\n\n"
        "then, optionally, `replay --traces {root} --ranking router oracle --budget sweep`. "
        "This page updates when the data appears.".replace("{root}", str(root)))


PAGES = {
    "Runs overview": overview,
    "Heavy tails": heavy_tails,
    "Coverage curves": coverage,
    "Activation growth": growth,
    "Co-activation": coact,
    "Replay results": replay,
    "Speedup projection": speedup,
    "Tree viewer": tree_viewer,
    "SQL console": sql_console,
}
