"""Views over replay results: error vs budget, matched-error budgets, oracle gap, closed loop.

* ``error_vs_budget``: mean RSE (and token error, mass excluded) per ranking × coverage × budget
  (MoE-Spec Fig. 5), with a normal 95% interval of the mean over tree-layers.
* ``budget_at``: the budget a ranking needs to reach a target RSE, linearly interpolated on its
  (decreasing) sweep.
* ``oracle_gap``: for each router budget B, the budget the oracle needs for the router's RSE at B,
  and the share of experts it saves, ``(B − B_oracle) / B`` (paper: ~25%) (Fig. 6). ``sweep``
  says whether B_oracle was found inside the replayed budgets: "below" (the oracle already beats
  the router's error at its smallest budget B₀, so B_oracle ≤ B₀ is unknown and the share is only
  a lower bound, ``≥ (B − B₀) / B``), "beyond" (never reached: NaN) or "inside".
* ``ablation``: coact's gain split into its parts, router → sqmass (squared mixing mass) →
  coact-diag (× calibration output energy G_ii) → coact (+ co-activation, off-diagonal G_ij), as
  the share of the router→oracle gap each closes: ``(RSE_router − RSE_X) / (RSE_router −
  RSE_oracle)`` per coverage × budget.
* ``closed_loop``: accepted length under budget (with a 95% interval over trees), the captured
  accepted length of the same trees, path-unchanged rate, top-1 agreement, KL.
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl

from catalog import replay_metrics
from catalog.replay_metrics import BATCH_TABLE, CLOSED_TABLE, OPEN_TABLE
from policy import index  # torch-free: the rankings' table (tests/test_layering.py)


def error_vs_budget(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Per ranking × coverage × budget: the open-loop metrics' means as declared in
    :mod:`catalog.replay_metrics` (RSE with its interval), and the tree-layers counted."""
    return con.sql(f"""
        SELECT {by}, ranking, coverage, budget, {replay_metrics.view_select(OPEN_TABLE)},
               count(*) AS tree_layers
        FROM {OPEN_TABLE} GROUP BY ALL ORDER BY ALL
    """).pl()


def batch_error_vs_budget(con: duckdb.DuckDBPyConnection, by: str = "model, bench"
                          ) -> pl.DataFrame:
    """Per batch size b × ranking × coverage × budget: the open-loop metrics' means over
    (batch pass, layer) cells of ``replay --batch-size b`` (one shortlist per pass, all its
    trees' tokens), with b = 1 from ``replay_open`` (one tree per shortlist) where stored."""
    present = {r[0] for r in con.sql("SELECT view_name FROM duckdb_views()").fetchall()}
    select = replay_metrics.view_select(BATCH_TABLE)
    parts = [f"""SELECT {by}, batch_size, ranking, coverage, budget, {select},
                        count(*) AS pass_layers, avg(trees) AS trees
                 FROM {BATCH_TABLE} GROUP BY ALL"""]
    if OPEN_TABLE in present:
        parts.append(f"""SELECT {by}, 1 AS batch_size, ranking, coverage, budget,
                                {replay_metrics.view_select(OPEN_TABLE)},
                                count(*) AS pass_layers, 1.0 AS trees
                         FROM {OPEN_TABLE} GROUP BY ALL""")
    return con.sql(" UNION ALL BY NAME ".join(parts) + " ORDER BY ALL").pl()


def budget_at(budgets, rse, target: float) -> float:
    """Smallest budget reaching ``target`` on a decreasing RSE curve (linear interpolation);
    NaN when the curve never gets there."""
    b, r = np.asarray(budgets, dtype=float), np.asarray(rse, dtype=float)
    order = np.argsort(b)
    b, r = b[order], r[order]
    if target >= r[0]:
        return float(b[0])
    for i in range(1, len(b)):
        if r[i] <= target:
            return float(b[i - 1] + (b[i] - b[i - 1]) * (r[i - 1] - target) / (r[i - 1] - r[i]))
    return float("nan")


def sweep_position(budgets, rse, target: float) -> str:
    """Where :func:`budget_at` found ``target`` on a curve: "below" the smallest budget replayed
    (its RSE there is already lower, so the budget needed is at most that one: unknown),
    "beyond" the largest (never reached), or "inside"."""
    b, r = np.asarray(budgets, dtype=float), np.asarray(rse, dtype=float)
    first = r[np.argmin(b)]
    if target > first:
        return "below"
    return "beyond" if np.isnan(budget_at(b, r, target)) else "inside"


def matched_error(curves: pl.DataFrame, reference: str = "router") -> pl.DataFrame:
    """For every reference budget B: the budget each ranking needs for the reference's RSE, and
    where on that ranking's sweep it lies (:func:`sweep_position`)."""
    rows = []
    for (coverage,), frame in curves.group_by(["coverage"], maintain_order=True):
        ref = frame.filter(pl.col("ranking") == reference).sort("budget")
        for b, target in zip(ref["budget"], ref["rse"]):
            for (ranking,), cur in frame.group_by(["ranking"], maintain_order=True):
                cur = cur.sort("budget")
                rows.append(dict(coverage=coverage, reference_budget=int(b), target_rse=target,
                                 ranking=ranking,
                                 budget_needed=budget_at(cur["budget"], cur["rse"], target),
                                 sweep=sweep_position(cur["budget"], cur["rse"], target)))
    return pl.DataFrame(rows)


def oracle_gap(curves: pl.DataFrame) -> pl.DataFrame:
    m = matched_error(curves).filter(pl.col("ranking") == "oracle")
    return m.with_columns(
        experts_saved=pl.col("reference_budget") - pl.col("budget_needed"),
        saved_share=(pl.col("reference_budget") - pl.col("budget_needed"))
        / pl.col("reference_budget"))


ABLATION_NOTE = ("Share of the router→oracle gap (mean RSE) each ranking closes: sqmass = squared "
                 "mixing mass, coact-diag = × calibration output energy G_ii, coact = + "
                 "co-activation (off-diagonal G); under substitution coact also picks, per "
                 "budget, the prefix with the lowest predicted substitution error.")
ABLATION = index.ablation_ladder()  # the rankings with an ablation step, in order


def ablation(curves: pl.DataFrame) -> pl.DataFrame:
    """Gap closed by each ablation step present (one column each), per coverage × budget, from
    :func:`error_vs_budget` rows of one dataset; empty without router and oracle."""
    steps = [s for s in ABLATION if s in set(curves["ranking"])]
    if not {"router", "oracle"} <= set(curves["ranking"]) or not steps:
        return pl.DataFrame()
    wide = curves.pivot(on="ranking", index=["coverage", "budget"], values="rse",
                        aggregate_function="mean").sort("coverage", "budget")
    gap = pl.col("router") - pl.col("oracle")
    return wide.select("coverage", "budget", *[
        pl.when(gap > 0).then((pl.col("router") - pl.col(s)) / gap).alias(s) for s in steps])


def closed_loop(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Per ranking × coverage × budget: the closed-loop metrics' means as declared in
    :mod:`catalog.replay_metrics` (τ with its interval), and the trees counted."""
    return con.sql(f"""
        SELECT {by}, ranking, coverage, budget, {replay_metrics.view_select(CLOSED_TABLE)},
               count(*) AS trees
        FROM {CLOSED_TABLE} GROUP BY ALL ORDER BY ALL
    """).pl()
