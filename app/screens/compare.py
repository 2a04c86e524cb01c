"""Compare runs: the runs you pick side by side (analysis.compare)."""

from __future__ import annotations

import streamlit as st

from moe_spec.app import views

TITLE = "Compare runs"
ORDER = 100


def draw() -> None:
    """Runs side by side (analysis.compare): settings diffed, key numbers, one line per run."""
    from moe_spec.analysis import compare
    from moe_spec.analysis.sql import DEFAULT_VARIANT_RULE
    from moe_spec.catalog import Catalog
    ds = views.dataset()
    st.header("Compare runs")
    st.caption("How to read this: the runs you pick, side by side as experiment trackers show "
               "them: the capture settings in which they differ, their key numbers, and the same "
               "figures with one line per run on shared axes. Nothing is pooled across runs; "
               "replay results show one whole variant per curve.")
    roles = views.role_choice("cmp")
    runs = views.role_runs(ds, roles)  # routing-only imports too: ids-only figures side by side
    names = runs["run"].to_list()
    if len(names) < 2:
        st.info("Compare needs two or more complete runs; capture another setting, e.g. "
                "`capture --model tiny-olmoe --bench mbpp --max-new-tokens 32`.")
        st.dataframe(runs.select("model", "bench", "run", "role", "prompts"), hide_index=True)
        return
    default = names[:2]
    for (model, bench), group in runs.group_by(["model", "bench"], maintain_order=True):
        if group["setting"].n_unique() > 1:  # a dataset with several settings: those first
            default = group.unique("setting", keep="first", maintain_order=True)["run"][:2]
            default = default.to_list()
            break
    wanted = (st.query_params.get("runs") or "").split(",")
    start = [n for n in names if n in wanted] or default
    picked = st.multiselect("Runs", names, default=start, key="cmp_runs")
    st.query_params["runs"] = ",".join(picked)
    if len(picked) < 2:
        st.info("Pick two or more runs.")
        return
    found = {r.name: r for r in Catalog(ds.root).runs(names=picked, roles=None, kinds=None)}
    chosen = [found[n] for n in picked if n in found]
    variants = views.variant_picker(ds, roles, tuple(sorted(picked)), "cmp_variant")
    con = ds.con_for(roles, tuple(sorted(picked)), variants)
    st.subheader("Settings that differ")
    diff = compare.settings_diff(chosen)
    if diff.height:
        st.dataframe(diff, hide_index=True)
    else:
        st.caption("None: these runs are one experiment (their prompt ranges may differ).")
    st.subheader("Key numbers")
    st.dataframe(compare.key_numbers(con), hide_index=True)
    err = compare.errors(con)
    c1, c2 = st.columns(2)
    rankings = sorted(set(err["ranking"])) if err.height else ["router"]
    ranking = c1.selectbox("Ranking", rankings, index=rankings.index("router")
                           if "router" in rankings else 0, key="cmp_rank")
    cover = c2.selectbox("Coverage", ["truncation", "substitution"], key="cmp_cover")
    for fig in compare.compare_figures(con, ranking, cover, runs=picked):
        st.plotly_chart(fig, width="stretch")
    ids_figs = compare.ids_figures(chosen)  # an import beside the capture it came from
    if ids_figs:
        st.subheader("Ids only: the runs' top-k expert ids side by side")
        st.caption(compare.IDS_NOTE)
        for fig in ids_figs:
            st.plotly_chart(fig, width="stretch")
    missing = compare.left_out(con, picked, ranking, cover)
    if missing:
        st.caption(f"Left out of the error figure: run(s) {', '.join(missing)} (no open-loop "
                   f"replay of {ranking}, {cover}). Each run keeps its colour in every figure.")
    st.caption(f"Replay results: {DEFAULT_VARIANT_RULE}.")


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
