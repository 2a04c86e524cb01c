"""The closed loop's sample sizes (analysis.power) against a simulation: at n(δ) trees a paired
difference of true mean δ is detected (the 95% interval of the mean excludes zero) about 80% of
the time, and δ_min(n) is the difference n trees detect that often."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.analysis import power


def detected(rng, n: int, mean: float, sd: float, draws: int = 4000) -> float:
    """Share of simulated studies of n trees whose two-sided 95% normal interval of the mean
    difference excludes zero (the slow, obviously-correct reference)."""
    d = rng.normal(mean, sd, size=(draws, n))
    m, s = d.mean(1), d.std(1, ddof=1)
    return float(np.mean(np.abs(m) > 1.959964 * s / np.sqrt(n)))


@pytest.mark.parametrize("sd", [0.3, 0.8, 1.5])
def test_trees_needed_detects_the_effect_with_the_stated_power(sd):
    rng = np.random.default_rng(7)
    sample = rng.normal(0.0, sd, size=20000)  # the spread a study measured
    n = power.trees_needed(sample)
    assert n == pytest.approx(((1.959964 + 0.841621) * sd / 0.1) ** 2, rel=0.05)
    assert detected(rng, n, 0.1, sd) == pytest.approx(0.8, abs=0.03)
    assert detected(rng, max(2, n // 4), 0.1, sd) < 0.5  # a quarter of the trees: underpowered
    part = sample[:n] - sample[:n].mean()
    part *= sample.std(ddof=1) / part.std(ddof=1)  # n trees with the study's spread
    assert 0.1 * 0.97 <= power.resolvable(part) <= 0.1  # n(δ) trees resolve δ (n rounded up)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=60),
       st.floats(0.01, 1.0))
def test_more_spread_or_a_smaller_effect_needs_more_trees(deltas, effect):
    n = power.trees_needed(deltas, effect)
    assert n >= 1
    assert power.trees_needed(deltas, effect / 2) >= n
    assert power.trees_needed([2 * x for x in deltas], effect) >= n
    assert power.resolvable(deltas) >= 0


def test_too_few_trees_know_no_spread():
    assert power.trees_needed([0.5]) is None and power.resolvable([]) is None
    assert power.trees_needed([1.0, 1.0, 1.0]) == 1  # no spread: one tree tells
