"""Every computed frame the report and the dashboard draw, by name, in one place.

Each entry of :data:`ANALYSES` takes a connection from :func:`analysis.sql.connect` and returns a
polars frame grouped by model and benchmark; :data:`NEEDS` says which view it reads (routing
unless listed). The cost-model frames (projected speedup, calibration, MoESD efficiency) need a
run's manifest or the profile points and are separate functions.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import polars as pl

from analysis import cost, replay_views, routing
from analysis.sql import views
from catalog import partition_value


@functools.lru_cache(maxsize=16)
def model_shape(location: str) -> cost.ModelShape | None:
    """The cost model's view of a captured model, from its config alone (no weights): the local
    ``config.json`` read as is where it names every width (instant), else through transformers
    (hub ids, or a config that leaves values at the family's defaults)."""
    import json
    from types import SimpleNamespace
    try:
        raw = json.loads((Path(location) / "config.json").read_text())
        return cost.ModelShape.from_config(SimpleNamespace(**raw))
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    from transformers import AutoConfig
    try:
        return cost.ModelShape.from_config(AutoConfig.from_pretrained(location))
    except (OSError, ValueError):
        return None


def draft_seconds(hidden: int, intermediate: int, vocab: int, depth: int, hw: cost.Hardware,
                  bytes_per_param: float = 2.0) -> float:
    """Memory-bound time of ``depth + 1`` EAGLE-3 draft forwards (fc 3H→H, one decoder layer,
    the draft LM head): ``(H·(7H + 3I) + H·V) · b`` bytes each."""
    return (depth + 1) * (hidden * (7 * hidden + 3 * intermediate) + hidden * vocab) \
        * bytes_per_param / hw.bandwidth


@functools.cache
def real_targets() -> dict[str, cost.ModelShape]:
    """The registry's real checkpoints as cost-model shapes, by checkpoint name (the speedup
    projection's targets)."""
    from types import SimpleNamespace

    from moe.shapes import REAL_SHAPES  # each entry lists every width the cost model reads
    return {s.checkpoint: cost.ModelShape.from_config(SimpleNamespace(**s.config))
            for s in REAL_SHAPES.values()}


def routing_statistics(con, model: str, bench: str, run: str | None = None) -> dict | None:
    """What a capture says about routing, independent of the model's size: unique experts per
    layer per tree (as a share of N), tree size, prefix length, and τ under each budget from
    closed-loop replay (router ranking, substitution) of the *same* trees, with the captured τ
    of those trees for B = N."""
    part = partition_value(model)
    where = f"model = '{part}' AND bench = '{bench}'" + (f" AND run = '{run}'" if run else "")
    row = con.execute(f"""SELECT avg(accepted_length), avg(prefix_len), avg(list_avg(
                          unique_experts)), any_value(nodes), count(*) FROM trees
                          WHERE {where} AND budget IS NULL""").fetchall()[0]
    if row[0] is None:
        return None
    n = con.execute(f"SELECT any_value(num_experts) FROM summary_layers WHERE {where}"
                    ).fetchall()[0][0]
    if n is None:
        return None
    stats = dict(tau=row[0], prefix=row[1], unique=row[2], nodes=int(row[3]), trees=row[4],
                 num_experts=int(n), taus={}, tau_source="unbudgeted capture")
    if "replay_closed" in views(con):
        rows = con.execute(f"""SELECT budget, avg(accepted_length), avg(captured_accepted_length)
                               FROM replay_closed WHERE {where} AND ranking = 'router'
                               AND coverage = 'substitution' GROUP BY budget""").fetchall()
        if rows:
            stats["taus"] = {int(b): t for b, t, _ in rows}
            stats["tau"] = float(np.mean([c for _, _, c in rows]))  # the same trees' τ
            stats["tau_source"] = "closed-loop replay"
    return stats


def speedup_frame(stats: dict, target: cost.ModelShape, hardware: list[cost.Hardware],
                  depth: int = 7, draft: tuple[int, int, int] | None = None) -> pl.DataFrame:
    """Projected speedup over autoregressive decoding vs budget, the capture's routing statistics
    put on a ``target`` shape:

        speedup(B) = τ(B) · T_AR / (T_draft + T_verify(E(B)))

    Budgets and unique experts are carried over as shares of N (a budget of 25% of the captured
    model's experts is 25% of the target's), τ(B) from closed-loop replay (the captured τ at
    B = N), times from the roofline of ``target`` on each hardware profile. ``draft`` is the
    draft head's (hidden, intermediate, vocabulary); by default one decoder layer of the
    target's width with a 32k draft vocabulary. Each row also says whether the verify pass is
    memory-bound (bandwidth matters) or compute-bound (it does not)."""
    n_c, n_t = stats["num_experts"], target.num_experts
    share = lambda b: b / n_c  # noqa: E731
    budgets = sorted(stats["taus"]) or sorted({max(1, round(f * n_c)) for f in
                                               np.linspace(0.125, 1.0, 8)})
    if n_c not in budgets:
        budgets.append(n_c)
    hidden, inter, vocab = draft or (target.hidden, 4 * target.hidden, 32000)
    rows = []
    for hw in hardware:
        t_draft = draft_seconds(hidden, inter, vocab, depth, hw, target.bytes_per_param)
        for b in budgets:
            loaded = min(share(b), share(stats["unique"])) * n_t
            tau = stats["taus"].get(b, stats["tau"])
            roof, mem, comp = cost.pass_time(target, hw, stats["nodes"], int(stats["prefix"]),
                                             loaded)
            t_ar = cost.pass_time(target, hw, 1, int(stats["prefix"]), target.top_k)[0]
            rows.append(dict(hardware=hw.name, budget=b, budget_share=share(b),
                             target_budget=round(share(b) * n_t, 1), experts_loaded=loaded,
                             num_experts=n_c, tau=tau,
                             tau_source=stats["tau_source"] if b in stats["taus"] or b == n_c
                             else "unbudgeted capture",
                             speedup=tau * t_ar / (t_draft + roof),
                             bound="memory" if mem >= comp else "compute"))
    return pl.DataFrame(rows)


# Every frame-valued analysis, by name, and the table it needs; the report and the app share it.
ANALYSES = {
    "tails": routing.heavy_tails_by_layer,
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


def frontier_frame(con, model: str, bench: str, shape: cost.ModelShape,
                   hw: cost.Hardware) -> pl.DataFrame | None:
    """Speedup over plain EAGLE against task quality, one point per budgeted run (MoE-Spec online
    mode) that ``evaluate`` paired with its unbudgeted twin:

        speedup_vs_eagle = [τ_B / (T_draft + T_verify(E_B))] / [τ / (T_draft + T_verify(U))]

    with τ_B, E_B the budgeted run's accepted length and experts loaded per layer, τ, U the
    twin's accepted length and unique experts; T_verify from the roofline of ``shape`` on ``hw``
    (the draft cost is the same on both sides and is left out). Quality: the budgeted run's mean
    score and the share of its outputs identical to the twin's."""
    if "quality" not in views(con) or "trees" not in views(con):
        return None
    part = partition_value(model)
    pairs = con.sql(f"""
        SELECT q.run, any_value(q.twin_run) AS twin, avg(q.score) AS quality,
               avg(q.twin_score) AS twin_quality, avg(q.exact_match::DOUBLE) AS agreement,
               any_value(q.metric) AS metric
        FROM quality q WHERE q.model = '{part}' AND q.bench = '{bench}'
        AND q.twin_run IS NOT NULL GROUP BY q.run""").pl()
    if pairs.height == 0:
        return None
    trees = con.sql(f"""
        SELECT run, any_value(budget) AS budget, any_value(ranking) AS ranking,
               any_value(coverage) AS coverage, avg(accepted_length) AS tau,
               avg(list_avg(experts_loaded)) AS loaded, avg(list_avg(unique_experts)) AS uniq,
               avg(prefix_len) AS prefix, any_value(nodes) AS nodes
        FROM trees WHERE model = '{part}' AND bench = '{bench}' GROUP BY run""").pl()
    own = pairs.join(trees, on="run")
    twin = trees.select(pl.col("run").alias("twin"), pl.col("tau").alias("twin_tau"),
                        pl.col("uniq").alias("twin_uniq"))
    rows = []
    for r in own.join(twin, on="twin").iter_rows(named=True):
        t_b = cost.pass_time(shape, hw, int(r["nodes"]), int(r["prefix"]), r["loaded"])[0]
        t_0 = cost.pass_time(shape, hw, int(r["nodes"]), int(r["prefix"]), r["twin_uniq"])[0]
        rows.append(dict(r, speedup_vs_eagle=(r["tau"] / t_b) / (r["twin_tau"] / t_0),
                         hardware=hw.name))
    return pl.DataFrame(rows) if rows else None
