"""MoESD's target efficiency ``η(b, γ) = T(b, 1) / T(b, γ)``: fit and regimes.

``profile-target`` (:mod:`profiling.profile_target`) times the target's forward for batch size b
and γ tokens per sequence and stores the points as the catalog's ``profile`` table
(:data:`catalog.schema.PROFILE`); this module fits them. The fit models a pass as

    T(b, γ) ≈ c₀ + c₁ · E(bγ) + c₂ · bγ,     E(t) = N·[1 − ((N−k)/N)^t]  (activated experts)

(non-negative least squares): fixed cost, expert weight traffic growing with activated experts,
and per-token compute. Three regimes follow: *expert growth* (E(bγ) < 0.9·N: every extra token
loads new experts), *activation saturation* (all experts loaded, memory still dominates), and
*compute-bound* (c₂·bγ exceeds c₀ + c₁·E).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from moe_spec.analysis.routing import moesd_uniform


def efficiency(points: pl.DataFrame) -> pl.DataFrame:
    """``η(b, γ) = T(b, 1) / T(b, γ)`` for every measured point (γ = 1 must be measured)."""
    t1 = points.filter(pl.col("gamma") == 1).select("batch_size", pl.col("seconds").alias("t1"))
    return points.join(t1, on="batch_size").with_columns(eta=pl.col("t1") / pl.col("seconds"))


def fit(points: pl.DataFrame, n: int, k: int) -> dict:
    """``T(b, γ) ≈ c₀ + c₁·E(bγ) + c₂·bγ`` with c ≥ 0 under the soft-L1 loss
    (:func:`analysis.warmup.nonneg_fit`) to ``points`` (batch_size, gamma, seconds), subject to the
    sample check (:func:`analysis.warmup.check`): with a ``passes`` column (kept passes behind
    each point's seconds) a point with fewer than 5 is left out (``left_out``), and fewer than
    3 + 2 points left refuse the fit (``refused``: "not fitted: only 1 pass at b = 2 (need 5)";
    c₀, c₁, c₂ and the relative RMSE are then NaN). ``relative_rmse = √mean(r²) / mean(T)`` over
    the points fitted (``points``)."""
    from moe_spec.analysis import warmup
    single = points.group_by("batch_size").agg(pl.col("gamma").n_unique() == 1)["gamma"].all()
    labels = [f"b = {b:g}" if single else f"b = {b:g}, γ = {g:g}"
              for b, g in zip(points["batch_size"], points["gamma"])]
    passes = points["passes"] if "passes" in points.columns else [warmup.MIN_PASSES] * points.height
    sample = warmup.check(passes, labels, 3)
    out = dict(points=len(sample.used), left_out=sample.left_out, refused=sample.refused)
    if sample.refused:
        nan = float("nan")
        return dict(c0=nan, c1=nan, c2=nan, relative_rmse=nan, **out)
    points = points.select(pl.all().gather(sample.used))
    tokens = (points["batch_size"] * points["gamma"]).to_numpy().astype(float)
    e = moesd_uniform(n, k, tokens)
    a = np.c_[np.ones_like(tokens), e, tokens]
    y = points["seconds"].to_numpy()
    coef = warmup.nonneg_fit(a, y)
    pred = a @ coef
    return dict(c0=coef[0], c1=coef[1], c2=coef[2],
                relative_rmse=float(np.sqrt(((y - pred) ** 2).mean()) / y.mean()), **out)


def regime(tokens, n: int, k: int, coef: dict) -> list[str]:
    """Which term of the fitted pass time dominates at each token count; "not fitted" for
    every point when the fit was refused (too few passes: :mod:`analysis.warmup`)."""
    tokens = np.asarray(tokens, dtype=float)
    if coef.get("refused"):
        return ["not fitted"] * len(tokens)
    e = moesd_uniform(n, k, tokens)
    out = []
    for t, ei in zip(tokens, e):
        if coef["c2"] * t > coef["c0"] + coef["c1"] * ei:
            out.append("compute-bound")
        elif ei < 0.9 * n:
            out.append("expert growth")
        else:
            out.append("activation saturation")
    return out
