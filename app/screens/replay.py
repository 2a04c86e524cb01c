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
        _closed_table(cl)
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
        views.words_table(table, percent=("saved", "saved_lo", "saved_hi", *nets))


def _fixed_vs_adaptive(curves: pl.DataFrame, n: int) -> None:
    """Error against the mean experts loaded per layer, a curve per budget mode (never two modes
    averaged), and per adaptive mode the mean budget asked beside the mean loaded and the price
    λ calibrated for it."""
    st.subheader("Fixed vs adaptive budgets at the same mean experts per layer")
    st.plotly_chart(figures.error_vs_experts(curves, n), width="stretch")
    st.dataframe(curves.filter(pl.col("budget_mode") != replay_views.FIXED).select(
        "ranking", "coverage", pl.col("budget_mode").alias("budget mode"),
        pl.col("budget").alias("mean budget asked B̄"),
        pl.col("experts_loaded").alias("mean experts loaded"), pl.col("price").alias("price λ"),
        "rse", "tree_layers"
    ).sort("ranking", "coverage", "budget mode", "mean budget asked B̄"), hide_index=True,
        column_config={"mean experts loaded": st.column_config.NumberColumn(format="%.2f"),
                       "price λ": st.column_config.NumberColumn(format="%.4g"),
                       "rse": st.column_config.NumberColumn(format="%.4g")})
    st.caption("An adaptive mode's B̄ is the mean budget asked; each tree-layer's B is chosen by "
               "the price rule (load the next expert while its predicted gain exceeds λ, "
               "calibrated on the calibration run so that the mean there is B̄): the mean "
               "experts loaded here is what B̄ achieved on these prompts.")


def _closed_table(cl: pl.DataFrame) -> None:
    """The closed-loop results as read beside the figure: per ranking × coverage × mode × budget,
    τ with its 95% interval, the captured τ of the same trees, paths unchanged, top-1, KL, mean
    experts loaded and an adaptive budget's price λ (model and benchmark are the page's)."""
    from moe_spec.analysis.frames import budget_letter, price_text
    views.words_table([{
        "ranking": r["ranking"], "coverage": r["coverage"], "budget mode": r["budget_mode"],
        "budget": f"{budget_letter(r['budget_mode'])} = {r['budget']}",
        "mean experts loaded": f"{r['experts_loaded']:.2f}",
        "price λ": price_text(r["budget_mode"], r.get("price")),
        "τ (95% CI)": f"{r['tau']:.2f} " + (
            f"({r['tau_lo']:.2f}–{r['tau_hi']:.2f})" if _finite(r["tau_lo"], r["tau_hi"])
            else "(no interval: fewer than 2 trees)"),
        "captured τ": r["tau_captured"], "path unchanged": r["path_unchanged"],
        "top-1 agreement": r["top1"], "KL": r["kl"], "trees": r["trees"]}
        for r in cl.sort("ranking", "coverage", pl.col("budget_mode") != replay_views.FIXED,
                         "budget_mode", "budget").iter_rows(named=True)],
        percent=("path unchanged", "top-1 agreement"))


def _finite(*values) -> bool:
    return all(v is not None and v == v for v in values)


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
