"""``report``: one self-contained HTML file per dataset (model × benchmark) with every figure.

    report --traces traces --out reports/
"""

from __future__ import annotations

import sys
from pathlib import Path

import plotly.io as pio
import polars as pl

import console
from analysis import coactivation, cost, figures, replay_views
from analysis.frames import all_frames, calibration_frame, efficiency_frame, speedup_frame
from analysis.sql import connect, views
from catalog import Catalog, CatalogError, atomic, partition_value


def dataset_figures(con, frames: dict, model: str, bench: str, manifest: dict,
                    root: Path | None = None) -> list:
    part = partition_value(model)
    pick = lambda name: frames[name].filter((pl.col("model") == part)  # noqa: E731
                                            & (pl.col("bench") == bench))
    figs = [figures.heavy_tails(pick("tails")), figures.coverage(pick("coverage")),
            figures.growth(pick("growth"))]
    n = manifest["num_experts"]
    for layer in (manifest["moe_layers"][0], manifest["moe_layers"][-1]):
        c = coactivation.coactivation(con, layer, n,
                                      where=f"model = '{part}' AND bench = '{bench}'")
        figs.append(figures.coactivation(
            c.matrix, coactivation.cluster_order(c.matrix),
            f"Co-activation, layer {layer} (all pairs; concentration {c.concentration:.1f}× "
            "uniform), cluster order"))
    figs.append(figures.load_balance(pick("balance")))
    if "errors" in frames and pick("errors").height:
        curves = pick("errors")
        figs.append(figures.error_vs_budget(curves))
        if {"oracle", "router"} <= set(curves["ranking"]):
            figs.append(figures.oracle_gap(replay_views.oracle_gap(curves)))
    if "closed" in frames and pick("closed").height:
        figs.append(figures.closed_loop(pick("closed")))
    sp = speedup_frame(con, model, bench, manifest, list(cost.PROFILES.values()))
    if sp is not None:
        figs.append(figures.speedup(sp))
    fitted = calibration_frame(con, model, bench, manifest)
    if fitted is not None:
        frame, cal = fitted
        figs.append(figures.calibration(frame, (
            f"Cost model calibrated on {cal.points} measured verification passes: "
            f"T = {cal.alpha:.3g}·T_mem + {cal.beta:.3g}·T_flop + {cal.gamma * 1e3:.3g} ms, "
            f"relative RMSE {cal.relative_rmse:.1%}, R² {cal.r2:.2f}")))
    eta = efficiency_frame(root, model)
    if eta is not None:
        figs.append(figures.efficiency(eta))
    return figs


def write_report(traces: Path, out: Path, roles: tuple[str, ...] = ("evaluation",)) \
        -> list[Path]:
    """One HTML file per dataset (model × benchmark) of the complete runs in ``roles``."""
    con = connect(traces, roles=roles)
    if "trees" not in views(con):
        raise FileNotFoundError(f"no complete {'/'.join(roles)} traces under {traces}; run "
                                "`capture` first")
    frames = all_frames(con)
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for run in Catalog(traces).runs(roles=roles):
        path = out / f"{partition_value(run.model)}_{run.bench}.html"
        if path in written:
            continue
        figs = dataset_figures(con, frames, run.model, run.bench, run.manifest, traces)
        parts = [pio.to_html(f, include_plotlyjs=(i == 0), full_html=False)
                 for i, f in enumerate(figs)]
        html = (f"<html><head><meta charset='utf-8'><title>MoE-Spec workbench: {run.model} / "
                f"{run.bench}</title></head><body style='font-family:sans-serif;max-width:1200px;"
                f"margin:auto'><h1>{run.model} / {run.bench}</h1>" + "".join(parts) +
                "</body></html>")
        atomic.write_bytes(path, html.encode("utf-8"))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(prog="report", description="Write one self-contained HTML report "
                                "per captured dataset (model × benchmark) with every figure.")
    p.add_argument("--traces", type=Path, default=Path("traces"))
    p.add_argument("--out", type=Path, default=Path("reports"))
    args = p.parse_args(argv)
    try:
        written = write_report(args.traces, args.out)
    except (FileNotFoundError, CatalogError) as exc:
        print(f"report: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
