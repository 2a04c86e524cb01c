"""The batch regime: the union of b trees' experts a verification pass loads, budgets
shared by a batch, and profile-batch's measured speedups."""

from __future__ import annotations

import polars as pl
import streamlit as st

from moe_spec.analysis import cost, figures
from moe_spec.analysis.frames import batch_fit, batch_projection, real_targets
from moe_spec.app import data, views

TITLE = "Batch regime"
ORDER = 50


def draw() -> None:
    page = views.start_page(
        "Batch regime", "batch",
        "How to read this: each point is the mean over verification passes that verified "
        "b sequences' trees at once (capture --batch-size b); the union of their experts "
        "is what a pass loads. MoESD's argument: as b grows the union saturates at N, so "
        "extra tokens come nearly free until compute takes over.",
        prefer=lambda ds, roles: views.datasets_in(
            data.frame("batch", str(ds.root), ds.version, roles), ds),
        across=("batch_size",), trees=True)  # runs that differ only in b: the page's x axis
    if page is None:
        return
    frame, n = page.frame("batch"), page.n
    if frame.height == 0:
        st.info("No unbudgeted verification passes here; capture with `capture --batch-size 4`.")
        return
    st.plotly_chart(figures.batch_regime(frame, n), width="stretch")
    table = frame.select(
        pl.col("batch_size").alias("b"), pl.col("tokens").alias("tokens a pass (b·M)"),
        pl.col("unique_experts").round(1).alias("unique experts / layer (measured)"),
        pl.col("uniform").round(1).alias("MoESD uniform N(b·M)"),
        (pl.col("seconds") * 1e3).round(2).alias("verify ms (median)"), "passes")
    st.dataframe(table, hide_index=True)
    if frame["batch_size"].n_unique() >= 2:
        from moe_spec.analysis import warmup
        from moe_spec.analysis.frames import capture_batch_fit
        fit = capture_batch_fit(page.con, page.model, page.bench)
        coef = fit["coef"] if fit else None
        rule = f"{fit['dropped'] if fit else 0} passes dropped by the {warmup.RULE}"
        if coef is None or coef["refused"]:
            st.warning(f"MoESD's pass-time model {coef['refused'] if coef else 'not fitted'} "
                       f"({rule}).")
        else:
            left = f"; left out: {', '.join(coef['left_out'])}" if coef["left_out"] else ""
            st.write(f"MoESD's pass-time model fitted to these passes: T = {coef['c0'] * 1e3:.2f} "
                     f"ms + {coef['c1'] * 1e3:.3f} ms × E(b·M) + {coef['c2'] * 1e3:.4f} ms × b·M,"
                     f" relative RMSE {coef['relative_rmse']:.1%} over {coef['points']} batch "
                     f"sizes ({rule}{left}).")
    else:
        st.caption("Capture at two or more batch sizes to fit MoESD's pass-time model here.")
    _batch_errors(page)
    _batch_speed(page)
    st.caption("Budgets across a batch: `capture --batch-size b --budget B` caps the union over "
               "the whole pass; `replay --batch-size b` replays every ranking's budget over "
               "each pass's union; `python bench/batch_regime.py` tabulates both.")


def _batch_errors(page: views.Page) -> None:
    """RSE vs B with one shortlist per (virtual) batch pass, per b (replay --batch-size)."""
    every = data.frame("batch_errors", str(page.ds.root), page.ds.version, page.roles)
    errors = views.pick(every, page.model, page.bench) if every.height else every
    st.subheader("A budget shared by a batch's trees")
    if errors.height == 0 or errors["batch_size"].max() == 1:
        st.caption("Not replayed over batches yet: `replay --batch-size 4 --ranking router coact "
                   "oracle --budget sweep` gives each pass of 4 trees one shortlist (virtual "
                   "batches of b = 1 captures: same decoding step, grouped by --batch-seed).")
        return
    cover = st.radio("coverage", sorted(set(errors["coverage"])), horizontal=True,
                     key="batch_cover")
    shown = errors.filter(pl.col("coverage") == cover)
    st.plotly_chart(figures.batch_errors(shown, page.n), width="stretch")
    st.dataframe(shown.select(
        pl.col("batch_size").alias("b"), "ranking", pl.col("budget").alias("B"),
        pl.col("rse").round(4).alias("mean RSE"),
        pl.col("trees").round(2).alias("trees a pass"),
        pl.col("experts_loaded").round(1).alias("experts loaded")), hide_index=True)


def _batch_speed(page: views.Page) -> None:
    """profile-batch's measured speedup vs b, with MoESD's fit and a roofline projection."""
    every = data.frame("batch_speed", str(page.ds.root), page.ds.version, page.roles)
    speed = views.pick(every, page.model, page.bench) if every.height else every
    st.subheader("Speedup over autoregressive decoding vs b")
    if speed.height == 0:
        st.caption("Not measured for this dataset: `profile-batch --model … --bench … "
                   "--batch-sizes 1,2,4,8,16 --budget 16` decodes the same prompts b at a time "
                   "autoregressively and with EAGLE, with and without a budget.")
        return
    runs = speed["run"].unique(maintain_order=True).to_list()
    run = runs[-1] if len(runs) == 1 else st.selectbox("profile run", runs, key="batch_run")
    speed = speed.filter(pl.col("run") == run)
    with data.pristine(str(page.ds.root), None) as con:
        fit = batch_fit(con, page.model, page.bench, run, speed)
    targets = real_targets()
    left, right = st.columns(2)
    shape_name = left.selectbox("roofline projection for", list(targets), key="batch_shape")
    hw_name = right.selectbox("on", list(cost.PROFILES), key="batch_hw")
    target = targets[shape_name]
    gamma = fit["gamma"] if fit else 63
    projection = batch_projection(speed, target, cost.PROFILES[hw_name], gamma)
    shown = fit if fit and not fit["refused"] else None  # a refused fit is never drawn
    st.plotly_chart(figures.batch_speedup(speed, shown, projection, f"{shape_name} on {hw_name}"),
                    width="stretch")
    st.dataframe(speed.select(
        pl.col("batch_size").alias("b"), pl.col("budget").alias("budget B"),
        pl.col("ar_tokens_per_s").round(1).alias("AR tok/s"),
        pl.col("eagle_tokens_per_s").round(1).alias("EAGLE tok/s"),
        pl.col("tau").round(2).alias("τ"), pl.col("speedup").round(2).alias("speedup")),
        hide_index=True)
    if fit:
        from moe_spec.analysis import warmup
        c = fit["coef"]
        rule = f"{fit['dropped']} passes dropped by the {warmup.RULE}"
        if fit["refused"]:
            st.warning(f"MoESD's pass-time model {fit['refused']} ({rule}).")
        else:
            left = f"; left out: {', '.join(fit['left_out'])}" if fit["left_out"] else ""
            st.write(f"MoESD's pass-time model fitted to {c['points']} measured (sequences, γ) "
                     f"points: T = {c['c0'] * 1e3:.2f} ms + {c['c1'] * 1e3:.3f} ms × E(bγ) + "
                     f"{c['c2'] * 1e3:.4f} ms × bγ, relative RMSE {c['relative_rmse']:.1%} "
                     f"({rule}{left}).")
    st.caption(f"Measured on {speed['device'][0]}; tokens/s over each whole decoding (prefill and "
               "drafting included). The fit and the roofline are verification-only (τ·T(b,1)/"
               "T(b,M)); the roofline assumes MoESD's uniform routing for the experts a pass "
               "loads, capped at the budget.")


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
