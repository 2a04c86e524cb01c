"""Invariants a reference must keep (issue: every number a user might publish is right).

* For every embedded family, with its real router and experts: a shortlist S ⊇ U (the union of
  the tree's natural top-k) gives exactly the error floor under both coverage policies, and
  substitution never runs a token on fewer than min(k, |S|) experts.
* Under truncation every ranking this project defines puts the selected experts first, so
  B ≥ |U| gives the floor; router and static keep the papers' definitions.
* Ties: one explicit rule (lower expert id among equals) in selection and slot order.
* The oracle is never worse than any runtime ranking it starts from, and equals ``exact`` where
  ``exact`` runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import block_io, real_ids, synthetic, synthetic_calibration
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.moe.adapter import MoEAdapter
from moe_spec.policy import coverage, rankings
from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.coverage import prefix_masks
from moe_spec.policy.routing import RoutingRule, canonical_slots, top_k_lowest_id


def _family_batch(embedded, layer_pos: int = 0):
    """One tree-layer of real MoE inputs at an MoE layer, routed by the model's own router."""
    torch.manual_seed(0)
    adapter, seen = block_io(embedded.model, real_ids(embedded.tokenizer))
    layer = list(adapter)[layer_pos]
    h = seen[layer.index][0].reshape(-1, seen[layer.index][0].shape[-1])[:40]
    with torch.no_grad():
        logits, weights, index = layer.router(h)
        probs = layer.rule.scores(logits)
        idx, w, _ = layer.rule.natural(probs, index, weights)
        experts = layer.all_expert_outputs(h, torch.float32)
        shared = layer.shared_output(h)
    batch = RoutingBatch.single(probs, idx, w, layer.index, layer.rule)
    batch.terms = ExpertTerms.from_outputs(experts[None].float(), idx[None], w[None],
                                           None if shared is None else shared[None].float())
    return batch, index


def test_every_family_keeps_the_routers_set_in_decreasing_weight_order(embedded):
    """topk_ids are stored by decreasing weight, ties by id, for every family (DeepSeek's
    group-limited router returns them in another order)."""
    adapter = MoEAdapter(embedded.model)
    for pos in range(len(adapter))[:3]:
        batch, index = _family_batch(embedded, pos)
        w, idx = batch.weights[0], batch.idx[0]
        assert (w[:, :-1] >= w[:, 1:]).all()
        assert torch.equal(idx.sort(-1).values, index.long().sort(-1).values)


def test_every_family_shortlist_holding_the_union_gives_the_floor(embedded):
    batch, _ = _family_batch(embedded)
    n, k = batch.n, batch.k
    union = batch.union()  # [1, N]
    g = torch.Generator().manual_seed(1)
    extra = torch.zeros_like(union)
    extra[0, torch.randperm(n, generator=g)[: n // 4]] = True
    floor = batch.terms.floor.sum()
    for keep in (union, union | extra, torch.ones_like(union)):
        for name in ("truncation", "substitution"):
            cov = coverage.get(name)
            idx, w = cov.apply(batch, keep[:, None])
            err = cov.sq_errors(batch, keep[:, None], idx, w).sum()
            assert float(err) == float(floor), (embedded.name, name, int(keep.sum()))
            assert torch.equal(idx[0, 0], batch.idx[0]) and torch.equal(w[0, 0], batch.weights[0])
    sub = coverage.get("substitution")
    for size in sorted({k, k + 1, (k + n) // 2}):  # smaller shortlists: never fewer than k
        keep = torch.zeros(1, 1, n, dtype=torch.bool)
        keep[0, 0, torch.randperm(n, generator=g)[:size]] = True
        idx, w = sub.apply(batch, keep)
        used = (w[0, 0] != 0).sum(-1)
        assert (used == min(k, size)).all(), (embedded.name, size, used.tolist())
        assert keep[0, 0][idx[0, 0][w[0, 0] != 0]].all()  # only shortlisted experts run


def _fitted(name: str, stats):
    ranking = rankings.get(name)()
    return ranking.fit(stats if ranking.needs_calibration or ranking.uses_calibration else None)


def _with_sketch(found, batch, seed: int):
    """The synthetic calibration carrying sketch's surrogate sums, and ``batch`` its tree
    tokens' MoE inputs (seeded; the synthetic batch's outputs do not depend on them, which
    these invariants do not need)."""
    from moe_spec.policy.rankings.sketch import attach_moments, with_inputs
    from moe_spec.policy.surrogate import InputMoments
    stats, tls, model = found
    attach_moments(stats, InputMoments.collect(tls, model))
    h = tls[0].hidden.shape[-1]
    with_inputs(batch, torch.randn(*batch.probs.shape[:2], h,
                                   generator=torch.Generator().manual_seed(seed)))
    return stats


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), renorm=st.booleans())
def test_project_rankings_put_selected_experts_first_under_truncation(seed, renorm):
    """B ≥ |U| ⇒ the error floor, for every ranking this project defines (and the papers'
    router and static are the only ones allowed to miss it)."""
    found = synthetic_calibration(seed % 13, 6, examples=6)
    batch, _ = synthetic(seed, m=3, n=8, k=2, renormalize=renorm, sharpness=6.0)
    stats = _with_sketch(found, batch, seed)
    trunc = coverage.get("truncation")
    u = int(batch.union().sum())
    budgets = sorted({u, min(u + 1, 8), 8})
    floor = float(batch.terms.floor.sum())
    for name in rankings.names():
        cls = rankings.get(name)
        assert cls.selected_first == (name not in ("router", "static")), name
        if not cls.selected_first or name == "exact":
            continue
        keep, valid = _fitted(name, stats).shortlists(batch, trunc, budgets)
        idx, w = trunc.apply(batch, keep)
        err = trunc.sq_errors(batch, keep, idx, w).sum(-1)[0]
        assert torch.allclose(err, torch.full_like(err, floor), rtol=1e-9, atol=1e-15), name


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_top_k_breaks_ties_to_the_lower_id(data):
    rows = data.draw(st.integers(1, 5))
    n = data.draw(st.integers(2, 12))
    k = data.draw(st.integers(1, n))
    values = data.draw(st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, float("-inf")]),
                                         min_size=n, max_size=n), min_size=rows, max_size=rows))
    x = torch.tensor(values)
    got_v, got_i = top_k_lowest_id(x, k)
    for r in range(rows):
        want = sorted(range(n), key=lambda i: (-values[r][i], i))[:k]
        assert got_i[r].tolist() == want
        assert got_v[r].tolist() == [values[r][i] for i in want]
    w = torch.tensor([[0.25, 0.5, 0.25, 0.0]])
    idx, ws = canonical_slots(torch.tensor([[7, 3, 1, 0]]), w)
    assert idx.tolist() == [[3, 1, 7, 0]] and ws.tolist() == [[0.5, 0.25, 0.25, 0.0]]


def test_a_router_tie_at_the_kth_place_follows_the_lower_id_rule():
    """A bf16-style tie: the router module picked the higher id; capture records the rule's
    choice (lower id) and says the set was replaced."""
    rule = RoutingRule(2, renormalize=True)
    g = torch.tensor([[0.5, 0.2, 0.2, 0.1]])
    idx, w, replaced = rule.natural(g, torch.tensor([[0, 2]]), torch.tensor([[0.5 / 0.7, 0.2 / 0.7]]))
    assert replaced and idx.tolist() == [[0, 1]]
    idx, w, replaced = rule.natural(g, torch.tensor([[1, 0]]), torch.tensor([[0.2 / 0.7, 0.5 / 0.7]]))
    assert not replaced and idx.tolist() == [[0, 1]] and w[0, 0] > w[0, 1]


def _cell_errors(batch, cov, keep):
    idx, w = cov.apply(batch, keep)
    return cov.sq_errors(batch, keep, idx, w).sum(-1)  # [T, B]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), renorm=st.booleans(), n=st.sampled_from([8, 16]))
def test_oracle_is_never_beaten_by_a_runtime_ranking_and_is_exact_where_exact_runs(seed, renorm, n):
    found = synthetic_calibration(seed % 13, 6, n=n, examples=6)
    batch, _ = synthetic(seed, m=10, n=n, k=2, renormalize=renorm)
    stats = _with_sketch(found, batch, seed)
    oracle = rankings.get("oracle")().fit(stats)
    for name in ("truncation", "substitution"):
        cov = coverage.get(name)
        budgets = [b for b in (2, 3, 4, 6) if b >= cov.min_budget(2)]
        best = _cell_errors(batch, cov, oracle.shortlists(batch, cov, budgets)[0])
        for other in rankings.names(runtime=True):
            keep, _ = _fitted(other, stats).shortlists(batch, cov, budgets)
            theirs = _cell_errors(batch, cov, keep)
            assert (best <= theirs * (1 + 1e-9) + 1e-15).all(), (other, name, best, theirs)
        exact_budgets = [b for b in budgets if math.comb(n, b) <= 5000]
        if exact_budgets:
            keep, valid = rankings.get("exact")().shortlists(batch, cov, exact_budgets)
            mine = oracle.shortlists(batch, cov, valid)[0]
            assert torch.allclose(_cell_errors(batch, cov, mine), _cell_errors(batch, cov, keep),
                                  rtol=1e-12, atol=1e-300)


def test_local_search_improves_a_bad_start_to_the_exhaustive_optimum_on_a_small_case():
    """From the worst prefix, the swap search reaches the exhaustive best here (and is never
    worse than its start)."""
    from moe_spec.policy.rankings.exact import exhaustive_best
    from moe_spec.policy.rankings.oracle import local_search
    batch, _ = synthetic(3, m=10, n=8, k=2)
    cov = coverage.get("truncation")
    worst = prefix_masks(torch.argsort(batch.mass(), descending=False), [3], 8)  # least mass
    found = local_search(batch, cov, worst, [3], max_rounds=10)
    best = exhaustive_best(batch, cov, 3)[:, None]
    assert _cell_errors(batch, cov, found) <= _cell_errors(batch, cov, worst)
    assert torch.allclose(_cell_errors(batch, cov, found), _cell_errors(batch, cov, best))


@settings(max_examples=40, deadline=None, derandomize=True)  # the same 40 cases every run
@given(seed=st.integers(0, 10_000), extra=st.integers(0, 3), renormalize=st.booleans(),
       biased=st.booleans(), name=st.sampled_from(["truncation", "substitution"]),
       grouped=st.booleans())
def test_swap_screening_predicts_every_swaps_exact_error(seed, extra, renormalize, biased, name,
                                                         grouped):
    """The oracle's closed-form screen of all swaps (policy.rankings.oracle.screen_swaps) equals
    the exact error of each swapped shortlist, |S| = k included (substitution then has no expert
    of S outside a token's selection), with and without a selection bias, under plain and
    group-limited routing (4 groups of 2, 2 kept: DeepSeek's rule in small)."""
    from moe_spec.policy.rankings.oracle import errors, screen_swaps
    n, k = 8, 2
    batch, experts = synthetic(seed, m=10, n=n, k=k, renormalize=renormalize)
    if biased or grouped:  # the natural routing is the biased (grouped) rule's
        bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)) * 0.2 \
            if biased else None
        rule = RoutingRule(k, renormalize=renormalize, selection_bias=bias,
                           **(dict(groups=4, groups_kept=2) if grouped else {}))
        idx, w = rule.route(batch.probs[0])
        batch = RoutingBatch.single(batch.probs[0], idx, w, 3, rule)
        batch.terms = ExpertTerms.from_outputs(experts[None], idx[None], w[None])
    cov = coverage.get(name)
    b = cov.min_budget(k) + extra
    g = torch.Generator().manual_seed(seed)
    current = torch.zeros(1, n, dtype=torch.bool)
    current[0, torch.randperm(n, generator=g)[:b]] = True
    predicted = screen_swaps(batch, cov, current)[0]
    for out_ in current[0].nonzero().flatten().tolist():
        for in_ in (~current[0]).nonzero().flatten().tolist():
            swapped = current.clone()
            swapped[0, out_], swapped[0, in_] = False, True
            exact = errors(batch, cov, swapped[:, None])[0, 0]
            assert torch.isclose(predicted[out_, in_], exact, rtol=1e-6, atol=1e-12), \
                (out_, in_, float(predicted[out_, in_]), float(exact))


@pytest.mark.parametrize("n,b", [(8, 4), (64, 2), (64, 6)])
def test_oracle_uses_exhaustive_search_exactly_where_it_fits(n, b):
    from moe_spec.policy.index import EXACT_LIMIT
    from moe_spec.policy.rankings.exact import Exact
    assert (b in Exact().skipped(n, [b])) == (math.comb(n, b) > EXACT_LIMIT)
