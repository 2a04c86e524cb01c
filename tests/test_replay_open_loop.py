"""Open-loop replay formulas against slow, obviously-correct references on synthetic trees."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import budget as budgets
from replay.coact import coact_order
from replay.open_loop import (
    TreeLayer,
    approximate,
    exact_best,
    metrics,
    oracle_order,
    policy,
    prefix_masks,
    token_sq_errors,
)


def errors(gold, approx):
    """Direct RSE and mean token error (no Gram expansion)."""
    diff = (gold - approx).double().pow(2).sum(-1)
    norm = gold.double().pow(2).sum(-1)
    return diff.sum(-1) / norm.sum(-1), (diff.sqrt() / norm.sqrt()).mean(-1)


def synthetic(seed: int, m=12, n=8, k=2, h=6, renormalize=True, sharpness=3.0) -> TreeLayer:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(m, n, generator=g) * sharpness, -1)
    w, idx = probs.topk(k, -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    experts = torch.randn(m, n, h, generator=g, dtype=torch.float64).float()
    return TreeLayer(probs, idx, w, experts, renormalize)


def loop_reference(tl: TreeLayer, keep: torch.Tensor, coverage: str) -> torch.Tensor:
    """DESIGN.md's formulas, one token and one expert at a time."""
    out = torch.zeros_like(tl.gold)
    for t in range(tl.gold.shape[0]):
        if coverage == "truncation":
            for j in range(tl.k):
                i = int(tl.idx[t, j])
                if keep[i]:
                    out[t] += tl.weights[t, j] * tl.experts[t, i]
        else:
            allowed = [i for i in range(tl.n) if keep[i]]
            chosen = sorted(allowed, key=lambda i: -float(tl.probs[t, i]))[:tl.k]
            total = sum(float(tl.probs[t, i]) for i in chosen)
            for i in chosen:
                w = float(tl.probs[t, i]) / total if tl.renormalize else float(tl.probs[t, i])
                out[t] += w * tl.experts[t, i]
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(2, 8), renorm=st.booleans(),
       coverage=st.sampled_from(budgets.COVERAGES))
def test_policies_equal_the_per_token_loop(seed, budget, renorm, coverage):
    tl = synthetic(seed, renormalize=renorm)
    keep = budgets.shortlist(budgets.router_scores(tl.probs), budget)
    torch.testing.assert_close(approximate(tl, keep, coverage), loop_reference(tl, keep, coverage),
                               rtol=1e-5, atol=1e-5)
    # the Gram expansion equals the direct squared error
    idx, w = policy(tl, keep, coverage)
    direct = (tl.gold - approximate(tl, keep, coverage)).double().pow(2).sum(-1)
    torch.testing.assert_close(token_sq_errors(tl, idx, w), direct, rtol=1e-4, atol=1e-6)
    # the shared budget module (capture's online mode) gives the same indices/weights
    idx, w = budgets.apply(tl.probs, tl.idx, tl.weights, keep, coverage, renorm)
    ref = (tl.experts.gather(1, idx[..., None].expand(-1, -1, tl.gold.shape[-1])) * w[..., None]).sum(1)
    torch.testing.assert_close(ref, loop_reference(tl, keep, coverage), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("coverage", budgets.COVERAGES)
def test_budget_of_all_experts_is_exact_for_every_ranking(coverage):
    tl = synthetic(3)
    n = tl.n
    masks = {
        "router": budgets.shortlist(budgets.router_scores(tl.probs), n),
        "static": budgets.shortlist(torch.rand(n), n),
        "oracle": prefix_masks(oracle_order(tl, coverage, n), [n], n)[0],
        "exact": exact_best(tl, coverage, n),
        "coact": prefix_masks(coact_order(torch.rand(12, n), torch.rand(n, n), torch.rand(n), n),
                              [n], n)[0],
    }
    for ranking, keep in masks.items():
        m = metrics(tl, keep, coverage)
        assert float(m["rse"]) == pytest.approx(0, abs=1e-10), ranking
        assert float(m["token_error"]) == pytest.approx(0, abs=1e-5), ranking
        assert float(m["mass_excluded"]) == 0


@pytest.mark.parametrize("coverage", budgets.COVERAGES)
def test_budget_covering_the_union_is_exact_for_oracle_and_exact(coverage):
    for seed in range(5):
        tl = synthetic(seed, m=4, n=8, k=2, sharpness=6.0)
        union = int(torch.unique(tl.idx).numel())
        assert union < tl.n
        order = oracle_order(tl, coverage, union)
        assert set(order) == set(tl.union.tolist())
        for keep in (prefix_masks(order, [union], tl.n)[0], exact_best(tl, coverage, union)):
            assert float(metrics(tl, keep, coverage)["rse"]) == pytest.approx(0, abs=1e-8)
            rse, _ = errors(tl.gold, approximate(tl, keep, coverage))
            assert float(rse) == pytest.approx(0, abs=1e-8)


def test_exact_never_worse_than_oracle_and_oracle_beats_router_in_aggregate():
    totals = {"router": 0.0, "oracle": 0.0}
    for seed in range(30):
        tl = synthetic(seed, m=16, n=8, k=2, sharpness=1.5)
        for coverage in budgets.COVERAGES:
            order = oracle_order(tl, coverage, tl.n)
            for b in range(2, 7):
                keep_o = prefix_masks(order, [b], tl.n)[0]
                e_o = float(errors(tl.gold, approximate(tl, keep_o, coverage))[0])
                e_x = float(errors(tl.gold, approximate(tl, exact_best(tl, coverage, b), coverage))[0])
                e_r = float(errors(tl.gold, approximate(
                    tl, budgets.shortlist(budgets.router_scores(tl.probs), b), coverage))[0])
                assert e_x <= e_o + 1e-6
                totals["oracle"] += e_o
                totals["router"] += e_r
    assert totals["oracle"] < totals["router"]


def test_exact_refuses_large_searches():
    tl = synthetic(0, n=64, k=8)
    assert math.comb(64, 32) > 5000 and exact_best(tl, "truncation", 32) is None


def test_truncation_oracle_closed_form_equals_batched_greedy():
    from replay.open_loop import policy as pol
    for seed in range(10):
        tl = synthetic(seed, m=10, n=16, k=4, sharpness=1.0)
        fast = oracle_order(tl, "truncation", 12)
        keep, slow = torch.zeros(tl.n, dtype=torch.bool), []
        for _ in range(12):
            idx, w = pol(tl, keep[None] | torch.eye(tl.n, dtype=torch.bool), "truncation")
            err = token_sq_errors(tl, idx, w).sum(-1)
            err[keep] = float("inf")
            best = int(torch.argmin(err))
            slow.append(best)
            keep[best] = True
        # equal errors at every prefix (orders may differ only between exact ties)
        for b in range(1, 13):
            e_fast = float(metrics(tl, prefix_masks(fast, [b], tl.n)[0], "truncation")["rse"])
            e_slow = float(metrics(tl, prefix_masks(slow, [b], tl.n)[0], "truncation")["rse"])
            assert e_fast == pytest.approx(e_slow, rel=1e-9, abs=1e-12)
