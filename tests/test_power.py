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


def accepted_by_the_paired_test(a, b, shift: float, alpha: float = 0.05) -> bool:
    """The paired t test of ``a − b = shift`` (scipy's ``ttest_rel`` on ``a`` against ``b``
    moved by the shift) does not reject it at level α."""
    from scipy.stats import ttest_rel
    return ttest_rel(a, [x + shift for x in b]).pvalue >= alpha


def inverted_interval(a, b, alpha: float = 0.05) -> tuple[float, float, float]:
    """The slow, obviously-correct reference: the mean of the per-pair differences and the set
    of shifts the paired test accepts, each end found by bisection between the mean (accepted)
    and a shift it rejects."""
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / len(diffs)
    ends = []
    for sign in (-1, 1):
        inside, step = mean, 1.0
        while accepted_by_the_paired_test(a, b, mean + sign * step, alpha):
            step *= 2
        outside = mean + sign * step
        for _ in range(200):
            mid = (inside + outside) / 2
            if accepted_by_the_paired_test(a, b, mid, alpha):
                inside = mid
            else:
                outside = mid
        ends.append(inside)
    return mean, ends[0], ends[1]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=3, max_size=80))
def test_paired_interval_is_the_set_of_differences_the_paired_test_accepts(pairs):
    """Accepted lengths of the same trees under two settings (small integers, many ties): the
    paired interval equals the inverted paired t test, to 1e-9."""
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    if len({x - y for x, y in pairs}) < 2:  # no spread: the interval is the one difference
        d = a[0] - b[0]
        assert power.paired_interval(np.subtract(a, b)) == (d, d, d)
        return
    mean, lo, hi = power.paired_interval(np.subtract(a, b))
    ref = inverted_interval(a, b)
    assert mean == pytest.approx(ref[0], abs=1e-12)
    assert lo == pytest.approx(ref[1], abs=1e-9) and hi == pytest.approx(ref[2], abs=1e-9)


def test_paired_interval_covers_the_true_difference_95_percent_of_the_time():
    """Simulated studies of 40 trees whose difference has mean 0.3: the interval holds 0.3 in
    about 95% of them, and pairing removes what the trees share (a common tree effect ten
    times the difference's spread leaves the interval as narrow as without it)."""
    rng = np.random.default_rng(3)
    tree = rng.normal(0, 3.0, size=(2000, 40))  # how hard each tree is: both settings see it
    diff = rng.normal(0.3, 0.3, size=(2000, 40))
    a, b = tree + diff, tree
    found = [power.paired_interval(x - y) for x, y in zip(a, b)]
    covered = np.mean([lo <= 0.3 <= hi for _, lo, hi in found])
    assert covered == pytest.approx(0.95, abs=0.015)
    assert np.median([hi - lo for _, lo, hi in found]) < 0.25  # 2·t·0.3/√40 ≈ 0.19


def test_paired_interval_needs_two_trees():
    assert power.paired_interval([0.4]) is None and power.paired_interval([]) is None
