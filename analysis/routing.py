"""Routing statistics of captured trees, from the per-run summaries (:mod:`analysis.summaries`).

Every function takes a connection from :func:`analysis.sql.connect` and returns a polars frame;
it aggregates the small ``summary_tree_layers`` / ``summary_layers`` views in DuckDB (filters on
model, bench, run, role and layer reach the partitions), never the ``routing`` table itself.
Per tree (one verification pass) and MoE layer, with ``s_i = Σ_t g_i(t)`` the router mass of
expert i over the tree's tokens and ``share_i = s_i / Σ_j s_j``:

* heavy tails: experts needed to hold 50/90/99% of the mass (sorted by share), and the Gini
  coefficient of the shares, ``G = Σ_r (2r − N − 1) x_(r) / (N Σ x)`` (x ascending, r = 1..N);
* coverage curve: ``C(B) = Σ_{r≤B} share_(r)`` (shares descending), B = 1..N, averaged over
  trees (MoE-Spec Fig. 7);
* activation growth: unique experts among the first t tree tokens (node order, breadth first),
  ``U(t) = |∪_{node<t} T_k(node)|``, averaged over trees (MoE-Spec Fig. 2b/4a), against MoESD's
  uniform ``N(t) = N·[1 − ((N−k)/N)^t]`` and the marginal-based ``Σ_i 1 − (1 − q_i)^t``, with
  ``q_i`` the share of a layer's tokens whose top-k holds i (per layer, then averaged);
* load balance per layer: coefficient of variation and normalised entropy of expert selection
  counts, and dead experts (never selected).
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl

from moe_spec.catalog import CatalogError


def require_summaries(con: duckdb.DuckDBPyConnection) -> None:
    """Refuse to answer from a partial picture: every complete run must have fresh summaries."""
    missing = con.execute("SELECT string_agg(run, ', ') FROM _complete_runs "
                          "WHERE NOT summarised").fetchall()[0][0]
    if missing:
        raise CatalogError(f"routing summaries are missing or stale for run(s) {missing}; build "
                           "them with analysis.summaries.ensure(traces) (report and the "
                           "dashboard do so themselves)")


def heavy_tails(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per (tree, layer): experts for 50/90/99% of router mass, Gini, top-N/2 share."""
    require_summaries(con)
    return con.sql("""
        SELECT t.model, t.bench, t.run, t.prompt_index, t.step, t.layer,
               l.num_experts, t.experts_50, t.experts_90, t.experts_99, t.gini, t.top_half_share
        FROM summary_tree_layers t JOIN summary_layers l USING (model, bench, run, layer)
        ORDER BY ALL
    """).pl()


def heavy_tails_summary(tails: pl.DataFrame, by: tuple[str, ...] = ("bench", "layer")) -> pl.DataFrame:
    cols = ["experts_50", "experts_90", "experts_99", "gini", "top_half_share"]
    return tails.group_by(*by).agg([pl.col(c).mean() for c in cols] + [pl.len().alias("trees")]) \
        .sort(list(by))


def heavy_tails_by_layer(con: duckdb.DuckDBPyConnection,
                         by: str = "model, bench, layer") -> pl.DataFrame:
    """:func:`heavy_tails_summary` computed in DuckDB (no per-tree-layer rows leave it)."""
    require_summaries(con)
    return con.sql(f"""
        SELECT {by}, avg(experts_50) AS experts_50, avg(experts_90) AS experts_90,
               avg(experts_99) AS experts_99, avg(gini) AS gini,
               avg(top_half_share) AS top_half_share, count(*)::UINTEGER AS trees
        FROM summary_tree_layers GROUP BY ALL ORDER BY ALL
    """).pl()


def coverage_curve(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Mean fraction of router mass held by the top-B experts of a tree, B = 1..N:
    ``Σ coverage_sum[B−1] / Σ tree_layers`` over the selected runs and layers."""
    require_summaries(con)
    return con.sql(f"""
        SELECT {by}, budget, sum(total) / sum(tree_layers) AS coverage,
               sum(tree_layers)::BIGINT AS trees
        FROM (SELECT {by}, tree_layers, unnest(coverage_sum) AS total,
                     generate_subscripts(coverage_sum, 1) AS budget FROM summary_layers)
        GROUP BY ALL ORDER BY ALL
    """).pl()


def activation_growth(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Measured unique experts among the first t tree tokens, mean over tree-layers, with the
    MoESD uniform expectation and the expectation under i.i.d. routing with each *layer's* own
    measured marginals (averaged over layers: pooling marginals across layers would hide the
    experts a layer never selects)."""
    require_summaries(con)
    measured = con.sql(f"""
        SELECT {by}, tokens, sum(total) / sum(count) AS unique_experts,
               sum(count)::BIGINT AS tree_layers
        FROM (SELECT {by}, unnest(growth_sum) AS total, unnest(growth_count) AS count,
                     generate_subscripts(growth_sum, 1) AS tokens FROM summary_layers)
        GROUP BY ALL ORDER BY ALL
    """).pl()
    marg = con.sql(f"""
        WITH tok AS (SELECT {by}, layer, sum(tokens) AS tokens FROM summary_layers GROUP BY ALL)
        SELECT {by}, layer, expert, sum(c) / any_value(tok.tokens) AS q
        FROM (SELECT {by}, layer, unnest(selections) AS c,
                     generate_subscripts(selections, 1) AS expert FROM summary_layers)
        JOIN tok USING ({by}, layer) GROUP BY ALL ORDER BY ALL
    """).pl()
    keys = [c.strip() for c in by.split(",")]
    rows = []
    for group, frame in measured.group_by(keys, maintain_order=True):
        key = dict(zip(keys, group))
        mine = marg.filter(*(pl.col(c) == v for c, v in key.items()))
        q = [g["q"].to_numpy() for _, g in mine.group_by("layer", maintain_order=True)]
        n, k = len(q[0]), int(round(q[0].sum()))  # per layer Σ_i q_i = k
        t = frame["tokens"].to_numpy()
        rows.append(frame.with_columns(
            uniform=pl.Series(moesd_uniform(n, k, t)),
            marginal=pl.Series(np.mean([moesd_marginal(qi, t) for qi in q], axis=0))))
    return pl.concat(rows) if rows else measured


def moesd_uniform(n: int, k: int, t) -> np.ndarray:
    """``N(t) = N·[1 − ((N−k)/N)^t]``: expected unique experts after t i.i.d. uniform tokens."""
    return n * (1 - ((n - k) / n) ** np.asarray(t, dtype=float))


def moesd_marginal(q, t) -> np.ndarray:
    """``Σ_i 1 − (1 − q_i)^t`` with per-token selection probabilities ``q_i`` (Σ q_i = k)."""
    q = np.asarray(q, dtype=float)[:, None]
    return (1 - (1 - q) ** np.asarray(t, dtype=float)[None]).sum(0)


def load_balance(con: duckdb.DuckDBPyConnection, by: str = "model, bench, layer") -> pl.DataFrame:
    """Per layer: CV and normalised entropy of top-k selection counts, dead experts."""
    require_summaries(con)
    counts = con.sql(f"""
        SELECT {by}, expert - 1 AS expert, sum(c)::BIGINT AS selections
        FROM (SELECT {by}, unnest(selections) AS c, generate_subscripts(selections, 1) AS expert
              FROM summary_layers)
        GROUP BY ALL
    """).pl()
    return balance(counts, [c.strip() for c in by.split(",")])


def balance(counts: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Per ``keys`` group of per-expert ``selections`` c_i: CV = σ(c)/μ(c), normalised entropy
    −Σ p_i log p_i / log N with p_i = c_i / Σ c, and the experts never selected."""
    return counts.group_by(keys).agg(
        (pl.col("selections").std(ddof=0) / pl.col("selections").mean()).alias("cv"),
        (-(pl.col("selections") / pl.col("selections").sum()).pipe(
            lambda p: (p * p.log()).fill_nan(0.0)).sum() / pl.len().log()).alias("entropy_ratio"),
        (pl.col("selections") == 0).sum().alias("dead_experts"),
        pl.len().alias("num_experts"),
    ).sort(keys)
