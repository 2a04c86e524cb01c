"""Replay results: what each ranking's choice of B experts costs, open and closed loop."""

from __future__ import annotations

import polars as pl
import streamlit as st

from moe_spec.analysis import figures, frames, replay_views
from moe_spec.analysis.sql import results_per_run
from moe_spec.app import data, views
from moe_spec.catalog.replay_metrics import CLOSED_TABLE, OPEN_TABLE

TITLE = "Replay results"
ORDER = 70


def draw() -> None:
    ds = views.dataset()
    st.header("Replay results")
    st.caption("How to read this: replay re-runs the captured MoE layers with only B experts "
               "per layer allowed; the error (relative squared error of the MoE output, open "
               "loop) or the share of unchanged tree paths (closed loop) says what each ranking's "
               "choice of B experts costs. Lower error at a smaller B is better.")
    roles = views.role_choice("replay")
    if OPEN_TABLE not in ds.views and CLOSED_TABLE not in ds.views:
        st.info("No replay results yet. Run for example\n\n"
                f"`replay --traces {ds.root} --ranking router oracle --budget sweep`")
        return
    have = {name: data.frame(name, str(ds.root), ds.version, roles)
            for name in ("errors", "closed")}
    pool = views.with_trees(views.role_runs(ds, roles))  # routing-only runs: nothing to replay
    picked = views.dataset_picker(ds, "replay_ds", roles, views.datasets_in(have["errors"], ds)
                                  | views.datasets_in(have["closed"], ds), runs=pool)
    if picked is None:
        return
    runs = views.setting_picker(pool.filter(
        (pl.col("model") == picked[0]) & (pl.col("bench") == picked[1])), "replay_setting",
        results=results_per_run(ds.con_for(roles)))  # open on a setting with results
    names = tuple(sorted(runs["run"].to_list()))
    n = int(runs["num_experts"][0])
    chosen = views.variant_picker(ds, roles, names, "replay_variant")
    have = {name: data.frame(name, str(ds.root), ds.version, roles, names, chosen)
            for name in ("errors", "closed")}
    curves = views.pick(have["errors"], *picked) if have["errors"].height else have["errors"]
    cl = views.pick(have["closed"], *picked) if have["closed"].height else have["closed"]
    if curves.is_empty() and cl.is_empty():
        st.info(f"No replay results for {picked[0]} / {picked[1]} yet. Produce them with\n\n"
                f"`replay --traces {ds.root} --model {picked[0]} --bench {picked[1]} "
                "--ranking router oracle --budget sweep`")
        return
    if curves.height:
        rank = views.url_multiselect("Rankings", sorted(set(curves["ranking"])), "replay_rank",
                                     "ranking")
        curves = curves.filter(pl.col("ranking").is_in(rank))
        fixed = replay_views.fixed_only(curves)
        if fixed.height:
            st.plotly_chart(figures.error_vs_budget(fixed, n), width="stretch")
        if curves.height and set(curves["budget_mode"]) != {replay_views.FIXED}:
            _fixed_vs_adaptive(curves, n)
        if fixed.height:
            if {"oracle", "router"} <= set(fixed["ranking"]):
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
    saved = [data.frame(name, str(ds.root), ds.version, roles, names, chosen)
             for name in ("saved_open", "saved_closed")]
    saved = [f for f in (views.pick(f, *picked) for f in saved if f.height) if f.height]
    if saved:
        st.subheader("Experts saved at matched quality vs router")
        charges = frames.selection_charges(dict(model_location=runs["model_location"][0]),
                                           picked[0])  # a ranking's own bytes, per shape
        table = replay_views.experts_saved_display(pl.concat(saved), charges)
        nets = [c for c in table.columns if c.startswith("net, ")]
        st.caption(replay_views.SAVED_NOTE + (" " + replay_views.NET_NOTE if nets else ""))
        st.dataframe(table, hide_index=True,
                     column_config={c: st.column_config.NumberColumn(c, format="percent")
                                    for c in ("saved", "saved_lo", "saved_hi", *nets)})


def _fixed_vs_adaptive(curves: pl.DataFrame, n: int) -> None:
    """Error against the mean experts loaded per layer, a curve per budget mode (never two modes
    averaged), and per adaptive mode the mean budget asked beside the mean loaded."""
    st.subheader("Fixed vs adaptive budgets at the same mean experts per layer")
    st.plotly_chart(figures.error_vs_experts(curves, n), width="stretch")
    st.dataframe(curves.filter(pl.col("budget_mode") != replay_views.FIXED).select(
        "ranking", "coverage", "budget_mode", pl.col("budget").alias("mean budget asked B̄"),
        pl.col("experts_loaded").alias("mean experts loaded"), "rse", "tree_layers"
    ).sort("ranking", "coverage", "budget_mode", "mean budget asked B̄"), hide_index=True)


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
