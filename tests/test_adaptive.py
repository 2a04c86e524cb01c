"""Adaptive budgets (policy/adaptive.py) against slow, obviously-correct references: the price
rule and its pass cap against a per-layer loop, the calibrated price against every candidate
price, the adaptive oracle's greedy against exhaustive search on convex curves (where it is
exact), and the invariants (B̄ = B_max gives every layer B_max and the error at B_max)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.policy import adaptive


def price_loop(gains, price, b_min, cap=None):
    """One pass, one layer, one expert at a time."""
    out = []
    for p in range(gains.shape[0]):
        used, row = 0, []
        layers = gains.shape[1]
        for layer in range(layers):
            b = b_min
            for g in gains[p, layer].tolist():
                if g > price:
                    b += 1
                else:
                    break
            if cap is not None:
                b = min(b, cap - used - b_min * (layers - 1 - layer))
            used += b
            row.append(b)
        out.append(row)
    return torch.tensor(out)


def convex_curves(seed, passes, layers, steps):
    """Error curves with non-increasing, non-negative gains (diminishing returns), ending at 0."""
    g = torch.Generator().manual_seed(seed)
    gains = torch.rand(passes, layers, steps, generator=g, dtype=torch.float64)
    gains = gains.sort(-1, descending=True).values * torch.rand(passes, layers, 1, generator=g,
                                                                 dtype=torch.float64)
    tail = gains.flip(-1).cumsum(-1).flip(-1)  # e(B) = Σ of the gains still to come
    return torch.cat([tail, torch.zeros(passes, layers, 1, dtype=torch.float64)], -1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), b_min=st.integers(1, 4), price=st.floats(0, 1),
       capped=st.booleans())
def test_price_rule_equals_the_per_layer_loop(seed, b_min, price, capped):
    g = torch.Generator().manual_seed(seed)
    gains = torch.rand(5, 4, 6, generator=g)
    cap = b_min * 4 + int(torch.randint(0, 25, (1,), generator=g)) if capped else None
    got = adaptive.price_budgets(gains, price, b_min, cap)
    assert torch.equal(got, price_loop(gains, price, b_min, cap))
    if cap is not None:
        assert bool((got.sum(-1) <= cap).all()) and bool((got >= b_min).all())


def test_price_rule_stops_at_the_first_gain_below_the_price():
    """Later gains above the price do not count: a layer cannot skip an expert of its order."""
    gains = torch.tensor([[[0.5, 0.1, 0.9, 0.9]]])
    assert adaptive.price_budgets(gains, 0.2, 2).tolist() == [[3]]


def test_pass_cap_below_the_minimum_is_refused():
    with pytest.raises(ValueError, match="below B_min"):
        adaptive.price_budgets(torch.rand(1, 4, 3), 0.1, 2, cap=7)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), target=st.floats(2, 8), capped=st.booleans())
def test_calibrated_price_is_the_candidate_closest_to_the_target_mean(seed, target, capped):
    g = torch.Generator().manual_seed(seed)
    gains = torch.rand(6, 3, 6, generator=g).round(decimals=1)  # ties: a step function
    b_min, cap = 2, (20 if capped else None)
    price = adaptive.calibrate_price(gains, target, b_min, cap)
    chosen = float(adaptive.price_budgets(gains, price, b_min, cap).double().mean())
    every = [float("-inf"), *sorted(set(gains.flatten().tolist()))]
    means = [float(adaptive.price_budgets(gains, p, b_min, cap).double().mean()) for p in every]
    assert abs(chosen - target) <= min(abs(m - target) for m in means) + 1e-12


def test_calibrated_price_at_b_max_loads_every_expert_and_leaves_no_error():
    curves = convex_curves(0, 7, 4, 5)
    gains = adaptive.gains_of(curves)
    gains[0, 0, -1] = 0.0  # a gain of exactly zero still loads at B̄ = B_max
    price = adaptive.calibrate_price(gains, 1 + 5, 1)
    budgets = adaptive.price_budgets(gains, price, 1)
    assert bool((budgets == 6).all())
    assert float(adaptive.errors_at(curves, budgets, 1).abs().max()) == 0.0
    for hind in (adaptive.hindsight_budgets(gains, 6 * 4, 1),
                 adaptive.best_budgets(curves, 6 * 4, 1)):
        assert bool((hind == 6).all())


def exhaustive(curves, total, b_min):
    """The least Σ_l e_l(B_l) over every allocation with Σ B_l = total, one pass."""
    layers, points = curves.shape
    best = float("inf")
    for choice in itertools.product(range(points), repeat=layers):
        if sum(choice) + b_min * layers == total:
            best = min(best, sum(float(curves[layer, c]) for layer, c in enumerate(choice)))
    return best


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(1, 3), steps=st.integers(1, 4),
       b_min=st.integers(1, 3), data=st.data())
def test_adaptive_oracle_greedy_is_exact_on_convex_curves(seed, layers, steps, b_min, data):
    curves = convex_curves(seed, 1, layers, steps)
    total = data.draw(st.integers(b_min * layers, (b_min + steps) * layers))
    budgets = adaptive.hindsight_budgets(adaptive.gains_of(curves), total, b_min)
    assert int(budgets.sum()) == total and bool((budgets >= b_min).all())
    assert bool((budgets <= b_min + steps).all())
    got = float(adaptive.errors_at(curves, budgets, b_min).sum())
    assert got == pytest.approx(exhaustive(curves[0], total, b_min), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(1, 3), steps=st.integers(0, 4),
       b_min=st.integers(0, 3), data=st.data())
def test_exact_hindsight_equals_exhaustive_search_on_any_curves(seed, layers, steps, b_min, data):
    g = torch.Generator().manual_seed(seed)
    curves = torch.rand(2, layers, steps + 1, generator=g, dtype=torch.float64)  # not convex
    total = data.draw(st.integers(b_min * layers, (b_min + steps) * layers))
    budgets = adaptive.best_budgets(curves, total, b_min)
    assert bool((budgets.sum(-1) == total).all()) and bool((budgets >= b_min).all())
    for p in range(2):
        got = float(adaptive.errors_at(curves[p], budgets[p], b_min).sum())
        assert got == pytest.approx(exhaustive(curves[p], total, b_min), abs=1e-12)


def test_adaptive_oracle_greedy_can_miss_on_a_non_convex_curve():
    """The optimality condition is needed: a curve whose second expert pays more than its first
    (no diminishing returns) hides its gain from the greedy."""
    curves = torch.tensor([[[1.0, 0.95, 0.0], [0.5, 0.3, 0.2]]], dtype=torch.float64)
    budgets = adaptive.hindsight_budgets(adaptive.gains_of(curves), 2, 0)
    got = float(adaptive.errors_at(curves, budgets, 0).sum())
    assert budgets.tolist() == [[0, 2]] and got == pytest.approx(1.2)
    assert exhaustive(curves[0], 2, 0) == pytest.approx(0.5)
    assert adaptive.best_budgets(curves, 2, 0).tolist() == [[2, 0]]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), total=st.integers(0, 40))
def test_adaptive_oracle_spends_exactly_the_pass_total_when_it_can(seed, total):
    g = torch.Generator().manual_seed(seed)
    gains = torch.randn(3, 4, 5, generator=g)  # any sign: non-convex, non-monotone
    budgets = adaptive.hindsight_budgets(gains, total, 2)
    assert bool((budgets.sum(-1) == min(max(total, 8), 28)).all())


def test_calibrated_predictor_scales_mass_per_layer_and_budget():
    """``ê_l(B) = r_l(B)·m(B)`` with ``r = Σ e / Σ m`` per layer and budget, then non-increasing."""
    g = torch.Generator().manual_seed(3)
    mass = torch.rand(4, 2, 5, generator=g, dtype=torch.float64).sort(-1, descending=True).values
    errors = mass * torch.rand(4, 2, 5, generator=g, dtype=torch.float64)
    layers = torch.tensor([5, 2])
    pred = adaptive.predictor("calibrated").fit(mass, errors, layers)
    new = torch.rand(3, 2, 5, generator=g, dtype=torch.float64)
    want = torch.empty(3, 2, 5, dtype=torch.float64)
    for p, j, b in itertools.product(range(3), range(2), range(5)):
        ratio = float(errors[:, j, b].sum() / mass[:, j, b].sum())
        want[p, j, b] = ratio * float(new[p, j, b])
        if b:
            want[p, j, b] = min(want[p, j, b], want[p, j, b - 1])
    assert torch.allclose(pred.gains(new, layers), want[..., :-1] - want[..., 1:])
    with pytest.raises(ValueError, match="no tree-layer of layer"):
        pred.gains(new, torch.tensor([5, 7]))


def test_mass_predictor_is_the_next_expert_s_share_and_unknown_names_are_refused():
    mass = torch.tensor([[[0.6, 0.25, 0.1, 0.0]]])
    assert torch.allclose(adaptive.predictor("mass").gains(mass, torch.tensor([0])),
                          torch.tensor([[[0.35, 0.15, 0.1]]], dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown gain predictor"):
        adaptive.predictor("nope")
