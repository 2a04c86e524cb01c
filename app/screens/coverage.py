"""Coverage curves: the share of a tree's router mass its B most-used experts hold."""

from __future__ import annotations

import polars as pl
import streamlit as st

from analysis import figures
from app import data, views

TITLE = "Coverage curves"
ORDER = 30


def draw() -> None:
    ds = views.dataset()
    st.header("Coverage curves")
    st.caption("How to read this: the share of a tree's router mass held by its B most-used "
               "experts, per benchmark; the dotted diagonal is uniform routing (B/N), and the "
               "higher a curve sits above it, the more a budget of B keeps.")
    roles = views.role_choice("cov")
    frame = data.frame("coverage", str(ds.root), ds.version, roles)
    if frame.height == 0:
        st.info("No routing of the chosen runs yet.")
        return
    models = sorted(set(frame["model"]))
    model = views.url_select(st, "Model", models, "cov_model", "model")
    sel = frame.filter(pl.col("model") == model)
    b = st.slider("Budget B", 1, int(sel["budget"].max()), min(32, int(sel["budget"].max())),
                  key="cov_b")
    st.plotly_chart(figures.coverage(sel, b), width="stretch")
    at = sel.filter(pl.col("budget") == b).select("bench", "coverage")
    st.write(f"Router mass held by the top-{b} experts:")
    st.dataframe(at, hide_index=True)


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
