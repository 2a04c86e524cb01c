"""``report``: one self-contained HTML file per dataset (model × benchmark) with every figure.

    report --traces traces --out reports/
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import numpy as np
import plotly.io as pio
import polars as pl

from analysis import coactivation, cost, figures, replay_views, routing
from analysis.sql import connect, views
from capture import console, schema


@functools.lru_cache(maxsize=16)
def model_shape(location: str) -> cost.ModelShape | None:
    """The cost model's view of a captured model, from its config alone (no weights)."""
    from transformers import AutoConfig
    try:
        return cost.ModelShape.from_config(AutoConfig.from_pretrained(location))
    except (OSError, ValueError):
        return None


def speedup_frame(con, model: str, bench: str, manifest: dict, hardware: list[cost.Hardware],
                  bytes_per_param: float = 2.0) -> pl.DataFrame | None:
    """Projected speedup vs budget: τ(B) from closed-loop replay (router, substitution) when
    present, else the unbudgeted τ for every budget (stated in the figure's rows)."""
    shape = model_shape(manifest["model_location"])
    if shape is None:
        return None
    shape = dataclasses.replace(shape, bytes_per_param=bytes_per_param)
    trees = con.execute(f"""SELECT avg(accepted_length) tau, avg(prefix_len) prefix,
                        avg(list_avg(unique_experts)) uniq, any_value(nodes) m
                        FROM trees WHERE model = '{model}' AND bench = '{bench}'
                        AND budget IS NULL""").fetchall()[0]
    if trees[0] is None:
        return None
    tau0, prefix, uniq, m = trees
    taus = {}
    if "replay_closed" in views(con):
        for b, t in con.execute(f"""SELECT budget, avg(accepted_length) FROM replay_closed
                                WHERE model = '{model}' AND bench = '{bench}' AND ranking='router'
                                AND coverage = 'substitution' GROUP BY budget""").fetchall():
            taus[int(b)] = t
    budgets = sorted(taus) or [int(b) for b in np.linspace(shape.top_k, shape.num_experts, 8)]
    draft_cfg = Path(manifest.get("draft") or "") / "config.json"
    draft_bytes = 0.0
    if draft_cfg.is_file():
        d = json.loads(draft_cfg.read_text())
        draft_bytes = (d["hidden_size"] * (7 * d["hidden_size"] + 3 * d["intermediate_size"])
                       + d["hidden_size"] * (d.get("draft_vocab_size") or d["vocab_size"])) \
            * bytes_per_param
    depth = manifest["settings"]["depth"]
    rows = []
    for hw in hardware:
        t_draft = (depth + 1) * draft_bytes / hw.bandwidth
        for b in budgets + [shape.num_experts]:
            rows.append(dict(hardware=hw.name, budget=b, tau=taus.get(b, tau0),
                             tau_source="closed-loop" if b in taus else "unbudgeted capture",
                             speedup=cost.projected_speedup(shape, hw, taus.get(b, tau0),
                                                            min(b, uniq), int(m), int(prefix),
                                                            t_draft)))
    return pl.DataFrame(rows)


# Every frame-valued analysis, by name, and the table it needs; the report and the app share it.
ANALYSES = {
    "tails": lambda con: routing.heavy_tails_summary(routing.heavy_tails(con),
                                                     ("model", "bench", "layer")),
    "coverage": routing.coverage_curve,
    "growth": routing.activation_growth,
    "balance": routing.load_balance,
    "errors": replay_views.error_vs_budget,
    "closed": replay_views.closed_loop,
}
NEEDS = {"errors": "replay_open", "closed": "replay_closed"}


def all_frames(con) -> dict[str, pl.DataFrame]:
    """Every analysis once, over all data (grouped by model and bench)."""
    present = views(con)
    return {name: fn(con) for name, fn in ANALYSES.items() if NEEDS.get(name, "routing") in present}


def dataset_figures(con, frames: dict, model: str, bench: str, manifest: dict,
                    root: Path | None = None) -> list:
    pick = lambda name: frames[name].filter((pl.col("model") == model)  # noqa: E731
                                            & (pl.col("bench") == bench))
    figs = [figures.heavy_tails(pick("tails")), figures.coverage(pick("coverage")),
            figures.growth(pick("growth"))]
    n = manifest["num_experts"]
    for layer in (manifest["moe_layers"][0], manifest["moe_layers"][-1]):
        c = coactivation.coactivation(con, layer, n,
                                      where=f"model = '{model}' AND bench = '{bench}'")
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


def calibration_frame(con, model: str, bench: str, manifest: dict,
                      hw: cost.Hardware = cost.PROFILES["A100-80G"]):
    """Least-squares calibration of the roofline (datasheet shape of ``hw``) to this dataset's
    measured verify times; (measured vs predicted frame, Calibration) or None."""
    t = con.sql(f"""SELECT verify_seconds AS measured, nodes, prefix_len,
                    list_avg(experts_loaded) AS experts_loaded FROM trees
                    WHERE model = '{model}' AND bench = '{bench}'""").pl()
    if t.height < 4:
        return None
    shape = model_shape(manifest["model_location"])
    if shape is None:
        return None
    cal = cost.calibrate(shape, hw, t["measured"], t["nodes"], t["prefix_len"],
                         t["experts_loaded"])
    parts = np.array([cost.pass_time(shape, hw, n, p, e)[1:] for n, p, e in
                      zip(t["nodes"], t["prefix_len"], t["experts_loaded"])])
    return t.with_columns(predicted=pl.Series(cal.predict(parts[:, 0], parts[:, 1]))), cal


def efficiency_frame(root: Path | None, model: str) -> pl.DataFrame | None:
    """MoESD η(b, γ) with regimes from ``profile-target`` points, if any were stored."""
    from analysis import moesd
    if root is None:
        return None
    parts = sorted(Path(root).glob(f"profile/model={model.replace('/', '--')}/device=*/*.parquet"))
    if not parts:
        return None
    points = pl.read_parquet(parts[-1])
    n, k = int(points["num_experts"][0]), int(points["top_k"][0])
    eff = moesd.efficiency(points.select("batch", "gamma", "seconds"))
    coef = moesd.fit(points, n, k)
    return eff.with_columns(regime=pl.Series(moesd.regime(eff["batch"] * eff["gamma"], n, k, coef)))


def write_report(traces: Path, out: Path) -> list[Path]:
    con = connect(traces)
    if "trees" not in views(con):
        raise FileNotFoundError(f"no traces under {traces}; run `capture` first")
    frames = all_frames(con)
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for manifest_path in sorted(traces.glob(f"runs/model=*/bench=*/run=*/{schema.MANIFEST}")):
        manifest = json.loads(manifest_path.read_text())
        key = (manifest["model"], manifest["bench"])
        path = out / f"{key[0].replace('/', '--')}_{key[1]}.html"
        if path in written or manifest.get("status") != "complete":
            continue
        figs = dataset_figures(con, frames, *key, manifest, traces)
        parts = [pio.to_html(f, include_plotlyjs=(i == 0), full_html=False)
                 for i, f in enumerate(figs)]
        html = (f"<html><head><meta charset='utf-8'><title>MoE-Spec workbench: {key[0]} / "
                f"{key[1]}</title></head><body style='font-family:sans-serif;max-width:1200px;"
                f"margin:auto'><h1>{key[0]} / {key[1]}</h1>" + "".join(parts) + "</body></html>")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(html, encoding="utf-8")
        tmp.replace(path)
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
    except FileNotFoundError as exc:
        print(f"report: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
