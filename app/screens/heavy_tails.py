"""Heavy tails: how many experts hold 50 / 90 / 99% of a tree's router mass in one layer."""

from __future__ import annotations

import streamlit as st

from moe_spec.analysis import figures
from moe_spec.app import views

TITLE = "Heavy tails"
ORDER = 20


def draw() -> None:
    page = views.start_page(
        "Heavy tails", "tails",
        "How to read this: how many experts a verification tree needs to hold 50 / 90 / "
        "99% of its router mass in one layer; a curve far below N means a budget can "
        "drop most experts and keep most of the mass.")
    if page is None:
        return
    ids_only = views.ids_only_note(page.runs)
    frame = page.frame("tails")
    st.plotly_chart(views.figure(figures.heavy_tails(frame, page.n), ids_only), width="stretch")
    st.dataframe(frame, hide_index=True)


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
