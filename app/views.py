"""The dashboard's pages: selectors, then an analysis frame, then a figure. No computation of
their own beyond wiring (all numbers come from :mod:`analysis` through :mod:`app.data`).

Each page is one function here; ``app/screens/<name>.py`` calls it, so every page has its own URL
(``/coverage``, ``/tree-viewer``, …) that can be linked. Analysis pages draw evaluation runs by
default; a sidebar selector switches the role.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
import polars as pl
import streamlit as st

from analysis import coactivation, cost, figures, replay_views
from analysis.frames import (
    calibration_frame,
    frontier_frame,
    model_shape,
    real_targets,
    routing_statistics,
    speedup_frame,
)
from app import data
from catalog import partition_value

EXAMPLES = {
    "τ and experts by benchmark": "SELECT model, bench, role, avg(accepted_length) AS tau, "
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


def _dataset_picker(ds: data.Dataset, key: str, roles=("evaluation",)) -> tuple[str, str] | None:
    pairs = sorted({(r["model"], r["bench"]) for r in _runs(ds, roles).iter_rows(named=True)})
    if not pairs:
        st.info(f"No complete {' or '.join(roles)} run yet.")
        return None
    label = st.selectbox("Dataset (model / benchmark)", [f"{m} / {b}" for m, b in pairs], key=key)
    model, bench = label.split(" / ")
    return model, bench


class Page(NamedTuple):
    """What a one-dataset page works on, once the user picked roles and a dataset."""

    ds: data.Dataset
    roles: tuple[str, ...]
    model: str
    bench: str
    runs: pl.DataFrame  # the chosen roles' complete runs of this model and benchmark

    @property
    def n(self) -> int:
        return int(self.runs["num_experts"][0])

    def frame(self, name: str) -> pl.DataFrame:
        """The analysis frame ``name`` of these roles, for this dataset only."""
        return _pick(data.frame(name, str(self.ds.root), self.ds.version, self.roles),
                     self.model, self.bench)


def _page(title: str, key: str, caption: str | None = None) -> Page | None:
    """Header, the sidebar's role choice and the dataset picker every one-dataset page starts
    with; None (with a note shown) when there is nothing to draw."""
    ds = dataset()
    st.header(title)
    if caption:
        st.caption(caption)
    roles = _roles(key)
    picked = _dataset_picker(ds, f"{key}_ds", roles)
    if picked is None:
        return None
    model, bench = picked
    runs = _runs(ds, roles).filter((pl.col("model") == model) & (pl.col("bench") == bench))
    return Page(ds, roles, model, bench, runs)


def _pick(frame: pl.DataFrame, model: str, bench: str) -> pl.DataFrame:
    return frame.filter((pl.col("model") == partition_value(model)) & (pl.col("bench") == bench))


def overview() -> None:
    ds = dataset()
    st.header("Runs overview")
    frame = data.overview(str(ds.root), ds.version)
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("runs", ds.runs.height)
    c2.metric("verification trees", int(frame["trees"].sum()))
    ev = frame.filter(pl.col("role") == "evaluation")
    c3.metric("mean τ (evaluation runs)", f"{ev['tau'].mean():.2f}" if ev.height else "—")
    c4.metric("unique experts / layer / tree", f"{frame['unique_experts'].mean():.1f}")
    st.dataframe(frame, hide_index=True, width="stretch")
    storage = ds.runs.select("model", "bench", "run", "role", "storage")
    st.caption("What each run keeps of the MoE hidden states (routing, trees and nodes are "
               "always complete):")
    st.dataframe(storage, hide_index=True, width="stretch")
    st.caption(f"traces: `{ds.root}` · dataset version {ds.version}")


def heavy_tails() -> None:
    page = _page("Heavy tails", "tails")
    if page is None:
        return
    frame = page.frame("tails")
    st.plotly_chart(figures.heavy_tails(frame, page.n), width="stretch")
    st.dataframe(frame, hide_index=True)


def coverage() -> None:
    ds = dataset()
    st.header("Coverage curves")
    roles = _roles("cov")
    frame = data.frame("coverage", str(ds.root), ds.version, roles)
    if frame.height == 0:
        st.info("No routing of the chosen runs yet.")
        return
    models = sorted(set(frame["model"]))
    model = st.selectbox("Model", models, key="cov_model")
    sel = frame.filter(pl.col("model") == model)
    b = st.slider("Budget B", 1, int(sel["budget"].max()), min(32, int(sel["budget"].max())),
                  key="cov_b")
    st.plotly_chart(figures.coverage(sel, b), width="stretch")
    at = sel.filter(pl.col("budget") == b).select("bench", "coverage")
    st.write(f"Router mass held by the top-{b} experts:")
    st.dataframe(at, hide_index=True)


def growth() -> None:
    page = _page("Activation growth", "growth",
                 "Unique experts among the first t tree tokens vs MoESD's N(t) and the i.i.d. "
                 "expectation with each layer's own marginals (averaged over layers).")
    if page is None:
        return
    frame, n = page.frame("growth"), page.n
    st.plotly_chart(figures.growth(frame, n), width="stretch")
    last = frame.sort("tokens").tail(1).row(0, named=True)
    st.write(f"At {last['tokens']} tree tokens: measured {last['unique_experts']:.1f}, "
             f"i.i.d. per-layer marginals {last['marginal']:.1f}, uniform N(t) "
             f"{last['uniform']:.1f} (of {n}).")


def coact() -> None:
    page = _page("Co-activation", "coact")
    if page is None:
        return
    ds, roles, model, bench = page.ds, page.roles, page.model, page.bench
    run = page.runs.row(0, named=True)
    c1, c2, c3 = st.columns(3)
    layer = c1.selectbox("Layer", run["moe_layers"], key="coact_layer")
    convention = c2.selectbox("Convention", ["all_pairs", "adjacent"], key="coact_conv",
                              help="all pairs: joint counts; adjacent: OLMoE's adjacent-rank "
                                   "pairs, row-normalised P(b|a)")
    ordering = c3.selectbox("Ordering", ["cluster", "index"], key="coact_order")
    where = f"model = '{partition_value(model)}' AND bench = '{bench}'"
    c = coactivation.coactivation(ds.con_for(roles), int(layer), run["num_experts"], convention,
                                  where)
    order = coactivation.cluster_order(c.matrix) if ordering == "cluster" else None
    st.metric(f"concentration ({convention.replace('_', ' ')}: {c.concentration_rule})",
              f"{c.concentration:.1f}×")
    bar = "tokens with both experts" if convention == "all_pairs" else "P(b | a)"
    st.plotly_chart(figures.coactivation(c.matrix, order, f"Co-activation, layer {layer}, "
                                         f"{convention.replace('_', ' ')}, {ordering} order",
                                         bar), width="content")


def replay() -> None:
    ds = dataset()
    st.header("Replay results")
    roles = _roles("replay")
    if "replay_open" not in ds.views and "replay_closed" not in ds.views:
        st.info("No replay results yet. Run for example\n\n"
                "`replay --ranking router oracle --budget sweep`")
        return
    picked = _dataset_picker(ds, "replay_ds", roles)
    if picked is None:
        return
    n = int(_runs(ds, roles).filter(pl.col("model") == picked[0])["num_experts"][0])
    if "replay_open" in ds.views:
        curves = _pick(data.frame("errors", str(ds.root), ds.version, roles), *picked)
        rank = st.multiselect("Rankings", sorted(set(curves["ranking"])),
                              default=sorted(set(curves["ranking"])), key="replay_rank")
        curves = curves.filter(pl.col("ranking").is_in(rank))
        if curves.height:
            st.plotly_chart(figures.error_vs_budget(curves, n), width="stretch")
            if {"oracle", "router"} <= set(curves["ranking"]):
                gap = replay_views.oracle_gap(curves)
                st.plotly_chart(figures.oracle_gap(gap), width="stretch")
                if gap["saved_share"].is_nan().any():
                    st.caption("Bars marked \"beyond the sweep\": at those budgets the oracle "
                               "reaches the router's error only outside the budgets replayed.")
            steps = replay_views.ablation(curves)
            if not steps.is_empty():
                st.subheader("Where coact's gain comes from")
                st.caption(replay_views.ABLATION_NOTE)
                st.dataframe(steps, hide_index=True, column_config={
                    c: st.column_config.NumberColumn(c, format="percent")
                    for c in steps.columns[2:]})
    if "replay_closed" in ds.views:
        cl = _pick(data.frame("closed", str(ds.root), ds.version, roles), *picked)
        if cl.height:
            st.plotly_chart(figures.closed_loop(cl, n), width="stretch")
            st.dataframe(cl, hide_index=True)


def speedup() -> None:
    """The what-if: this capture's routing statistics on a real model shape and hardware."""
    page = _page("Speedup projection", "speed")
    if page is None:
        return
    ds, roles, model, bench = page.ds, page.roles, page.model, page.bench
    run = page.runs.filter(pl.col("budget").is_null())
    if run.height == 0:
        st.info("Needs a plain EAGLE capture (no budget) of this dataset.")
        return
    run = run.row(0, named=True)
    stats = routing_statistics(ds.con_for(roles), model, bench)
    captured = model_shape(run["model_location"])
    if stats is None or captured is None:
        st.warning("The model's config could not be read for the cost model.")
        return
    targets = {f"captured shape ({model})": captured, **real_targets()}
    c1, c2 = st.columns(2)
    target_name = c1.selectbox("Target model shape", list(targets), index=min(1, len(targets) - 1),
                               key="speed_target",
                               help="the capture's routing statistics (unique experts, experts "
                                    "under budget, τ under budget, as shares of N) put on this "
                                    "model's widths and depth")
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
    mode = st.radio("Cost model", ["datasheet roofline", "calibrated on this capture's timings"],
                    key="speed_m", horizontal=True)
    target = targets[target_name]
    if mode.startswith("calibrated"):
        manifest = dict(model_location=run["model_location"])
        fitted = calibration_frame(ds.con_for(roles), model, bench, manifest, hardware[0])
        if fitted is None:
            st.warning("Too few measured passes (or no readable config) to calibrate.")
            return
        frame, cal = fitted
        st.plotly_chart(figures.calibration(frame, (
            f"Calibration on {cal.points} passes ({hardware[0].name} datasheet shape): "
            f"T ≈ {cal.alpha:.3g}·T_mem + {cal.beta:.3g}·T_flop + {cal.gamma * 1e3:.3g} ms, "
            f"relative RMSE {cal.relative_rmse:.1%}")), width="stretch")
        st.caption("A calibration describes the capturing device on the captured model; it is "
                   "shown here, but projections onto other shapes and hardware use the "
                   "datasheet roofline.")
    frame = speedup_frame(stats, target, hardware, run["depth"])
    st.plotly_chart(figures.speedup(frame, f"Projected speedup on {target_name} (τ from "
                                           f"{stats['tau_source']})"), width="stretch")
    if set(frame["bound"]) == {"compute"}:
        st.info("Every verification pass here is compute-bound: the projection does not depend "
                "on memory bandwidth, only on peak FLOP/s.")
    elif set(frame["bound"]) == {"memory"} and len(hardware) > 1:
        st.caption("Every pass here is memory-bound on every profile, so the speedup is a ratio "
                   "of bytes moved and the same on each: the hardware lines coincide.")
    b = st.select_slider("Budget", sorted(set(frame["budget"].to_list())), key="speed_b")
    for row in frame.filter(pl.col("budget") == b).iter_rows(named=True):
        st.metric(f"projected speedup at B={b} on {row['hardware']}", f"{row['speedup']:.2f}×",
                  help=f"τ = {row['tau']:.2f} from {row['tau_source']}; "
                       f"{row['experts_loaded']:.1f} experts loaded per layer of the target; "
                       f"{row['bound']}-bound")
    quality_frontier(ds, roles, model, bench, target, hardware[0])


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
    page = _page("Tree viewer", "tree")
    if page is None:
        return
    ds, roles, model, bench, runs = page
    c1, c2, c3 = st.columns(3)
    run = c1.selectbox("Run", runs["run"].to_list(), key="tree_run")
    info = runs.filter(pl.col("run") == run).row(0, named=True)
    part = partition_value(model)
    con = ds.con_for(roles)
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
    table = nodes.with_columns(text=pl.Series(text), experts=rout["topk_ids"],
                               dropped_at_budget=pl.Series(dropped, dtype=pl.List(pl.Int64)))
    lost_accepted = sum(1 for a, d in zip(nodes["accepted"], dropped) if a and d)
    st.write(f"{sum(1 for d in dropped if d)} of {len(dropped)} nodes lose experts at B={budget} "
             f"({lost_accepted} of them on the accepted path); the tree touches "
             f"{len({e for t in rout['topk_ids'].to_list() for e in t})} experts in layer "
             f"{layer}.")
    st.dataframe(table, hide_index=True)


def _tree_figure(nodes: pl.DataFrame, dropped: list, text: list[str]) -> go.Figure:
    depth = nodes["depth"].to_numpy()
    parent = nodes["parent"].to_numpy()
    x = np.zeros(len(depth))
    where = np.full(len(depth), "top center", dtype=object)
    for d in np.unique(depth):  # children ordered by their parent's place: fewer crossings
        idx = np.flatnonzero(depth == d)
        idx = idx[np.lexsort((idx, x[np.maximum(parent[idx], 0)]))]
        x[idx] = np.linspace(-1, 1, len(idx)) if len(idx) > 1 else 0
        if len(idx) > 12:  # a crowded row: labels alternate above and below so they stay legible
            where[idx[1::2]] = "bottom center"
    fig = go.Figure()
    ex, ey = [], []
    for j, p in enumerate(nodes["parent"].to_list()):
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
        hover = [f"node {n}: {t!r}<br>log q {s:.2f}<br>dropped {d}" for n, t, s, d, k in
                 zip(nodes["node"], text, nodes["draft_logprob"], dropped, sel) if k]
        fig.add_scatter(x=x[sel], y=-depth[sel], mode="markers+text", name=name,
                        marker=dict(size=12, color=color, symbol=symbol),
                        text=[t.strip()[:6] for t, k in zip(text, sel) if k],
                        textposition=list(where[sel]), hovertext=hover, hoverinfo="text")
    fig.update_layout(template="plotly_white", height=480, margin=dict(l=10, r=10, t=60, b=10),
                      title="Draft tree: position across, depth down",
                      legend=dict(orientation="h", y=1.08))
    fig.update_xaxes(visible=False, title="position among the nodes of a depth")
    fig.update_yaxes(title="depth", tickvals=-np.unique(depth), ticktext=np.unique(depth))
    return fig


def sql_console() -> None:
    ds = dataset()
    st.header("SQL console")
    st.caption("Read-only: queries (SELECT, WITH … SELECT, EXPLAIN) over the views " +
               ", ".join(ds.views) + ". Hive partitions (model, bench, run) and each run's "
               "role are columns.")
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


# page file name (app/screens/<name>.py) -> (title, function)
PAGES = {
    "overview": ("Runs overview", overview),
    "heavy_tails": ("Heavy tails", heavy_tails),
    "coverage": ("Coverage curves", coverage),
    "growth": ("Activation growth", growth),
    "coactivation": ("Co-activation", coact),
    "replay": ("Replay results", replay),
    "speedup": ("Speedup projection", speedup),
    "tree_viewer": ("Tree viewer", tree_viewer),
    "sql_console": ("SQL console", sql_console),
}
