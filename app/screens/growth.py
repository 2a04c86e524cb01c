"""Activation growth: unique experts among a tree's first t tokens vs MoESD's N(t)."""

from __future__ import annotations

import streamlit as st

from moe_spec.analysis import figures
from moe_spec.app import views

TITLE = "Activation growth"
ORDER = 40


def draw() -> None:
    page = views.start_page(
        "Activation growth", "growth",
        "How to read this: unique experts among the first t tree tokens vs MoESD's "
        "N(t) and the i.i.d. expectation with each layer's own marginals (averaged over "
        "layers); a measured curve below them means trees reuse experts.")
    if page is None:
        return
    ids_only = views.ids_only_note(page.runs)
    frame, n = page.frame("growth"), page.n
    if frame.is_empty():
        st.info("No routing summaries for these runs yet.")
        return
    st.plotly_chart(views.figure(figures.growth(frame, n), ids_only), width="stretch")
    last = frame.sort("tokens").tail(1).row(0, named=True)
    unit = "batch-pass tokens" if ids_only else "tree tokens"
    st.write(f"At {last['tokens']} {unit}: measured {last['unique_experts']:.1f}, "
             f"i.i.d. per-layer marginals {last['marginal']:.1f}, uniform N(t) "
             f"{last['uniform']:.1f} (of {n}).")


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
