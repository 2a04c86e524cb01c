"""The speedup projection: this capture's routing statistics on a real model shape and
hardware."""

from __future__ import annotations

import polars as pl
import streamlit as st

from moe_spec.analysis import cost, figures
from moe_spec.analysis.frames import (
    MATCHED_QUALITY,
    MODE_SPEEDUP_NOTE,
    calibration_frame,
    efficiency_frame,
    frontier_frame,
    frontier_table,
    headline,
    mode_headline_rows,
    mode_speedup_frame,
    model_shape,
    real_targets,
    replayed_rankings,
    routing_statistics,
    speedup_frame,
    speedup_interval,
    speedup_note,
)
from moe_spec.app import views

TITLE = "Speedup projection"
ORDER = 80


def draw() -> None:
    """The what-if: this capture's routing statistics on a real model shape and hardware."""
    page = views.start_page(
        "Speedup projection", "speed",
        "How to read this: this capture's routing (experts a tree loads, τ, quality "
        "under each budget) put on a real model's shape and hardware with a roofline "
        "cost model; a speedup above 1× beats autoregressive decoding, and the bold "
        "budget is the fastest one within the quality bound.",
        prefer=lambda ds, roles: {(r["model"], r["bench"]) for r in
                                  views.role_runs(ds, roles).iter_rows(named=True)
                                  if r["budget"] is None},
        trees=True)
    if page is None:
        return
    model, bench = page.model, page.bench
    run = page.runs.filter(pl.col("budget").is_null())
    if run.height == 0:
        st.info("Needs a plain EAGLE capture (no budget) of this dataset.")
        return
    run = run.row(0, named=True)
    # one replay variant per curve, as on the Replay page: the one picked, else the default rule's
    chosen = views.variant_picker(page.ds, page.roles, page.names, "speed_variant")
    con = page.ds.con_for(page.roles, page.names, chosen)
    ranking, coverage = _ranking(page, con)
    stats = routing_statistics(con, model, bench, ranking=ranking, coverage=coverage)
    captured = model_shape(run["model_location"])
    if stats is None:
        st.warning("This capture's unbudgeted trees or layer summaries could not be read for "
                   "the cost model.")
        return
    if captured is None:
        st.warning(f"The cost model needs the captured model's config: "
                   f"`{run['model_location']}` (the capture's model location) is not a model "
                   "folder or a cached hub model on this machine. Put the model there, or open "
                   "traces captured here.")
        return
    targets = {f"captured shape ({model})": captured, **real_targets()}
    target_name, hardware = _target_and_hardware(targets)
    if not hardware:
        st.info("Pick at least one hardware profile.")
        return
    target = targets[target_name]
    on_captured = target_name.startswith("captured shape")
    cal = _calibration(page, run, hardware[0], on_captured)
    frame = speedup_frame(stats, target, hardware, run["depth"],
                          calibration=(cal, hardware[0]) if cal is not None and on_captured else None)
    top = headline(frame, hardware[0].name)
    _best(frame, top, stats, target_name, model, len(hardware),
          carried_over=not on_captured and target != captured)
    _at_budget(frame, top, target_name)
    _fixed_vs_adaptive(page, con, stats, target_name, target, hardware, run["depth"])
    _frontier(page, con, target_name, target, hardware, run["depth"])
    quality_frontier(page.ds, page.roles, model, bench, target, hardware[0])
    _efficiency(page.ds.root, model)


def _ranking(page: views.Page, con) -> tuple[str, str | None]:
    """The ranking (and coverage) whose measured quality the projection uses: every one
    replayed on this dataset, router first; router when nothing is replayed (the page then
    says exactly what is missing)."""
    found = replayed_rankings(con, page.model, page.bench)
    if found.is_empty():
        st.caption("Ranking: none replayed on this dataset (no replay at all): `replay --ranking "
                   "router oracle coact-prior --calibration RUN --budget sweep` measures the "
                   "quality of each budget.")
        return "router", None
    c1, c2 = st.columns(2)
    names = list(dict.fromkeys(found["ranking"].to_list()))
    ranking = c1.selectbox("Ranking (its measured quality under each budget)", names,
                           key="speed_ranking",
                           help="every ranking replayed on this dataset; the projection uses its "
                                "open-loop RSE, and its closed-loop τ, path and KL where replayed")
    covers = found.filter(pl.col("ranking") == ranking)["coverage"].to_list()
    coverage = c2.selectbox("Coverage", covers, key=f"speed_coverage:{ranking}")
    return ranking, coverage


def _frontier(page: views.Page, con, target_name: str, target, hardware: list,
              depth: int) -> None:
    """MoE-Spec's headline table for this dataset: every replayed ranking's throughput gain over
    unbudgeted EAGLE at matched quality, on the target shape and each hardware profile."""
    from moe_spec.analysis.frames import frontier_markdown_rows
    st.subheader("Throughput gain over unbudgeted EAGLE at matched quality, per ranking")
    table = frontier_table(con, page.model, page.bench, target, hardware, depth)
    if table.is_empty():
        st.caption("Appears once a ranking is replayed on this dataset (no replay at all): "
                   "`replay --ranking router oracle coact-prior --calibration RUN --budget "
                   "sweep`, and `replay --mode closed …` for τ under each budget.")
        return
    views.words_table(frontier_markdown_rows(table, with_model=False))
    st.caption(f"On {target_name}. {MATCHED_QUALITY}. Interval: 95%, from τ(B)/τ(N) on the same "
               "trees (closed loop); where only open loop exists τ is not measured under a "
               "budget and the gain is the cost model's alone. `python bench/frontier.py` "
               "writes this table for every dataset into docs/results.md.")


def _target_and_hardware(targets: dict) -> tuple[str, list]:
    """The target model shape (in the URL) and the hardware profiles to project onto."""
    c1, c2 = st.columns(2)
    target_name = views.url_select(c1, "Target model shape", list(targets), "speed_target",
                                   "target", index=min(1, len(targets) - 1),
                                   help="the capture's routing statistics (unique experts, experts "
                                        "under budget, τ and quality under budget) put on this "
                                        "model's widths and depth; budgets are mapped by share of N "
                                        "onto its own experts, never below its top-k")
    names = c2.multiselect("Hardware", [*cost.PROFILES, cost.THIS_CPU, "custom"],
                           default=list(cost.PROFILES), key="speed_hw")
    hardware = [cost.PROFILES[h] for h in names if h in cost.PROFILES]
    if cost.THIS_CPU in names:
        hardware.append(_this_cpu())
    if "custom" in names:
        c3, c4 = st.columns(2)
        hardware.append(cost.custom(c3.number_input("bandwidth TB/s", 0.1, 20.0, 3.35,
                                                    key="speed_bw"),
                                    c4.number_input("peak TFLOP/s", 1.0, 5000.0, 989.0,
                                                    key="speed_tf")))
    return target_name, hardware


@st.cache_resource
def _this_cpu():
    """This machine's CPU, measured once per session of the server (:func:`cost.measure_cpu`)."""
    return cost.measure_cpu()


def _calibration(page: views.Page, run: dict, hw, on_captured: bool):
    """The cost model choice: the calibration fitted to this capture's timings (drawn, with
    what it describes) when it is usable and the user picks it, else None (the datasheet
    roofline; a note says why a calibration is not offered)."""
    fitted = calibration_frame(page.con, page.model, page.bench,
                               dict(model_location=run["model_location"]), hw)
    cal = fitted[1] if fitted is not None else None
    if cal is None or not cal.usable:
        why = ("no measured verification passes (or no readable config) to fit one"
               if cal is None else f"the fit to this capture's timings is {cal.verdict}"
               if not cal.refused else f"this capture's timings were {cal.verdict}")
        st.caption(f"Cost model: datasheet roofline. A calibrated cost model is not offered: "
                   f"{why}.")
        return None
    mode = st.radio("Cost model", ["datasheet roofline",
                                   "calibrated on this capture's timings"],
                    key="speed_m", horizontal=True, help=cal.verdict)
    if not mode.startswith("calibrated"):
        return None
    frame, _ = fitted
    st.plotly_chart(figures.calibration(frame, (
        f"Calibration on {cal.points} passes, {cal.dropped} dropped as warm-up "
        f"({hw.name} datasheet shape): "
        f"T ≈ {cal.alpha:.3g}·T_mem + {cal.beta:.3g}·T_flop + {cal.gamma * 1e3:.3g} ms, "
        f"R² {cal.r2:.2f}, relative RMSE {cal.relative_rmse:.1%}")), width="stretch")
    st.caption("A calibration describes the capturing device on the captured model: with "
               "the captured shape as target it adds a \"capturing device (calibrated)\" "
               "line; projections onto other shapes and hardware use the datasheet "
               "roofline." + ("" if on_captured else " (Pick the captured shape to see it.)"))
    return cal


def _best(frame: pl.DataFrame, top: dict, stats: dict, target_name: str, model: str,
          profiles: int, carried_over: bool) -> None:
    """The projection over budgets and the best speedup within the quality bound, with what it
    assumes (``carried_over``: τ and routing measured on another model than the target)."""
    best = top["row"]
    n_t = best["target_experts"]
    st.plotly_chart(figures.speedup(frame, f"Projected speedup on {target_name} (τ from "
                                           f"{stats['tau_source']})", speedup_note(frame),
                                    best["budget"]), width="stretch")
    if carried_over:
        st.warning(f"τ = {stats['tau']:.2f} (accepted length, from the {stats['tau_source']}) "
                   f"and the routing statistics were measured on the captured model {model}, "
                   f"not on {target_name}: this projection assumes they carry over to the "
                   "target shape. A real model's draft acceptance and routing can differ; "
                   "capture the target model itself to measure them.")
    budgeted = best["captured_budget"] != best["num_experts"]
    st.markdown(f"**Best projected speedup within the quality bound** ({top['bound']}; "
                f"ranking {best['ranking']}) on {best['hardware']}: **{best['speedup']:.2f}×** "
                f"({speedup_interval(best)}) at B = {best['budget']} of "
                f"{n_t}" + (f" ({best['quality']})" if budgeted else " (no budget)")
                + (f"; {top['note']}" if top["note"] else "") + ".")
    if set(frame["bound"]) == {"compute"}:
        st.info("Every verification pass here is compute-bound: the projection does not depend "
                "on memory bandwidth, only on peak FLOP/s.")
    elif set(frame["bound"]) == {"memory"} and profiles > 1:
        st.caption("Every pass here is memory-bound on every profile, so the speedup is a ratio "
                   "of bytes moved and the same on each: the hardware lines coincide.")


def _at_budget(frame: pl.DataFrame, top: dict, target_name: str) -> None:
    """A budget slider (starting at the best one), its speedup tiles and quality, and every
    budget's speedups with the quality each costs."""
    best = top["row"]
    n_t = best["target_experts"]
    budgets = sorted(set(frame["budget"].to_list()))
    b = st.select_slider(f"Budget (experts of {n_t}, the target's)", budgets,
                         value=best["budget"], key=f"speed_b:{target_name}",
                         help="starts at the best budget within the quality bound")
    rows = frame.filter(pl.col("budget") == b).to_dicts()
    same = {f"{r['speedup']:.2f}" for r in rows}
    if len(rows) > 1 and len(same) == 1:  # one tile when every profile gives the same number
        rows = [dict(rows[0], hardware=", ".join(r["hardware"] for r in rows))]
    for row in rows:
        st.metric(f"projected speedup at B={b} of {n_t} on {row['hardware']}",
                  f"{row['speedup']:.2f}× ({speedup_interval(row)})",
                  help=f"τ = {row['tau']:.2f} from {row['tau_source']} (captured budget "
                       f"{row['captured_budget']} of {row['num_experts']}); "
                       f"{row['experts_loaded']:.1f} experts loaded per layer of the target; "
                       f"{row['bound']}-bound")
    at = frame.filter(pl.col("budget") == b).row(0, named=True)
    verdict = {True: "within", False: "outside", None: "not measured against"}[at["within_bound"]]
    st.caption(f"Quality at B = {b} of {n_t} (the capture's B = {at['captured_budget']} of "
               f"{at['num_experts']}): {at['quality']}; {verdict} the bound ({top['bound']}).")
    # one row per (budget, hardware), words that wrap: never wider than the page, whatever the
    # profiles chosen and the window's width
    views.words_table([{
        f"B (of {n_t})": r["budget"], f"captured B (of {best['num_experts']})":
        r["captured_budget"], "hardware": r["hardware"],
        "speedup (95% CI)": f"{r['speedup']:.2f}× ({speedup_interval(r)})",
        "τ": round(r["tau"], 2),
        "quality at this budget": r["quality"],
        "within the bound": {True: "yes", False: "no", None: "not measured"}[r["within_bound"]]}
        for r in frame.sort("budget", "hardware").iter_rows(named=True)])
    st.caption("Intervals: 95% Student-t of τ over the replayed trees (closed loop's τ(B) where "
               "replayed, else the unbudgeted τ), carried through the cost model, which is "
               "taken as exact.")


def _fixed_vs_adaptive(page: views.Page, con, stats: dict, target_name: str, target,
                       hardware: list, depth: int) -> None:
    """Projected speedup against the mean experts loaded per layer, a line per budget mode
    (fixed and each adaptive), and each mode's fastest budget within the quality bound."""
    st.subheader("Fixed vs adaptive budgets: throughput against mean experts per layer")
    if stats.get("coverage") is None:
        st.caption("Appears once this ranking is replayed on this dataset.")
        return
    frame = mode_speedup_frame(con, page.model, page.bench, stats, target, hardware, depth)
    modes = set(frame["budget_mode"]) - {"none (B = N)"}
    if not modes - {"fixed"}:
        st.caption(f"Only fixed budgets of {stats['ranking']} ({stats['coverage']}) are "
                   "replayed here: `replay --budget-mode adaptive …` adds adaptive ones, drawn "
                   "here against the same mean experts per layer.")
        return
    st.plotly_chart(figures.speedup_vs_experts(
        frame, f"Projected speedup on {target_name}, {stats['ranking']} ({stats['coverage']}): "
               "fixed vs adaptive", MODE_SPEEDUP_NOTE), width="stretch")
    views.words_table(mode_headline_rows(frame, hardware[0].name))
    st.caption(f"Per budget mode, on {hardware[0].name}: its fastest budget within the quality "
               "bound it is judged by (closed-loop path where that mode was replayed closed "
               "loop, else open-loop RSE), the rule of the headline above; B = N when none is "
               "faster. Beside an adaptive mode's B̄ (the mean budget asked), the mean experts it "
               "loaded per layer and its price λ (load the next expert while its predicted gain "
               "exceeds λ; calibrated on the calibration run to meet B̄ there).")


def _efficiency(root, model: str) -> None:
    """MoESD's target efficiency η(b, γ), once profile-target has measured this model."""
    eta = efficiency_frame(root, model)
    if eta is not None:
        st.plotly_chart(figures.efficiency(eta), width="stretch")
        st.caption("MoESD's target efficiency η(b, γ) = T(b, 1) / T(b, γ) measured by "
                   "`profile-target` on this device: near 1, verifying γ tokens per sequence costs "
                   "about as much as one (memory-bound); it falls as compute takes over.")
    else:
        st.caption(f"MoESD's target efficiency η(b, γ) appears here once `profile-target --model "
                   f"{model} --out {root}` has measured this model on this device.")


def quality_frontier(ds, roles, model, bench, target, hw) -> None:
    """The speedup–quality frontier of budgeted captures scored with ``evaluate``."""
    front = frontier_frame(ds.con_for(roles), model, bench, target, hw)
    if front is None:
        st.caption("A speedup–quality frontier appears here once budgeted captures "
                   "(`capture --budget B`) and their unbudgeted twin are scored with `evaluate`.")
        return
    flat = front["quality"].drop_nulls().n_unique() <= 1
    st.plotly_chart(figures.frontier(front, "agreement" if flat else "quality"), width="stretch")
    if flat:
        st.caption("Task quality is flat here (tiny models score ≈ 0), so output agreement "
                   "with the unbudgeted run carries the signal.")


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
