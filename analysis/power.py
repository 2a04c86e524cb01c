"""How many trees a paired comparison needs: power for the mean of per-tree differences.

Closed loop compares a ranking X with router on the same trees through ``Δ_t = X_t − router_t``
(accepted length, say). Under the normal approximation of a two-sided test at level α on the
mean of n differences with sample standard deviation s, a true mean difference δ is detected
with probability 1 − β once

    n(δ) = ⌈((z_{1−α/2} + z_{1−β}) · s / δ)²⌉                         (:func:`trees_needed`)

and with n trees the smallest difference detected with that probability is

    δ_min(n) = (z_{1−α/2} + z_{1−β}) · s / √n                         (:func:`resolvable`)

Defaults: α = 0.05, 1 − β = 0.8, δ = 0.1 tokens. Trees of one prompt are treated as independent,
as the bootstrap intervals beside them resample them (steps of one prompt are correlated, so
both are optimistic). With s = 0 (every tree gives the same difference) one tree suffices.

The interval these sizes belong to (:func:`paired_interval`) is the paired t interval of the
mean difference, the test the formulas approximate with z:

    d̄ ± t_{1−α/2, n−1} · s / √n

Paired by tree: each Δ_t compares the two settings on the same tree, so what varies between
trees (how hard the tree is) cancels.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm
from scipy.stats import t as student_t

ALPHA = 0.05
POWER = 0.8
EFFECT = 0.1  # tokens of accepted length


def _z(alpha: float, power: float) -> float:
    return float(norm.ppf(1 - alpha / 2) + norm.ppf(power))


def trees_needed(deltas, effect: float = EFFECT, alpha: float = ALPHA,
                 power: float = POWER) -> int | None:
    """n(δ) of the module docstring for the per-tree differences ``deltas`` (None with fewer
    than two, where no spread is known)."""
    d = np.asarray(deltas, dtype=float)
    if d.size < 2:
        return None
    s = float(d.std(ddof=1))
    return max(1, math.ceil((_z(alpha, power) * s / effect) ** 2))


def resolvable(deltas, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """δ_min(n) of the module docstring at the ``len(deltas)`` trees measured (None with fewer
    than two)."""
    d = np.asarray(deltas, dtype=float)
    if d.size < 2:
        return None
    return _z(alpha, power) * float(d.std(ddof=1)) / math.sqrt(d.size)


def paired_interval(deltas, alpha: float = ALPHA) -> tuple[float, float, float] | None:
    """``(d̄, low, high)``: the mean of the per-tree differences ``deltas`` and its two-sided
    1 − α paired t interval of the module docstring (None with fewer than two, where no spread
    is known; ``(d̄, d̄, d̄)`` when every tree gives the same difference)."""
    d = np.asarray(deltas, dtype=float)
    if d.size < 2:
        return None
    mean = float(d.mean())
    quantile = float(student_t.ppf(1 - alpha / 2, d.size - 1))
    half = quantile * float(d.std(ddof=1)) / math.sqrt(d.size)
    return mean, mean - half, mean + half
