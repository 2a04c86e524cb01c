"""``coact-prior`` (policy/rankings/coact_prior.py) against slow, obviously-correct references.

κ = 0 is coact-online (and coact before any pass); the shrinkage is the formula, one expert at a
time; the per-prompt energy moments and the empirical-Bayes κ equal a loop over raw per-token
energies; the chooser recovers a known κ from a simulated hierarchy; and through the open-loop
replay path a shortlist of every expert gives zero error and B ≥ |U| the floor.
"""

import math

import pytest
import torch
from helpers import calibration_of, synthetic, synthetic_calibration
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.policy import coverage, rankings
from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.calibration import CalibrationStats
from moe_spec.policy.rankings.coact_prior import prior_strength, shrunk_means


def _fixed(stats, kappa):
    ranking = rankings.get("coact-prior")().fit(stats)
    ranking.kappa = kappa
    return ranking


def _energies(seed, layers=(3, 5), n=6, k=2, prompts=5, per_prompt=(1, 4), m=7):
    """Calibration batches with known per-token energies: ``(stats, records)``, records a list
    of (layer, prompt, expert, energy) per selected slot."""
    g = torch.Generator().manual_seed(seed)
    stats = CalibrationStats.empty(list(layers), n)
    records = []
    scale = torch.rand(len(layers), n, generator=g, dtype=torch.float64) * 4 + 0.5
    for p in range(prompts):
        for _ in range(int(torch.randint(per_prompt[0], per_prompt[1] + 1, (1,), generator=g))):
            for row, layer in enumerate(layers):
                idx = torch.stack([torch.randperm(n - 1, generator=g)[:k] for _ in range(m)])
                energy = scale[row][idx] * torch.rand(m, k, generator=g, dtype=torch.float64) * 2
                direction = torch.randn(m, k, 4, generator=g, dtype=torch.float64)
                out = direction / direction.norm(dim=-1, keepdim=True) * energy.sqrt()[..., None]
                stats.add(layer, idx, out.float(), prompt=p)
                records += [(layer, p, int(i), float(o.double() @ o.double()))
                            for i, o in zip(idx.flatten(), out.float().reshape(-1, 4))]
    return stats, records  # expert n − 1 is never selected


def _reference_kappa(records, layer, n):
    """The module docstring's estimator, one expert and one prompt at a time."""
    xs, vs, cs, ps = [], [], [], []
    for i in range(n):
        mine = [(p, e) for lay, p, j, e in records if lay == layer and j == i]
        c = len(mine)
        prompts = sorted({p for p, _ in mine})
        if len(prompts) < 2:
            continue
        x = sum(e for _, e in mine) / c
        dev = sum((sum(e for q, e in mine if q == p) - x * sum(1 for q, _ in mine if q == p)) ** 2
                  for p in prompts)
        xs.append(x)
        vs.append(len(prompts) / (len(prompts) - 1) * dev / c ** 2)
        cs.append(c)
        ps.append(len(prompts))
    mean = sum(xs) / len(xs)
    between = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    shifts = [(p + 1) * v for p, v in zip(ps, vs)]  # u_i + v_i, u_i = P_i v_i
    tau2 = max(0.0, between - sum(shifts) / len(shifts))
    spread = sum(c * u for c, u in zip(cs, shifts)) / len(cs)
    return math.inf if tau2 == 0 else spread / tau2


def test_kappa_zero_is_coact_then_coact_online_bit_for_bit():
    batch, experts = synthetic(1, n=8, k=2)
    stats = calibration_of(*synthetic(2, n=8, k=2))
    prior, coact = _fixed(stats, 0.0), rankings.get("coact")().fit(stats)
    online = rankings.get("coact-online")().fit(stats)
    assert torch.equal(prior.mean_gram(batch), coact.mean_gram(batch))
    for cov in coverage.COVERAGES.values():
        assert torch.equal(prior.shortlists(batch, cov, [2, 3, 5])[0],
                           coact.shortlists(batch, cov, [2, 3, 5])[0])
    w = batch.weights.clone()
    w[..., 1] = 0  # a finished pass that ran each token's first expert
    outs = experts.gather(1, batch.idx[0][..., None].expand(-1, -1, experts.shape[-1]))[None]
    for r in (prior, online):
        r.observe_outputs(batch.layers, batch.idx, w, outs)
    assert torch.equal(prior.mean_gram(batch), online.mean_gram(batch))
    assert not torch.equal(prior.mean_gram(batch), coact.mean_gram(batch))


@pytest.mark.parametrize("kappa", [0.5, 7.0, 256.0, math.inf])
def test_shrinkage_equals_the_formula_expert_by_expert(kappa):
    stats, _ = _energies(0)
    got = shrunk_means(stats, torch.tensor([kappa, 2 * kappa], dtype=torch.float64)).double()
    base = stats.layer_means().double()
    for row in range(2):
        k = [kappa, 2 * kappa][row]
        seen = [i for i in range(stats.num_experts) if stats.pairs[row, i, i] > 0]
        layer_mean = sum(float(stats.gram[row, i, i] / stats.pairs[row, i, i])
                         for i in seen) / len(seen)
        for i in range(stats.num_experts):
            c = float(stats.pairs[row, i, i])
            x = float(stats.gram[row, i, i]) / c if c else layer_mean
            if c == 0 or k == math.inf:  # unseen experts hold Ḡ already; κ = ∞: all the way
                want = layer_mean
            else:
                want = (c * x + k * layer_mean) / (c + k)
            assert float(got[row, i, i]) == pytest.approx(want, rel=1e-6)
        off = ~torch.eye(stats.num_experts, dtype=torch.bool)
        assert torch.equal(got[row][off], base[row][off])  # co-activation terms untouched


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moments_and_kappa_equal_a_loop_over_raw_energies(seed):
    stats, records = _energies(seed)
    v, prompts = stats.energy_variance()
    kappa = prior_strength(stats)
    for row, layer in enumerate(stats.layers):
        for i in range(stats.num_experts):
            mine = [(p, e) for lay, p, j, e in records if lay == layer and j == i]
            assert float(prompts[row, i]) == len({p for p, _ in mine})
        assert float(kappa[row]) == pytest.approx(_reference_kappa(records, layer,
                                                                   stats.num_experts), rel=1e-9)
    assert torch.isnan(v[:, -1]).all()  # never selected: no spread
    # the same tokens split into two runs and merged: the same moments (prompts are disjoint)
    a, b = CalibrationStats.empty(stats.layers, 6), CalibrationStats.empty(stats.layers, 6)
    for layer, p, i, e in records:
        out = torch.zeros(1, 1, 4)
        out[0, 0, 0] = math.sqrt(e)
        (a if p % 2 else b).add(layer, torch.tensor([[i]]), out, prompt=p)
    merged = CalibrationStats.merge([a, b])
    torch.testing.assert_close(merged.moments, stats.moments, rtol=1e-6, atol=1e-6)


def test_collect_groups_tokens_by_prompt_index():
    stats, tls, model = synthetic_calibration(0, 6)
    for j, tl in enumerate(tls):
        tl.prompt_index = j // 3  # two prompts of three tree-layers
    grouped = CalibrationStats.collect(tls, model)
    assert grouped.moments[0, 0].max() == 2 and stats.moments[0, 0].max() == 6
    torch.testing.assert_close(grouped.gram, stats.gram)


def test_the_chooser_recovers_a_known_prior_strength():
    """Energies μ_i + prompt effect + token noise, μ_i ~ N(20, τ²), m tokens per prompt: one
    prompt's mean energy varies by u = σ_p² + σ_t²/m, the P-prompt mean by v = u/P, so
    κ = c (u + v)/τ² with c = mP."""
    g = torch.Generator().manual_seed(0)
    n, prompts, m, tau, sigma_p, sigma_t = 64, 40, 10, 2.0, 0.5, 2.0
    mu = 20 + tau * torch.randn(n, generator=g, dtype=torch.float64)
    stats = CalibrationStats.empty([0], n)
    for p in range(prompts):
        effect = sigma_p * torch.randn(n, generator=g, dtype=torch.float64)
        energy = mu + effect + sigma_t * torch.randn(m, n, generator=g, dtype=torch.float64)
        stats.add(0, torch.arange(n).expand(m, n), energy.sqrt()[..., None], prompt=p)
    u = sigma_p ** 2 + sigma_t ** 2 / m
    want = m * prompts * u * (1 + 1 / prompts) / tau ** 2
    assert float(prior_strength(stats)[0]) == pytest.approx(want, rel=0.3)
    flat = CalibrationStats.empty([0], n)  # every expert alike: all spread is noise, κ = ∞
    for p in range(prompts):
        energy = 20 + sigma_t * torch.randn(m, n, generator=g, dtype=torch.float64)
        flat.add(0, torch.arange(n).expand(m, n), energy.sqrt()[..., None], prompt=p)
    assert math.isinf(float(prior_strength(flat)[0]))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), renorm=st.booleans(), cov=st.sampled_from(["truncation",
                                                                                "substitution"]))
def test_through_open_loop_all_experts_give_zero_and_the_union_gives_the_floor(seed, renorm, cov):
    from moe_spec.replay.open_loop import Stream, shortlists
    stats, _, _ = synthetic_calibration(seed % 7, 6)
    first, e0 = synthetic(seed, m=3, n=8, k=2, renormalize=renorm, sharpness=6.0)
    second, e1 = synthetic(seed + 1, m=3, n=8, k=2, renormalize=renorm, sharpness=6.0)
    batch = RoutingBatch(torch.cat([first.probs, second.probs]),
                         torch.cat([first.idx, second.idx]),
                         torch.cat([first.weights, second.weights]),
                         torch.ones(2, 3, dtype=torch.bool), torch.tensor([3, 3]), first.rule)
    batch.terms = ExpertTerms.from_outputs(torch.stack([e0, e1]), batch.idx, batch.weights)
    policy = coverage.get(cov)
    union = batch.union().sum(-1).max()
    budgets = sorted({max(int(union), policy.min_budget(2)), 8})
    keep, _ = shortlists(rankings.get("coact-prior")().fit(stats), batch, policy, budgets,
                         torch.tensor([0, 0]), torch.tensor([0, 1]), Stream())
    idx, w = policy.apply(batch, keep)
    err = policy.sq_errors(batch, keep, idx, w).sum(-1)  # [2, budgets]
    floor = batch.terms.floor.sum(-1)
    assert torch.allclose(err[:, -1], floor, rtol=1e-9, atol=1e-12)  # B = N
    if cov == "truncation":  # S ⊇ U: the floor
        assert torch.allclose(err[:, 0], floor, rtol=1e-9, atol=1e-12)


def test_registered_with_its_index_line():
    cls = rankings.get("coact-prior")
    assert cls.runtime and cls.stateful and cls.observes_outputs and cls.needs_calibration
    assert cls.kappa is None  # the shipped ranking chooses κ from the calibration
