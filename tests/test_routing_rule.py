"""The routing rule as the one owner of mixing, and its record in a run's manifest."""

import json

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.catalog import schema
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.policy.routing import Mixing, RoutingRule


@settings(max_examples=40, deadline=None)
@given(renormalize=st.booleans(), scale=st.sampled_from([1.0, 2.5, 16.0]),
       eps=st.sampled_from([0.0, 1e-20]), seed=st.integers(0, 10_000), k=st.integers(1, 6))
def test_mixing_weights_are_its_closed_form(renormalize, scale, eps, seed, k):
    """``Mixing.weights(kept) = a(Z) · kept`` with ``Z = Σ kept``: the routers' weights and the
    coefficient the substitution oracle scores with are one rule."""
    kept = torch.rand(5, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mixing = Mixing(renormalize, scale, eps)
    closed = mixing.coefficient(kept.sum(-1, keepdim=True)) * kept
    torch.testing.assert_close(mixing.weights(kept), closed, rtol=1e-12, atol=0)
    if renormalize:
        torch.testing.assert_close(mixing.weights(kept).sum(-1), torch.full((5,), scale,
                                                                            dtype=torch.float64))


def test_mixing_coefficient_is_zero_for_an_empty_renormalised_selection():
    mixing = Mixing(renormalize=True, scale=2.0, eps=1e-20)
    assert mixing.coefficient(torch.zeros(3, dtype=torch.float64)).eq(0).all()
    assert Mixing(scale=2.5).coefficient(torch.zeros(3)) == 2.5


def test_a_rule_mixes_through_its_mixing():
    g = torch.softmax(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), -1)
    rule = RoutingRule(3, renormalize=True, scale=2.0, renormalize_eps=1e-20)
    idx, _ = rule.select(g)
    torch.testing.assert_close(rule.mix(g, idx), rule.mixing.weights(g.gather(-1, idx)))
    assert rule.mixing == Mixing(True, 2.0, 1e-20)


def test_rule_describes_itself():
    rule = RoutingRule(6, score="sigmoid", renormalize=True, scale=2.5,
                       selection_bias=torch.zeros(64), groups=8, groups_kept=4)
    assert rule.describe() == ("sigmoid scores, selection bias, top-k within 4 of 8 groups, "
                               "renormalised weights × 2.5")
    assert RoutingRule(8).describe() == "softmax scores, raw weights"


def _same_rule(a: RoutingRule, b: RoutingRule) -> None:
    assert a.to_dict() == b.to_dict()
    if a.selection_bias is None:
        assert b.selection_bias is None
    else:
        assert torch.equal(a.selection_bias, b.selection_bias)


def test_every_family_rule_round_trips_through_the_manifest_and_the_runs_table(embedded):
    """A run records its rule (``routing_rule``); the manifest's JSON and the ``runs`` table's
    column both give back the same rule, which routes the same."""
    adapter = MoEAdapter(embedded.model)
    rule = adapter.rule
    manifest = json.loads(json.dumps(dict(top_k=rule.top_k, renormalize=rule.renormalize,
                                          routing_rule=rule.to_dict())))
    from_manifest = RoutingRule.from_manifest(manifest, selection_bias=rule.selection_bias)
    _same_rule(from_manifest, rule)
    row = pa.Table.from_pylist([dict(role="evaluation", top_k=rule.top_k,
                                     renormalize=rule.renormalize, routing_rule=rule.to_json())],
                               schema=schema.RUNS_SCHEMA).to_pylist()[0]
    _same_rule(RoutingRule.from_manifest(row, selection_bias=rule.selection_bias), rule)
    g = rule.scores(torch.randn(6, adapter.num_experts,
                                generator=torch.Generator().manual_seed(1)))
    for a, b in zip(from_manifest.route(g), rule.route(g)):
        assert torch.equal(a, b)


def test_an_old_manifest_with_only_the_bool_reads_as_plain_top_k():
    """Runs captured before ``routing_rule`` (schema versions 2 and 3) keep loading."""
    old = dict(top_k=2, renormalize=True, num_experts=8)
    rule = RoutingRule.from_manifest(old)
    _same_rule(rule, RoutingRule(2, renormalize=True))
    assert not RoutingRule.from_manifest(dict(top_k=8, renormalize=False)).renormalize
    assert RoutingRule.from_manifest(dict(top_k=8, renormalize=None, routing_rule=None)).top_k == 8


def test_a_record_is_refused_when_it_cannot_be_rebuilt():
    biased = RoutingRule(2, score="sigmoid", selection_bias=torch.zeros(8)).to_dict()
    with pytest.raises(ValueError, match="pass selection_bias"):
        RoutingRule.from_dict(biased)
    with pytest.raises(ValueError, match="has no selection bias"):
        RoutingRule.from_dict(RoutingRule(2).to_dict(), selection_bias=torch.zeros(8))
    with pytest.raises(ValueError, match="unknown routing rule field"):
        RoutingRule.from_dict({**RoutingRule(2).to_dict(), "mixing_kind": "softmax-of-top-k"})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4), extra=st.integers(0, 4),
       quantized=st.booleans(), biased=st.booleans(), grouped=st.booleans())
def test_substitution_fast_selection_equals_the_rules_top_k_within_s(seed, k, extra, quantized,
                                                                      biased, grouped):
    """Substitution's selection by each token's cached selection order
    (policy.coverage.Substitution.first_in) is the rule's own top-k restricted to S
    (RoutingRule.select with ``allowed``), ties to the lower id included (coarsely quantised
    scores tie often, as bf16 routers do), group-limited rules (DeepSeek's: S's experts outside
    the token's kept groups after those inside) included; so is the whole coverage."""
    from moe_spec.policy.batch import RoutingBatch
    from moe_spec.policy.coverage import Substitution
    n, m, t = 8, 6, 3
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(t, m, n, generator=g) * 2, -1)
    if quantized:
        probs = (probs * 8).round() / 8
    bias = torch.randn(n, generator=g) * 0.1 if biased else None
    rule = RoutingRule(k, renormalize=True, selection_bias=bias,
                       **(dict(groups=4, groups_kept=2) if grouped else {}))
    assert rule.group_limited == grouped
    idx, w = rule.route(probs)
    batch = RoutingBatch(probs, idx, w, torch.ones(t, m, dtype=torch.bool),
                         torch.zeros(t, dtype=torch.long), rule)
    keep = torch.zeros(t, 2, n, dtype=torch.bool)
    for row in range(t):
        for j in range(2):
            keep[row, j, torch.randperm(n, generator=g)[:k + extra]] = True
    want, valid = rule.select(probs[:, None].expand(t, 2, m, n), keep[..., None, :])
    assert torch.equal(Substitution.first_in(batch, keep), want) and bool(valid.all())
    got_idx, got_w = Substitution().apply(batch, keep)  # the fast path, against the slow one
    slow_w = rule.mix(probs[:, None].expand(t, 2, m, n), want, valid)
    covered = keep[..., None, :].expand(t, 2, m, n).gather(-1, idx[:, None].expand(t, 2, m, k)
                                                           ).all(-1, keepdim=True)
    assert torch.equal(got_idx, torch.where(covered, idx[:, None], want))
    torch.testing.assert_close(got_w, torch.where(covered, w[:, None].to(slow_w.dtype), slow_w),
                               rtol=0, atol=0, equal_nan=True)  # (quantised 0s renormalise to NaN)
