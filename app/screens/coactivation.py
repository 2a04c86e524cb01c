"""Co-activation: how often two experts of one layer serve the same token, against
independent picks."""

from __future__ import annotations

import streamlit as st

from moe_spec.analysis import coactivation, figures
from moe_spec.app import views
from moe_spec.catalog import partition_value

TITLE = "Co-activation"
ORDER = 60


def draw() -> None:
    page = views.start_page(
        "Co-activation", "coact",
        "How to read this: how often two experts of one layer are picked for the same "
        "token, against independent picks; bright blocks are experts that travel "
        "together, which a co-activation-aware budget keeps together.")
    if page is None:
        return
    model, bench = page.model, page.bench
    ids_only = views.ids_only_note(page.runs)
    run = page.runs.row(0, named=True)
    c1, c2, c3 = st.columns(3)
    layer = views.url_select(c1, "Layer", run["moe_layers"], "coact_layer", "layer")
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
    c = coactivation.coactivation(page.con, int(layer), run["num_experts"], convention,
                                  dict(model=partition_value(model), bench=bench))
    order = coactivation.cluster_order(c.matrix) if ordering == "cluster" else None
    st.metric(f"concentration ({convention.replace('_', ' ')}: {c.concentration_rule})",
              f"{c.concentration:.1f}×")
    bar = "tokens with both experts" if convention == "all_pairs" else "P(b | a)"
    lift = colour.startswith("lift")
    st.plotly_chart(views.figure(figures.coactivation(
        c.matrix, order, f"Co-activation, layer {layer}, {convention.replace('_', ' ')}, "
        f"{'lift over independent selection' if lift else 'observed'}, {ordering} order", bar,
        lift=c.lift if lift else None), ids_only), width="content")
    if lift:
        st.caption("Lift: the pair's count over the count expected if each expert were picked "
                   "independently with its own measured frequency (1 = independent; red above, "
                   "blue below). Light grey: never seen together (no count, so no lift: not "
                   "avoidance); experts never selected with another in this layer are left out "
                   "(named under the plot). Dark grey: the diagonal (an expert with itself), "
                   "masked. Ids too dense to read are ticked every k-th (the hover names every "
                   "cell); zoom (drag a box) for a block.")
    else:
        st.caption("Light grey: never seen together (not the bottom of the scale); dark grey: the "
                   "diagonal (an expert with itself), masked; experts never selected with "
                   "another are left out (named under the plot). Zoom (drag a box) for a block.")


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
