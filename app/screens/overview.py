"""The runs overview: one row per complete run, τ and unique experts, what each run keeps."""

from __future__ import annotations

import polars as pl
import streamlit as st

from analysis.frames import routing_warnings
from app import data, views

TITLE = "Runs overview"
ORDER = 10


def draw() -> None:
    ds = views.dataset()
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


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
