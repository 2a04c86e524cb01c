"""The routing analyses as first written: DuckDB SQL straight over the ``routing`` table.

Kept as the tests' reference for :mod:`analysis.routing`, which reads the per-run summaries of
:mod:`analysis.summaries` instead (same definitions, same numbers, a thousand times less data).
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl

from moe_spec.analysis.routing import balance, moesd_marginal, moesd_uniform

TREE = "model, bench, run, prompt_index, step, layer"

_MASS = f"""
    SELECT {TREE}, i - 1 AS expert, sum(p) AS mass
    FROM (SELECT {TREE}, unnest(router_probs) AS p, generate_subscripts(router_probs, 1) AS i
          FROM routing)
    GROUP BY ALL
"""

_RANKED = f"""
    SELECT *, mass / sum(mass) OVER w AS share,
           row_number() OVER (PARTITION BY {TREE} ORDER BY mass DESC, expert) AS rank_desc,
           count(*) OVER w AS n
    FROM ({_MASS}) WINDOW w AS (PARTITION BY {TREE})
"""


def heavy_tails(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per (tree, layer): experts for 50/90/99% of router mass, Gini, top-N/2 share."""
    return con.sql(f"""
        WITH r AS ({_RANKED}),
        c AS (SELECT *, sum(share) OVER (PARTITION BY {TREE} ORDER BY rank_desc) AS cum FROM r)
        SELECT {TREE}, any_value(n) AS num_experts,
               min(rank_desc) FILTER (WHERE cum >= 0.5 - 1e-9) AS experts_50,
               min(rank_desc) FILTER (WHERE cum >= 0.9 - 1e-9) AS experts_90,
               min(rank_desc) FILTER (WHERE cum >= 0.99 - 1e-9) AS experts_99,
               sum((2 * (n + 1 - rank_desc) - n - 1) * share) / any_value(n) AS gini,
               sum(share) FILTER (WHERE rank_desc <= n // 2) AS top_half_share
        FROM c GROUP BY ALL ORDER BY ALL
    """).pl()


def heavy_tails_summary(tails: pl.DataFrame, by: tuple[str, ...] = ("bench", "layer")) -> pl.DataFrame:
    cols = ["experts_50", "experts_90", "experts_99", "gini", "top_half_share"]
    return tails.group_by(*by).agg([pl.col(c).mean() for c in cols] + [pl.len().alias("trees")]) \
        .sort(list(by))


def coverage_curve(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Mean fraction of router mass held by the top-B experts of a tree, B = 1..N."""
    return con.sql(f"""
        WITH r AS ({_RANKED}),
        c AS (SELECT *, sum(share) OVER (PARTITION BY {TREE} ORDER BY rank_desc) AS cum FROM r)
        SELECT {by}, rank_desc AS budget, avg(cum) AS coverage, count(*) AS trees
        FROM c GROUP BY ALL ORDER BY ALL
    """).pl()


def activation_growth(con: duckdb.DuckDBPyConnection, by: str = "model, bench") -> pl.DataFrame:
    """Measured unique experts among the first t tree tokens, mean over tree-layers, with the
    MoESD uniform expectation and the expectation under i.i.d. routing with each *layer's* own
    measured marginals (averaged over layers: pooling marginals across layers would hide the
    experts a layer never selects)."""
    measured = con.sql(f"""
        WITH first AS (
            SELECT {TREE}, expert, min(node) AS first_node
            FROM (SELECT {TREE}, node, unnest(topk_ids) AS expert FROM routing) GROUP BY ALL),
        new AS (SELECT {TREE}, first_node AS node, count(*) AS new FROM first GROUP BY ALL),
        sizes AS (SELECT {TREE}, max(node) + 1 AS m FROM routing GROUP BY ALL),
        grid AS (SELECT {TREE}, unnest(range(m)) AS node FROM sizes),
        cum AS (SELECT {TREE}, node, sum(coalesce(new, 0)) OVER (
                    PARTITION BY {TREE} ORDER BY node) AS unique_experts
                FROM grid LEFT JOIN new USING ({TREE}, node))
        SELECT {by}, node + 1 AS tokens, avg(unique_experts) AS unique_experts,
               count(*) AS tree_layers
        FROM cum GROUP BY ALL ORDER BY ALL
    """).pl()
    params = con.sql(f"""
        SELECT {by}, any_value(len(router_probs)) AS n, any_value(len(topk_ids)) AS k
        FROM routing GROUP BY ALL
    """).pl()
    marg = con.sql(f"""
        WITH sel AS (SELECT {by}, layer, unnest(topk_ids) AS expert FROM routing),
        tok AS (SELECT {by}, layer, count(*) AS tokens FROM routing GROUP BY ALL)
        SELECT {by}, layer, expert, count(*) / any_value(tok.tokens) AS q
        FROM sel JOIN tok USING ({by}, layer) GROUP BY ALL
    """).pl()
    keys = [c.strip() for c in by.split(",")]
    rows = []
    for group, frame in measured.group_by(keys, maintain_order=True):
        key = dict(zip(keys, group))
        p = params.filter(*(pl.col(c) == v for c, v in key.items())).row(0, named=True)
        t = frame["tokens"].to_numpy()
        per_layer = [moesd_marginal(g["q"].to_numpy(), t) for _, g in
                     marg.filter(*(pl.col(c) == v for c, v in key.items())).group_by("layer")]
        rows.append(frame.with_columns(
            uniform=pl.Series(moesd_uniform(p["n"], p["k"], t)),
            marginal=pl.Series(np.mean(per_layer, axis=0))))
    return pl.concat(rows) if rows else measured


def load_balance(con: duckdb.DuckDBPyConnection, by: str = "model, bench, layer") -> pl.DataFrame:
    """Per layer: CV and normalised entropy of top-k selection counts, dead experts."""
    counts = con.sql(f"""
        WITH n AS (SELECT {by}, any_value(len(router_probs)) AS n FROM routing GROUP BY ALL),
        experts AS (SELECT {by}, unnest(range(n)) AS expert FROM n),
        c AS (SELECT {by}, expert, count(*) AS c
              FROM (SELECT {by}, unnest(topk_ids) AS expert FROM routing) GROUP BY ALL)
        SELECT {by}, e.expert, coalesce(c.c, 0) AS selections
        FROM experts e LEFT JOIN c USING ({by}, expert)
    """).pl()
    return balance(counts, [c.strip() for c in by.split(",")])  # the SQL counts are what differ
