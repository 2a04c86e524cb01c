"""Issue 63's runtime predictors and the study's rules against slow, obviously-correct references:
replay's ``predicted_rse`` (the surrogate's error curve) against a per-token loop over predicted
outputs, the ``surrogate`` predictor (declared inputs, running minimum, calibrated-mass fallback
where no surrogate ran), substitution below k (each token its best B experts of S), and the
bench's matched-error rule against a hand-computed example."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import linear_experts

from moe_spec.catalog import replay_metrics
from moe_spec.catalog.replay_metrics import OPEN_TABLE
from moe_spec.policy import adaptive, coverage
from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.calibration import CalibrationStats
from moe_spec.policy.coverage import prefix_masks
from moe_spec.policy.rankings.sketch import Sketch, attach_moments
from moe_spec.policy.routing import RoutingRule
from moe_spec.policy.surrogate import InputMoments, predicted_outputs
from moe_spec.replay import engine, open_loop

ROOT = Path(__file__).resolve().parents[1]
H, N, K, LAYER = 6, 8, 3, 2


def linear_model(seed: int = 5):
    """Linear experts of different sizes, so a rank-2 surrogate is not exact."""
    return linear_experts(seed, N, H, LAYER)


def routed(g, t: int, m: int, rule: RoutingRule):
    probs = torch.softmax(torch.randn(t, m, N, generator=g) * 2.0, -1)
    idx, w = rule.route(probs)
    return probs, idx, w, torch.randn(t, m, H, generator=g)


def fitted_sketch(model, rule):
    g = torch.Generator().manual_seed(1)
    probs, idx, w, hidden = routed(g, 8, 12, rule)
    tls = [SimpleNamespace(layer=LAYER, probs=probs[i], idx=idx[i], weights=w[i],
                           hidden=hidden[i], prompt_index=None) for i in range(8)]
    stats = attach_moments(CalibrationStats.collect(tls, model), InputMoments.collect(tls, model))
    return Sketch(rank=2).fit(stats)


def evaluation_batch(model, rule, t: int = 3, m: int = 7):
    g = torch.Generator().manual_seed(7)
    probs, idx, w, hidden = routed(g, t, m, rule)
    mask = torch.ones(t, m, dtype=torch.bool)
    mask[1, -3:] = False  # a padded tree-layer
    outputs = torch.stack([model.expert_outputs(LAYER, hidden[i]) for i in range(t)])
    outputs = outputs * mask[..., None, None]
    batch = RoutingBatch(probs, idx, w, mask, torch.full((t,), LAYER), rule,
                         ExpertTerms.from_outputs(outputs, idx, w), hidden=hidden)
    return batch


def predicted_rse_loop(sketch, batch, keep, cov):
    """Per tree-layer, budget and token: the natural output and the coverage policy's output
    over S, both formed from the surrogate's predicted outputs (residual coordinates included)."""
    pred = predicted_outputs(sketch.surrogate, batch.layers, batch.hidden, batch.mask).double()
    idx, w = cov.apply(batch, keep)
    out = torch.empty(keep.shape[:2], dtype=torch.float64)
    for t in range(batch.size):
        for b in range(keep.shape[1]):
            err = gold = 0.0
            for m in range(batch.mask.shape[1]):
                if not batch.mask[t, m]:
                    continue
                full = sum(float(batch.weights[t, m, j]) * pred[t, m, int(batch.idx[t, m, j])]
                           for j in range(K))
                mine = sum(float(w[t, b, m, j]) * pred[t, m, int(idx[t, b, m, j])]
                           for j in range(K))
                err += float((full - mine).pow(2).sum())
                gold += float(full.pow(2).sum())
            out[t, b] = err / gold
    return out


@pytest.mark.parametrize("cov_name", ["truncation", "substitution"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_predicted_rse_is_the_rse_of_the_surrogates_outputs_and_null_where_none_ran(
        cov_name, renormalize):
    model = linear_model()
    rule = RoutingRule(K, renormalize=renormalize)
    sketch = fitted_sketch(model, rule)
    batch = evaluation_batch(model, rule)
    cov = coverage.get(cov_name)
    budgets = [b for b in (1, 2, 3, 4, 6, 8) if b >= cov.min_budget(K)]
    keep = prefix_masks(torch.argsort(batch.mass(), -1, descending=True), budgets, N)
    ran = torch.tensor([True, True, False])
    m = open_loop.metrics(batch, keep, cov, ran, sketch.predicted)
    want = predicted_rse_loop(sketch, batch, keep, cov)
    got = m["predicted_rse"]
    assert torch.allclose(got[:2], want[:2], rtol=1e-4, atol=1e-9)
    assert torch.isnan(got[2]).all()  # no surrogate ranked it: no prediction
    assert float(got[:2, -1].max()) < 1e-9  # B = N: the prediction of an exact pass is exact
    # a prediction, not the truth: the rank-2 surrogate misses the true error somewhere
    assert not torch.allclose(got[:2], m["rse"][:2], rtol=1e-2)
    # without a ranking that predicts, every row is null
    assert torch.isnan(open_loop.metrics(batch, keep, cov)["predicted_rse"]).all()
    # stored: null where no surrogate ran, the number elsewhere
    task = SimpleNamespace(ranking=SimpleNamespace(name="sketch"),
                           coverage=SimpleNamespace(name=cov_name))
    keys = dict(prompt_index=[0] * 3, prompt_id=["p"] * 3, step=[0, 1, 2], layer=[LAYER] * 3)
    table = engine.blocks_to_table([engine.columns(keys, task, budgets, m)], OPEN_TABLE)
    column = table.column("predicted_rse")
    assert column.null_count == len(budgets)
    assert column.to_pylist()[0] == pytest.approx(float(got[0, 0]))


def test_the_metric_is_declared_with_its_layout():
    assert "predicted_rse" in replay_metrics.names(OPEN_TABLE)
    assert replay_metrics.LAYOUT_VERSION[OPEN_TABLE] == 3


def curves_of(seed: int, passes: int = 5, layers: int = 3, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    mass = torch.rand(passes, layers, width, generator=g, dtype=torch.float64).sort(
        -1, descending=True).values
    rse = mass * torch.rand(1, layers, 1, generator=g, dtype=torch.float64)
    noise = torch.rand(passes, layers, width, generator=g, dtype=torch.float64) * 0.05
    return mass, rse, rse + noise  # the prediction: the truth, a little noisy (not monotone)


def test_surrogate_predictor_reads_its_declared_curve_made_non_increasing():
    mass, rse, predicted = curves_of(0)
    layers = torch.arange(3)
    pred = adaptive.predictor("surrogate")
    assert pred.reads == (adaptive.PREDICTED, adaptive.MASS)
    inputs = {adaptive.MASS: mass, adaptive.PREDICTED: predicted}
    pred.fit(inputs, rse, layers)
    gains = pred.gains(inputs, layers)
    # the running minimum by hand, then the gains of its lower convex hull
    for p in range(5):
        for layer in range(3):
            low, want = float("inf"), []
            for e in predicted[p, layer].tolist():
                low = min(low, e)
                want.append(low)
            want = adaptive.convex_hull(torch.tensor(want, dtype=torch.float64))
            assert torch.allclose(gains[p, layer], want[:-1] - want[1:])
    assert bool((gains >= 0).all())
    with pytest.raises(ValueError, match="reads predicted_rse"):  # a mass curve alone: refused
        pred.gains(mass, layers)


@pytest.mark.parametrize("seed", range(6))
def test_the_price_rule_on_hull_gains_picks_each_layers_least_error_plus_price(seed):
    """On the gains of the lower convex hull the price rule (a leading run of gains above λ)
    gives each layer ``argmin_B e(B) + λ·B`` of its own curve, found here by trying every B;
    the hull lies on or below the curve, meets it at both ends and is convex."""
    g = torch.Generator().manual_seed(seed)
    curves = torch.rand(4, 3, 9, generator=g, dtype=torch.float64).sort(
        -1, descending=True).values
    curves[..., 3:5] = curves[..., 2:3]  # a plateau, where the raw leading run stops
    hull = adaptive.convex_hull(curves)
    assert bool((hull <= curves + 1e-12).all())
    assert torch.allclose(hull[..., [0, -1]], curves[..., [0, -1]])
    gains = adaptive.gains_of(hull)
    assert bool((gains[..., 1:] <= gains[..., :-1] + 1e-12).all())
    b_min = 2
    for price in torch.rand(5, generator=g, dtype=torch.float64).mul(0.3).tolist():
        chosen = adaptive.price_budgets(gains, price, b_min)
        cost = curves + price * torch.arange(9, dtype=torch.float64)
        assert torch.equal(chosen, b_min + cost.argmin(-1)), price


def test_surrogate_predictor_falls_back_to_calibrated_mass_where_no_surrogate_ran():
    mass, rse, predicted = curves_of(1)
    layers = torch.arange(3)
    predicted = predicted.clone()
    predicted[2, 1] = float("nan")  # sketch-gated's gate said no for this tree-layer
    inputs = {adaptive.MASS: mass, adaptive.PREDICTED: predicted}
    pred = adaptive.predictor("surrogate").fit(inputs, rse, layers)
    gains = pred.gains(inputs, layers)
    fallback = adaptive.predictor("calibrated").fit(mass, rse, layers).curve(mass, layers)
    assert torch.allclose(gains[2, 1], adaptive.gains_of(adaptive.convex_hull(fallback[2, 1])))
    assert torch.isfinite(gains).all()
    mine = adaptive.convex_hull(torch.cummin(predicted[0], -1).values)
    assert torch.allclose(gains[0], adaptive.gains_of(mine))


def test_mass_predictors_take_a_mapping_or_a_bare_mass_alike():
    mass, rse, _ = curves_of(2)
    layers = torch.arange(3)
    for name in ("mass", "calibrated"):
        a = adaptive.predictor(name).fit(mass, rse, layers).gains(mass, layers)
        b = adaptive.predictor(name).fit({adaptive.MASS: mass}, rse, layers).gains(
            {adaptive.MASS: mass}, layers)
        assert torch.equal(a, b)


@pytest.mark.parametrize("renormalize", [True, False])
def test_substitution_below_k_runs_each_tokens_best_experts_of_the_shortlist(renormalize):
    """|S| = B < k: every token runs all B experts of S (its best min(k, B) by selection order),
    weighted as the model weights them, renormalised over them where the model renormalises;
    the other slots carry weight 0. What makes B_min < k honest under substitution."""
    g = torch.Generator().manual_seed(3)
    rule = RoutingRule(K, renormalize=renormalize)
    probs = torch.softmax(torch.randn(1, 5, N, generator=g) * 2.0, -1)
    idx, w = rule.route(probs)
    batch = RoutingBatch(probs, idx, w, torch.ones(1, 5, dtype=torch.bool), torch.tensor([0]),
                         rule)
    keep = torch.zeros(1, 2, N, dtype=torch.bool)
    keep[0, 0, [1, 4]] = True  # B = 2 < k = 3
    keep[0, 1, [6]] = True  # B = 1
    got_idx, got_w = coverage.get("substitution").apply(batch, keep)
    for b, shortlist in ((0, [1, 4]), (1, [6])):
        for m in range(5):
            used = {int(i): float(x) for i, x in zip(got_idx[0, b, m], got_w[0, b, m]) if x != 0}
            assert set(used) == set(shortlist)
            scores = {i: float(probs[0, m, i]) for i in shortlist}
            total = sum(scores.values()) if renormalize else 1.0
            for i in shortlist:
                assert used[i] == pytest.approx(scores[i] / total, rel=1e-5)


@pytest.fixture
def bench():
    from moe_spec.bench import adaptive_budget
    return adaptive_budget


def test_matched_error_interpolates_the_experts_each_curve_needs(bench):
    """Router at B = 4 loads 4 experts for error 0.20. A curve through (2, 0.30), (3, 0.25),
    (4, 0.10): 0.20 lies between x = 3 and 4, a third of the way down 0.25 → 0.10, so it needs
    3 + (0.25 − 0.20) / 0.15 = 3.333 experts: a saving of 1 − 3.333 / 4 = 16.7%."""
    assert bench.needed([(4, 0.10), (2, 0.30), (3, 0.25)], 0.20) == (pytest.approx(10 / 3), False)
    # a bump is smoothed by the running minimum: (3, 0.35) counts as 0.30
    assert bench.needed([(2, 0.30), (3, 0.35), (4, 0.10)], 0.20) == (pytest.approx(3.5), False)
    assert bench.needed([(2, 0.30), (4, 0.25)], 0.20) == (None, False)  # never reached
    assert bench.needed([(2, 0.15), (4, 0.10)], 0.20) == (2, True)  # below from the start
    router = [dict(mean_budget=b, fixed=e, x_fixed=float(b)) for b, e in
              ((2, 0.40), (3, 0.30), (4, 0.20))]
    cells = [dict(mean_budget=b, fixed=e1, x_fixed=float(b), adaptive=e2, x_adaptive=x2,
                  oracle_fixed=e3, x_oracle_fixed=float(b), oracle_adaptive=e4,
                  x_oracle_adaptive=float(b))
             for b, e1, e2, x2, e3, e4 in ((2, 0.40, 0.30, 2.0, 0.15, 0.12),
                                           (3, 0.30, 0.25, 3.0, 0.12, 0.10),
                                           (4, 0.20, 0.10, 4.0, 0.10, 0.08))]
    saved = bench.matched_savings(cells, router, 4)
    assert saved["target_rse"] == 0.20 and saved["router_experts"] == 4.0
    assert saved["fixed"] == pytest.approx(0.0)
    assert saved["adaptive"] == pytest.approx(1 - (10 / 3) / 4)
    assert saved["oracle_fixed"] == pytest.approx(0.5) and saved["oracle_fixed_bound"]
    assert bench.matched_savings(cells, router, 5) == {}


def test_adaptive_budgets_read_the_surrogate_curve_replay_stores():
    """The product's price rule reads the surrogate's curve at run time (policy.prices) as
    open-loop replay stores it: one formula, the same numbers, NaN where no surrogate ran."""
    from moe_spec.policy import prices
    model = linear_model()
    rule = RoutingRule(K, renormalize=True)
    sketch = fitted_sketch(model, rule)
    batch = evaluation_batch(model, rule)
    cov = coverage.get("substitution")
    keep = prefix_masks(torch.argsort(batch.mass(), -1, descending=True), [3, 4, 5], N)
    found = prices.runtime_curves(adaptive.predictor("surrogate"), batch, keep, cov, sketch)
    stored = open_loop.metrics(batch, keep, cov, sketch.surrogate_ranked(batch),
                               sketch.predicted)
    assert torch.allclose(found[adaptive.PREDICTED], stored["predicted_rse"])
    assert torch.allclose(found[adaptive.MASS], stored["mass_excluded"].double())
    blind = prices.runtime_curves(adaptive.predictor("surrogate"), batch, keep, cov,
                                  SimpleNamespace(surrogate_ranked=lambda b: torch.zeros(
                                      b.size, dtype=torch.bool), predicted=None))
    assert torch.isnan(blind[adaptive.PREDICTED]).all()
