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
* ``experts_saved`` (the paper's headline, for every ranking): per router budget B, the budget
  B_X the oracle and each runtime ranking need for router's quality at B (open loop mean RSE;
  closed loop mean τ and mean KL), the share saved ``(B − B_X) / B`` with a bootstrap 95%
  interval over prompts, and ``experts_saved_summary``, its mean over the budgets inside X's sweep.
* ``closed_loop``: accepted length under budget (with a 95% interval over trees), the captured
  accepted length of the same trees, path-unchanged rate, top-1 agreement, KL.
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl

from moe_spec.catalog import replay_metrics
from moe_spec.catalog.replay_metrics import BATCH_TABLE, CLOSED_TABLE, OPEN_TABLE, TABLES
from moe_spec.policy import index  # torch-free: the rankings' table (tests/test_layering.py)

FIXED = index.FIXED  # the budget mode of a fixed B (and of rows stored before the column)


def budget_mode(con: duckdb.DuckDBPyConnection, table: str) -> str:
    """SQL of a replay view's budget mode (``fixed``, ``adaptive:<predictor>[+cap]``): a curve
    of its own wherever budgets are drawn, never averaged with another mode; ``fixed`` where a
    row has none (stored before adaptive budgets)."""
    columns = {r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()}
    return f"coalesce(budget_mode, '{FIXED}')" if "budget_mode" in columns else f"'{FIXED}'"


def price(con: duckdb.DuckDBPyConnection, table: str) -> str:
    """SQL of a replay view's price λ: the adaptive budget mode's calibrated price of a mean
    budget B̄ (a key of its cell, one per curve and B̄), null for a fixed budget and for rows
    stored before adaptive budgets (no column)."""
    columns = {r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()}
    return "price" if "price" in columns else "NULL::DOUBLE"


def fixed_only(curves: pl.DataFrame) -> pl.DataFrame:
    """The fixed-budget rows of a frame (all of them where it has no ``budget_mode``)."""
    return curves.filter(pl.col("budget_mode") == FIXED) if "budget_mode" in curves.columns \
        else curves


def curves(con: duckdb.DuckDBPyConnection, table: str, by: str = "model, bench"
           ) -> pl.DataFrame:
    """Per ranking × coverage × budget mode × budget (B, or the mean B̄ asked of an adaptive
    mode) of a replay table's default view: its metrics' means as its record declares them
    (:mod:`catalog.replay_metrics`: intervals where a metric asks; ``experts_loaded``, the mean
    experts loaded), and the rows counted (the record's ``counted``: tree-layers, trees, …).
    Each budget mode is a curve of its own (:func:`budget_mode`); ``price``, an adaptive
    point's λ (:func:`price`; null for fixed budgets)."""
    record = TABLES[table]
    return con.sql(f"""
        SELECT {by}, ranking, coverage, {budget_mode(con, record.name)} AS budget_mode, budget,
               {price(con, record.name)} AS price,
               {replay_metrics.view_select(table)}, count(*) AS {record.counted}
        FROM {record.name} GROUP BY ALL ORDER BY ALL
    """).pl()


def error_vs_budget(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Per ranking × coverage × budget mode × budget: the open-loop metrics' means (RSE with its
    interval), and the tree-layers counted (:func:`curves` of ``replay_open``)."""
    return curves(con, OPEN_TABLE, by)


def batch_error_vs_budget(con: duckdb.DuckDBPyConnection, by: str = "model, bench"
                          ) -> pl.DataFrame:
    """Per batch size b × ranking × coverage × budget: the open-loop metrics' means over
    (batch pass, layer) cells of ``replay --batch-size b`` (one shortlist per pass, all its
    trees' tokens), with b = 1 from ``replay_open`` (one tree per shortlist) where stored."""
    present = {r[0] for r in con.sql("SELECT view_name FROM duckdb_views()").fetchall()}
    select = replay_metrics.view_select(BATCH_TABLE)
    parts = [f"""SELECT {by}, batch_size, ranking, coverage, budget, {select},
                        count(*) AS pass_layers, avg(trees) AS trees
                 FROM {BATCH_TABLE} WHERE {budget_mode(con, BATCH_TABLE)} = '{FIXED}'
                 GROUP BY ALL"""]
    if OPEN_TABLE in present:
        parts.append(f"""SELECT {by}, 1 AS batch_size, ranking, coverage, budget,
                                {replay_metrics.view_select(OPEN_TABLE)},
                                count(*) AS pass_layers, 1.0 AS trees
                         FROM {OPEN_TABLE} WHERE {budget_mode(con, OPEN_TABLE)} = '{FIXED}'
                         GROUP BY ALL""")
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
    where on that ranking's sweep it lies (:func:`sweep_position`); fixed budgets only."""
    rows = []
    for (coverage,), frame in fixed_only(curves).group_by(["coverage"], maintain_order=True):
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
    curves = fixed_only(curves)
    steps = [s for s in ABLATION if s in set(curves["ranking"])]
    if not {"router", "oracle"} <= set(curves["ranking"]) or not steps:
        return pl.DataFrame()
    wide = curves.pivot(on="ranking", index=["coverage", "budget"], values="rse",
                        aggregate_function="mean").sort("coverage", "budget")
    return wide.select("coverage", "budget", *[
        replay_metrics.gap_closed(pl.col("router"), pl.col("oracle"), pl.col(s)).alias(s)
        for s in steps])


def closed_loop(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Per ranking × coverage × budget mode × budget: the closed-loop metrics' means (τ with its
    interval), and the trees counted (:func:`curves` of ``replay_closed``)."""
    return curves(con, CLOSED_TABLE, by)


# ---------------------------------------------------------------------------------------------
# Experts saved at matched quality, with a bootstrap interval over prompts (the paper's headline)

# The metrics each replay table is matched on, by view column (catalog.replay_metrics), and
# whether a higher value is better: open loop mean RSE; closed loop mean τ and mean KL.
MATCHED_METRICS: dict[str, dict[str, bool]] = {
    OPEN_TABLE: {"rse": False},
    CLOSED_TABLE: {"tau": True, "kl": False},
}
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 200, 0
PROMPT = ("run", "prompt_index")  # one bootstrap unit: a prompt of a run
SWEEP = np.array(["inside", "below", "beyond"])  # codes of :func:`budgets_needed`
SAVED_NOTE = ("Experts saved vs router at matched quality: for each router budget B, the budget "
              "B_X ranking X needs to reach router's mean at B (RSE open loop; τ and KL closed "
              "loop), linearly interpolated on X's sweep; share saved = (B − B_X) / B, averaged "
              "over the router budgets whose B_X lies inside X's sweep. 95% interval: bootstrap "
              f"over prompts ({BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}).")


def _metric_column(table: str, view_name: str) -> replay_metrics.Metric:
    """The declared metric whose analysis-view column is ``view_name``."""
    return next(m for m in replay_metrics.METRICS[table] if m.view_name == view_name)


def budgets_needed(budgets, curves, targets) -> tuple[np.ndarray, np.ndarray]:
    """:func:`budget_at` and :func:`sweep_position` for many curves and targets at once.

    ``budgets`` [n] (any order), ``curves`` [..., n] (decreasing metric on those budgets),
    ``targets`` [..., m] → (budget needed [..., m], sweep code [..., m]: 0 inside, 1 below,
    2 beyond; :data:`SWEEP` names them). Same rule as :func:`budget_at`: B₀ where the target
    is at or above the curve's first value, else the first segment ``i`` with
    ``curve[i] ≤ target``, ``B_{i−1} + (B_i − B_{i−1}) · (r_{i−1} − target) / (r_{i−1} − r_i)``,
    NaN (beyond) where none."""
    b = np.asarray(budgets, dtype=float)
    order = np.argsort(b)
    b, r = b[order], np.asarray(curves, dtype=float)[..., order]
    t = np.asarray(targets, dtype=float)
    first = r[..., :1]
    # padded with -inf so that a one-budget sweep has a (never used) segment end
    r = np.concatenate([r, np.full((*r.shape[:-1], 1), -np.inf)], axis=-1)[..., :max(b.size, 2)]
    b = np.append(b, np.inf)[:max(b.size, 2)]
    reached = r[..., None, 1:] <= t[..., :, None]  # [..., m, n-1]
    hit = reached.any(axis=-1) & (order.size > 1)
    i = reached.argmax(axis=-1) + 1  # first segment end reaching the target
    r_all = np.broadcast_to(r[..., None, :], (*t.shape, b.size))
    r_prev = np.take_along_axis(r_all, (i - 1)[..., None], -1)[..., 0]
    r_next = np.take_along_axis(r_all, i[..., None], -1)[..., 0]
    b_prev, b_next = b[i - 1], b[i]
    with np.errstate(invalid="ignore", divide="ignore"):
        inside = b_prev + (b_next - b_prev) * (r_prev - t) / (r_prev - r_next)
    at_start = t >= first
    needed = np.where(at_start, b[0], np.where(hit, inside, np.nan))
    code = np.where(t > first, 1, np.where(np.isnan(needed), 2, 0))
    return needed, code


def prompt_totals(rows: pl.DataFrame, metrics: list[str], by: tuple[str, ...] = ("model", "bench")
                  ) -> pl.DataFrame:
    """Per dataset × prompt × ranking × coverage × budget: each metric's sum (``<m>_sum``) and
    count of non-null rows (``<m>_n``), from row-level replay results (what
    :func:`experts_saved_frame` resamples; :func:`experts_saved` computes the same in SQL)."""
    return rows.group_by([*by, *PROMPT, "ranking", "coverage", "budget"]).agg(
        *(e for m in metrics for e in (pl.col(m).cast(pl.Float64).sum().alias(f"{m}_sum"),
                                       pl.col(m).is_not_null().sum().alias(f"{m}_n"))))


def _resampled_means(rows: pl.DataFrame, ranking: str, metric: str, weights: np.ndarray,
                     sign: float) -> tuple[np.ndarray, np.ndarray]:
    """(budgets, [resamples, budgets] means × ``sign``) of one ranking's sweep: per resample
    (a row of prompt ``weights``), Σ_p w_p·sum_p / Σ_p w_p·n_p."""
    mine = rows.filter((pl.col("ranking") == ranking) & (pl.col(f"{metric}_n") > 0))
    budgets = np.array(sorted(set(mine["budget"])), dtype=float)
    total = np.zeros((weights.shape[1], budgets.size))
    count = np.zeros_like(total)
    col = np.searchsorted(budgets, mine["budget"].to_numpy())
    prompt = mine["prompt"].to_numpy()
    np.add.at(total, (prompt, col), mine[f"{metric}_sum"].to_numpy())
    np.add.at(count, (prompt, col), mine[f"{metric}_n"].to_numpy())
    with np.errstate(invalid="ignore", divide="ignore"):
        return budgets, sign * (weights @ total) / (weights @ count)


def experts_saved_frame(totals: pl.DataFrame, metrics: dict[str, bool], loop: str,
                        by: tuple[str, ...] = ("model", "bench"), reference: str = "router",
                        resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
                        ) -> pl.DataFrame:
    """Experts each ranking saves vs ``reference`` at matched quality, per dataset, metric,
    coverage and reference budget B, from :func:`prompt_totals` (``metrics``: name → whether
    higher is better; a higher-is-better curve is negated so that every curve decreases):

        target     = reference's mean metric at B
        B_X        = budget X needs for the target (:func:`budgets_needed`, on X's own sweep)
        saved      = (B − B_X) / B   (a lower bound, ≥ (B − B₀) / B, where the target is "below"
                                      X's sweep; NaN "beyond" it)

    A mean is over rows (tree-layers open loop, trees closed loop), as the views' are.
    Bootstrap, per dataset: the prompts (``run``, ``prompt_index``, sorted) are drawn with
    replacement, ``numpy.random.default_rng(seed).integers(0, P, size=(resamples, P))``; each
    resample's mean of every ranking × coverage × budget is Σ_p w_p·sum_p / Σ_p w_p·n_p (w_p:
    times prompt p was drawn), and its saved share is recomputed from those means.
    ``saved_lo``/``saved_hi`` are the 2.5th/97.5th percentiles of the finite resampled shares
    (a resample where B_X is beyond X's sweep is left out); ``resampled`` keeps every
    resample's share (NaN beyond) for :func:`experts_saved_summary`. Rankings: the oracle and
    every runtime ranking replayed beside the reference."""
    keep = [r for r in sorted(set(totals["ranking"])) if r != reference
            and r in index.RANKINGS and (index.RANKINGS[r].runtime or r == "oracle")]
    rows = []
    for key, data in totals.group_by(list(by), maintain_order=True):
        prompts = data.select(*PROMPT).unique().sort(*PROMPT)
        p = prompts.height
        draws = np.random.default_rng(seed).integers(0, p, size=(resamples, p))
        weights = np.zeros((resamples + 1, p))  # row 0: every prompt once (the point estimate)
        weights[0] = 1.0
        np.add.at(weights, (np.repeat(np.arange(1, resamples + 1), p), draws.ravel()), 1.0)
        data = data.join(prompts.with_row_index("prompt"), on=list(PROMPT))
        for (coverage,), cov in data.group_by(["coverage"], maintain_order=True):
            if reference not in set(cov["ranking"]):
                continue
            for metric, higher in metrics.items():
                sign = -1.0 if higher else 1.0
                ref_budgets, targets = _resampled_means(cov, reference, metric, weights, sign)
                if ref_budgets.size == 0:
                    continue
                for ranking in keep:
                    if ranking not in set(cov["ranking"]):
                        continue
                    budgets, curves = _resampled_means(cov, ranking, metric, weights, sign)
                    if budgets.size == 0:
                        continue
                    needed, code = budgets_needed(budgets, curves, targets)
                    shares = (ref_budgets - needed) / ref_budgets
                    for j, b in enumerate(ref_budgets):
                        finite = shares[1:, j][np.isfinite(shares[1:, j])]
                        lo, hi = np.percentile(finite, [2.5, 97.5]) if finite.size else (
                            np.nan, np.nan)
                        rows.append(dict(
                            zip(by, key), loop=loop, metric=metric, coverage=coverage,
                            ranking=ranking, budget=int(b), target=sign * targets[0, j],
                            budget_needed=needed[0, j], sweep=str(SWEEP[code[0, j]]),
                            saved=shares[0, j], saved_lo=float(lo), saved_hi=float(hi),
                            resampled=shares[1:, j].tolist()))
    schema = {**{c: pl.String for c in by}, "loop": pl.String, "metric": pl.String,
              "coverage": pl.String, "ranking": pl.String, "budget": pl.Int64,
              "target": pl.Float64, "budget_needed": pl.Float64, "sweep": pl.String,
              "saved": pl.Float64, "saved_lo": pl.Float64, "saved_hi": pl.Float64,
              "resampled": pl.List(pl.Float64)}
    return pl.DataFrame(rows, schema=schema).sort(*by, "loop", "metric", "coverage", "ranking",
                                                  "budget")


def experts_saved_summary(saved: pl.DataFrame, by: tuple[str, ...] = ("model", "bench")
                          ) -> pl.DataFrame:
    """Per dataset × loop × metric × coverage × ranking, from :func:`experts_saved_frame`: the
    mean saved share over the reference budgets whose B_X lies inside X's sweep
    (``budgets_inside`` of ``budgets``), and its bootstrap 95% interval: the 2.5th/97.5th
    percentiles, over resamples, of the mean of those same budgets' resampled shares (NaN
    beyond left out of a resample's mean; a resample with none left is left out)."""
    rows = []
    group = [*by, "loop", "metric", "coverage", "ranking"]
    for key, frame in saved.group_by(group, maintain_order=True):
        inside = frame.filter(pl.col("sweep") == "inside")
        lo = hi = mean = float("nan")
        if inside.height:
            mean = float(inside["saved"].mean())
            resampled = np.array(inside["resampled"].to_list(), dtype=float)  # [budgets, R]
            finite = np.isfinite(resampled).any(axis=0)
            if finite.any():
                with np.errstate(invalid="ignore"):
                    per = np.nanmean(resampled[:, finite], axis=0)
                lo, hi = (float(v) for v in np.percentile(per, [2.5, 97.5]))
        rows.append(dict(zip(group, key), budgets_inside=inside.height, budgets=frame.height,
                         saved=mean, saved_lo=lo, saved_hi=hi))
    schema = {**{c: pl.String for c in group}, "budgets_inside": pl.Int64, "budgets": pl.Int64,
              "saved": pl.Float64, "saved_lo": pl.Float64, "saved_hi": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def experts_saved(con: duckdb.DuckDBPyConnection, table: str = OPEN_TABLE,
                  resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
                  ) -> pl.DataFrame:
    """:func:`experts_saved_frame` of one replay table (open loop: RSE; closed loop: τ, KL) for
    every model × benchmark, the per-prompt sums computed in DuckDB from the columns
    :mod:`catalog.replay_metrics` declares for the matched view columns."""
    metrics = MATCHED_METRICS[table]
    sums = ", ".join(
        f"sum({c}::DOUBLE) AS {m}_sum, count({c}) AS {m}_n"
        for m in metrics for c in [_metric_column(table, m).name])
    totals = con.sql(f"""SELECT model, bench, run, prompt_index, ranking, coverage, budget, {sums}
                         FROM {table} WHERE {budget_mode(con, table)} = '{FIXED}'
                         GROUP BY ALL""").pl()  # fixed budgets: B is the experts a layer gets
    return experts_saved_frame(totals, metrics, TABLES[table].loop, resamples=resamples, seed=seed)


def experts_saved_open(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Open loop: experts saved at matched mean RSE (:func:`experts_saved`)."""
    return experts_saved(con, OPEN_TABLE)


def experts_saved_closed(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Closed loop: experts saved at matched mean τ and mean KL (:func:`experts_saved`)."""
    return experts_saved(con, CLOSED_TABLE)


METRIC_LABELS = {"rse": "mean RSE", "tau": "mean τ", "kl": "mean KL"}


NET_NOTE = ("Net of its own bytes: a ranking that reads weights of its own at every "
            "verification pass (sketch's surrogates, policy.overhead) saves (B − B_X − e) / B, e its "
            "bytes per layer in experts of the named shape; averaged over the same router budgets. "
            "At a tiny model's shape the surrogate outweighs the experts it saves; at the family's "
            "real shape the charge is a projection (the saving is the tiny model's).")


def net_saved(saved: pl.DataFrame, charge: dict[str, float]) -> pl.DataFrame:
    """Per loop × metric × coverage × ranking of one dataset's :func:`experts_saved_frame`, the
    mean over the budgets inside X's sweep of the share saved net of X's own bytes:

        net = (B − B_X − e_X) / B        (e_X = ``charge[X]`` expert-equivalents, 0 if absent)"""
    group = ["loop", "metric", "coverage", "ranking"]
    return saved.filter(pl.col("sweep") == "inside").with_columns(
        e=pl.col("ranking").replace_strict(charge, default=0.0, return_dtype=pl.Float64),
    ).group_by(group, maintain_order=True).agg(
        net=((pl.col("budget") - pl.col("budget_needed") - pl.col("e")) / pl.col("budget")).mean())


def experts_saved_display(saved: pl.DataFrame,
                          charges: dict[str, dict[str, float]] | None = None) -> pl.DataFrame:
    """One dataset's :func:`experts_saved_frame` (open and closed loop rows together) as the
    table the report and the dashboard show: per loop × matched metric × coverage × ranking the
    mean share saved with its interval (:func:`experts_saved_summary`), the router budgets
    inside the ranking's sweep, and per router budget ``B → B_X (share)`` ("≤ B₀ (≥ share)"
    below the sweep, "beyond" past it). ``charges``: per shape label, each ranking's own bytes
    per layer in experts of that shape (:meth:`analysis.cost.ModelShape.overhead_experts`); for
    every label under which a shown ranking has some, a column ``net, <label>``
    (:func:`net_saved`, :data:`NET_NOTE`)."""
    if saved.is_empty():
        return pl.DataFrame()
    summary = experts_saved_summary(saved, by=())
    shown = set(summary["ranking"])
    for label, charge in (charges or {}).items():
        if any(charge.get(r, 0.0) > 0 for r in shown):
            summary = summary.join(net_saved(saved, charge).rename({"net": f"net, {label}"}),
                                   on=["loop", "metric", "coverage", "ranking"], how="left")
    nets = [c for c in summary.columns if c.startswith("net, ")]
    per_budget = {}
    for r in saved.iter_rows(named=True):
        if r["sweep"] == "inside":
            text = f"{r['budget']} → {r['budget_needed']:.1f} ({r['saved']:.0%})"
        elif r["sweep"] == "below":
            text = f"{r['budget']} → ≤ {r['budget_needed']:.0f} (≥ {r['saved']:.0%})"
        else:
            text = f"{r['budget']} → beyond"
        key = (r["loop"], r["metric"], r["coverage"], r["ranking"])
        per_budget.setdefault(key, []).append(text)
    return summary.select(
        pl.col("loop"), pl.col("metric").replace_strict(METRIC_LABELS, default=pl.col("metric"))
        .alias("matched on"), "coverage", "ranking", "saved", "saved_lo", "saved_hi", *nets,
        pl.format("{} of {}", "budgets_inside", "budgets").alias("router budgets inside"),
        pl.Series("per router budget: B → B_X (saved)", [
            ", ".join(per_budget[k]) for k in summary.select(
                "loop", "metric", "coverage", "ranking").iter_rows()]),
    ).sort(pl.col("loop").replace_strict({"open": 0, "closed": 1}, default=2), "matched on",
           "coverage", "ranking")
