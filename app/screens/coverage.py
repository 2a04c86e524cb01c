"""Coverage curves: the share of a tree's router mass its B most-used experts hold."""

from __future__ import annotations

import polars as pl
import streamlit as st

from moe_spec.analysis import figures
from moe_spec.app import data, views
from moe_spec.catalog import partition_value

TITLE = "Coverage curves"
ORDER = 30


def draw() -> None:
    ds = views.dataset()
    st.header("Coverage curves")
    st.caption("How to read this: the share of a tree's router mass held by its B most-used "
               "experts, per benchmark; the dotted diagonal is uniform routing (B/N), and the "
               "higher a curve sits above it, the more a budget of B keeps.")
    roles = views.role_choice("cov")
    every = views.role_runs(ds, roles)
    models = sorted(set(every["model"]))
    if not models:
        st.info("No routing of the chosen runs yet.")
        return
    model = views.url_select(st, "Model", models, "cov_model", "model")
    runs = views.setting_picker(every.filter(pl.col("model") == model), "cov_setting")
    ids_only = views.ids_only_note(runs)
    names = tuple(sorted(runs["run"].to_list()))
    frame = data.frame("coverage", str(ds.root), ds.version, roles, names)
    sel = frame.filter(pl.col("model") == partition_value(model)) if frame.height else frame
    if sel.height == 0:
        st.info("No routing of the chosen runs yet.")
        return
    b = st.slider("Budget B", 1, int(sel["budget"].max()), min(32, int(sel["budget"].max())),
                  key="cov_b")
    st.plotly_chart(views.figure(figures.coverage(sel, b), ids_only), width="stretch")
    at = sel.filter(pl.col("budget") == b).select("bench", "coverage")
    st.write(f"{'Routed-token counts' if ids_only else 'Router mass'} held by the top-{b} "
             "experts:")
    st.dataframe(at, hide_index=True)
    if ids_only:
        _truncation(ds, runs)


def _truncation(ds, runs: pl.DataFrame) -> None:
    """Routing-only runs: the share of token-expert assignments static and frequency budgets
    drop (analysis.ids.truncation), one figure per run."""
    st.subheader("Truncation coverage of static and frequency budgets")
    st.caption("Static S: the run's top-B experts by selection count (in-sample); frequency S: "
               "each batch pass's own top-B by count, what a runtime shortlist of counts keeps. "
               "Lower is better: the share of token-expert assignments outside S.")
    for run in runs.iter_rows(named=True):
        rows = data.truncation(str(ds.root), ds.version, run["model"], run["bench"], run["run"])
        if rows.is_empty():
            continue
        st.plotly_chart(figures.truncation_coverage(rows, int(run["num_experts"])),
                        width="stretch", key=f"cov_trunc_{run['bench']}_{run['run']}")
        mean = rows.group_by("budget").agg(pl.col("static_outside").mean(),
                                           pl.col("frequency_outside").mean()).sort("budget")
        st.dataframe(mean.with_columns(pl.lit(run["run"]).alias("run")), hide_index=True)


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
