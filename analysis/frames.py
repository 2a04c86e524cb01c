"""Every computed frame the report and the dashboard draw, by name, in one place.

Each entry of :data:`ANALYSES` takes a connection from :func:`analysis.sql.connect` and returns a
polars frame grouped by model and benchmark; :data:`NEEDS` says which view it reads (routing
unless listed). The cost-model frames (projected speedup, calibration, MoESD efficiency) need a
run's manifest or the profile points and are separate functions.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import polars as pl

from analysis import cost, replay_views, routing
from analysis.sql import views
from catalog import partition_value


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
                        FROM trees WHERE model = '{partition_value(model)}' AND bench = '{bench}'
                        AND budget IS NULL""").fetchall()[0]
    if trees[0] is None:
        return None
    tau0, prefix, uniq, m = trees
    taus = {}
    if "replay_closed" in views(con):
        for b, t in con.execute(f"""SELECT budget, avg(accepted_length) FROM replay_closed
                                WHERE model = '{partition_value(model)}' AND bench = '{bench}'
                                AND ranking = 'router' AND coverage = 'substitution'
                                GROUP BY budget""").fetchall():
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


def calibration_frame(con, model: str, bench: str, manifest: dict,
                      hw: cost.Hardware = cost.PROFILES["A100-80G"]):
    """Least-squares calibration of the roofline (datasheet shape of ``hw``) to this dataset's
    measured verify times; (measured vs predicted frame, Calibration) or None."""
    t = con.sql(f"""SELECT verify_seconds AS measured, nodes, prefix_len,
                    list_avg(experts_loaded) AS experts_loaded FROM trees
                    WHERE model = '{partition_value(model)}' AND bench = '{bench}'""").pl()
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
    parts = sorted(Path(root).glob(f"profile/model={partition_value(model)}/device=*/*.parquet"))
    if not parts:
        return None
    points = pl.read_parquet(parts[-1])
    n, k = int(points["num_experts"][0]), int(points["top_k"][0])
    eff = moesd.efficiency(points.select("batch", "gamma", "seconds"))
    coef = moesd.fit(points, n, k)
    return eff.with_columns(regime=pl.Series(moesd.regime(eff["batch"] * eff["gamma"], n, k, coef)))
