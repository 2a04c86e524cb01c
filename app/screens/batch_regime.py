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
    """profile-batch's measured speedup vs b, one measurement at a time (equal work, a 95%
    interval on every speedup), with MoESD's fit and a roofline projection."""
    from moe_spec.analysis import timing
    every = data.frame("batch_speed", str(page.ds.root), page.ds.version, page.roles)
    speed = views.pick(every, page.model, page.bench) if every.height else every
    st.subheader("Speedup over autoregressive decoding vs b")
    if speed.height == 0:
        st.caption("Not measured for this dataset: `profile-batch --model … --bench … "
                   "--batch-sizes 1,2,4,8,16 --limit 16 --budget 16` decodes the same prompts b "
                   "at a time autoregressively and with EAGLE, with and without a budget.")
        return
    runs = speed["run"].unique(maintain_order=True).to_list()
    left, right = st.columns(2)
    run = runs[-1] if len(runs) == 1 else left.selectbox("profile settings (run)", runs,
                                                         key="batch_run")
    speed = speed.filter(pl.col("run") == run)
    default = timing.latest(speed)["measurement"][0]
    found = speed.select("measurement", "measured_at", "complete").unique().sort(
        pl.col("measured_at").fill_null(""), "measurement")
    ids = found["measurement"].to_list()
    measurement = right.selectbox(
        "measurement", ids, index=ids.index(default), key=f"batch_measurement:{run}",
        format_func=lambda m: m + ("" if found.filter(pl.col("measurement") == m)["complete"]
                                   .fill_null(True)[0] else " (interrupted)"),
        help="every profile-batch invocation is kept as a measurement of its own; the default "
             "is the most recent complete one; measurements are never pooled")
    speed = speed.filter(pl.col("measurement") == measurement)
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
    if not speed["equal_work"].all():
        st.warning("Unequal work: in this measurement the decodings at one b produced different "
                   "numbers of tokens (stored before profile-batch ignored end-of-sequence), so "
                   "its speedups compare different work. Measure again with profile-batch.")
    views.words_table(batch_speed_table(speed))
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
    st.caption(f"Measured on {speed['device'][0]}, {timing.METHOD} ({int(speed['tokens'][0])} "
               f"tokens per decoding); seconds per token over each whole decoding (prefill and "
               f"drafting included); {timing.INTERVAL}. The fit and the roofline are "
               "verification-only (τ·T(b,1)/T(b,M)); the roofline assumes MoESD's uniform "
               "routing for the experts a pass loads, capped at the budget.")


def batch_speed_table(speed: pl.DataFrame) -> pl.DataFrame:
    """The measured speedups as shown: a budget column in words ("none", never "None"), the
    speedup always beside its 95% interval (or why it has none; "unpaired" for a measurement
    stored before repeats were interleaved), EAGLE's ms per pass and per token with theirs."""
    from moe_spec.analysis import timing

    def ms(r, name):
        return timing.with_interval(r[name] * 1e3, r[f"{name}_low"] * 1e3,
                                    r[f"{name}_high"] * 1e3, unit=" ms")
    rows = [{"b": r["batch_size"],
             "budget B": "none" if r["budget"] is None else str(r["budget"]),
             "AR tok/s": round(r["ar_tokens_per_s"], 1),
             "EAGLE tok/s": round(r["eagle_tokens_per_s"], 1), "τ": round(r["tau"], 2),
             "EAGLE ms per pass": ms(r, "pass_seconds"),
             "EAGLE ms per token": ms(r, "seconds_per_token"),
             "speedup (95% CI)": timing.speedup_text(r),
             "repeats kept": f"{r['repeats']} EAGLE, {r['ar_repeats']} AR"
                             + (f", {r['pairs']} pairs" if r.get("paired") else ", unpaired")
                             + (f" ({r['dropped']} dropped)" if r["dropped"] else ""),
             "equal work": "yes" if r["equal_work"] else "no"}
            for r in speed.sort("budget", "batch_size", nulls_last=False).iter_rows(named=True)]
    return pl.DataFrame(rows)


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
