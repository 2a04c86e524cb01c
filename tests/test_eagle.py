"""EAGLE drafting, tree verification and acceptance on the embedded models and heads."""

import math

import pytest
import torch

from moe_spec.eagle import acceptance, loading, verify
from moe_spec.eagle.acceptance import SamplingSettings
from moe_spec.eagle.decoding import EagleDecoder
from moe_spec.eagle.tree import DraftCache, DraftTree, TreeSettings, build_tree
from moe_spec.moe import models
from moe_spec.tasks import benchmarks


@pytest.fixture(scope="module", params=models.EMBEDDED)
def pair(request):
    return loading.load_with_draft(request.param, device="cpu", dtype="float32")


def prompt_ids(tok, bench="mbpp", i=0, n=48):
    return tok(benchmarks.load(bench, offset=i, limit=1)[0].text)["input_ids"][:n]


def first_tree(loaded, head, settings=TreeSettings()):
    ids = prompt_ids(loaded.tokenizer)
    tap = verify.FeatureTap(loaded.model, head.config.feature_layers)
    logits, feats, cache = verify.prefill(loaded.model, tap, torch.tensor([ids]))
    root = int(logits.argmax())
    tree = build_tree(head, DraftCache(), feats, torch.tensor(ids[1:] + [root]), root, settings)
    return ids, tap, cache, tree


def test_tree_invariants(pair):
    loaded, head = pair
    ids, _, _, tree = first_tree(loaded, head)
    assert tree.size == 63 and int(tree.parents[0]) == -1 and int(tree.depth.max()) <= 8
    for j in range(1, tree.size):
        p = int(tree.parents[j])
        assert 0 <= p < j  # every kept node's parent is kept, and comes first
        assert int(tree.depth[j]) == int(tree.depth[p]) + 1
        assert float(tree.scores[j]) <= float(tree.scores[p]) + 1e-6
        # ancestors = the chain of parents, itself included
        chain, a = {j}, p
        while a >= 0:
            chain.add(a)
            a = int(tree.parents[a])
        assert set(tree.ancestors[j].nonzero().flatten().tolist()) == chain
    assert torch.equal(tree.ancestors.sum(1) - 1, tree.depth)
    mask = verify.tree_attention_mask(tree, len(ids), torch.float32)[0, 0]
    assert (mask[:, :len(ids)] == 0).all()
    assert torch.equal(mask[:, len(ids):] == 0, tree.ancestors)
    siblings = {}
    for j in range(1, tree.size):
        siblings.setdefault(int(tree.parents[j]), []).append(int(tree.tokens[j]))
    assert all(len(v) == len(set(v)) for v in siblings.values())


def test_tree_logits_equal_sequential_logits(pair):
    loaded, head = pair
    ids, tap, cache, tree = first_tree(loaded, head)
    logits, _ = verify.verify_tree(loaded.model, tap, cache, tree, len(ids))
    for j in [0, 1, 5, 17, 40, 62]:
        path = tree.ancestors[j].nonzero().flatten()  # root → j in node order
        seq = torch.tensor([ids + tree.tokens[path].tolist()])
        with torch.no_grad():
            ref = loaded.model(input_ids=seq).logits[0, -1]
        torch.testing.assert_close(logits[j], ref, rtol=1e-4, atol=1e-4)


def test_cache_after_acceptance_equals_fresh_forward(pair):
    loaded, head = pair
    ids, tap, cache, tree = first_tree(loaded, head)
    logits, _ = verify.verify_tree(loaded.model, tap, cache, tree, len(ids))
    # force a long path to make compaction non-trivial: the deepest leaf's chain
    leaf = int(tree.depth.argmax())
    path = tree.ancestors[leaf].nonzero().flatten()
    verify.compact_cache(cache, len(ids), path)
    fresh = verify.new_cache(loaded.model)  # the same kind (full layers for sliding models)
    with torch.no_grad():
        loaded.model(input_ids=torch.tensor([ids + tree.tokens[path].tolist()]), cache=fresh,
                     use_cache=True)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


PROMPTS = [(b, i) for b in ("mbpp", "gsm8k", "humaneval") for i in range(7)]


@pytest.mark.slow  # 21 prompts decoded twice per family
def test_greedy_eagle_equals_transformers_generate(pair):
    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    accepted = []
    for bench, i in PROMPTS:
        ids = prompt_ids(loaded.tokenizer, bench, i, n=64)
        out = dec.generate(ids, max_new_tokens=24)
        with torch.no_grad():
            ref = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                        min_new_tokens=24, pad_token_id=loaded.tokenizer.pad_token_id)
        assert out.output_ids == ref[0, len(ids):].tolist(), (bench, i)
        accepted.append(out.mean_accepted_length)
    assert sum(accepted) / len(accepted) > 1.2  # the trained heads do get drafts accepted


def test_eos_and_max_new_tokens_stop(pair):
    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    ids = prompt_ids(loaded.tokenizer)
    out = dec.generate(ids, max_new_tokens=5)
    assert len(out.output_ids) == 5 and out.stop_reason == "max_new_tokens"
    eos = out.output_ids[2]
    out = dec.generate(ids, max_new_tokens=20, eos_token_ids={eos})
    assert out.output_ids[-1] == eos and eos not in out.output_ids[:-1]
    assert out.stop_reason == "eos"


def test_autoregressive_baseline_through_the_same_loop(pair):
    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    ids = prompt_ids(loaded.tokenizer)
    ar = dec.generate(ids, max_new_tokens=12, autoregressive=True)
    sp = dec.generate(ids, max_new_tokens=12)
    assert ar.output_ids == sp.output_ids
    assert all(s.accepted_length == 1 and s.tree is None for s in ar.steps)


# --- sampling ---------------------------------------------------------------------------------


def _chi2_ok(counts: dict, expected: dict, n: int) -> bool:
    """Pearson chi-square against exact probabilities at the 0.1% level (cells pooled < 5)."""
    from scipy.stats import chi2
    stat, dof, rest_o, rest_e = 0.0, -1, 0, 0.0
    for key, p in expected.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            rest_o, rest_e = rest_o + o, rest_e + e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / max(rest_e, 1e-9)
        dof += 1
    assert sum(counts.values()) == n and set(counts) <= set(expected)
    return stat < chi2.ppf(0.999, max(dof, 1))


@pytest.mark.slow  # a chi-square over many draws: a minute of CPU
def test_rejection_sampling_preserves_target_distribution_exactly_on_a_synthetic_tree():
    """root → children {0, 1, 2}; node of token 0 has children {1, 3}. Target distributions per
    node are fixed; emitted (x1, x2) must follow p_root(x1)·p_{x1}(x2) (x2 only when x1 is a
    drafted child, since otherwise the pass ends after the residual sample)."""
    v = 5
    tree = DraftTree(tokens=torch.tensor([4, 0, 1, 2, 1, 3]), parents=torch.tensor([-1, 0, 0, 0, 1, 1]),
                     depth=torch.tensor([0, 1, 1, 1, 2, 2]),
                     scores=torch.tensor([0.0, -0.1, -0.5, -0.9, -0.3, -0.7]))
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(6, v, generator=g) ** 2
    probs /= probs.sum(-1, keepdim=True)
    logits = probs.log()
    settings = SamplingSettings(temperature=1.0)
    node_of_child = {0: 1, 1: 2, 2: 3}
    expected = {}
    for x1 in range(v):
        if x1 in node_of_child:
            for x2 in range(v):
                expected[(x1, x2)] = float(probs[0, x1] * probs[node_of_child[x1], x2])
        else:
            expected[(x1, None)] = float(probs[0, x1])
    n, counts = 20000, {}
    for _ in range(n):
        acc = acceptance.accept_sampling(tree, logits, settings, g)
        emitted = tree.tokens[acc.path[1:]].tolist() + [acc.bonus]
        key = (emitted[0], emitted[1] if len(emitted) > 1 else None)
        counts[key] = counts.get(key, 0) + 1
    assert _chi2_ok(counts, expected, n)


@pytest.mark.slow  # many draws: a minute of CPU
def test_wrong_residual_would_fail_the_synthetic_check():
    """The check has power: the true law passes, a residual-free sampler's law is rejected."""
    tree = DraftTree(tokens=torch.tensor([4, 0, 1]), parents=torch.tensor([-1, 0, 0]),
                     depth=torch.tensor([0, 1, 1]), scores=torch.tensor([0.0, -0.1, -0.2]))
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    g = torch.Generator().manual_seed(1)
    n, counts = 20000, {}
    for _ in range(n):
        acc = acceptance.accept_sampling(tree, p.log().expand(3, -1), SamplingSettings(1.0), g)
        x1 = int(tree.tokens[acc.path[1]]) if len(acc.path) > 1 else acc.bonus
        counts[(x1,)] = counts.get((x1,), 0) + 1
    exact = {(i,): float(p[i]) for i in range(5)}
    assert _chi2_ok(counts, exact, n)
    # A sampler without the residual (accept child x w.p. p(x) un-renormalised, fall back to p
    # itself) would give this law instead; the same counts must reject it.
    reject_both = (1 - 0.5) * (1 - 0.3)
    wrong = {(0,): 0.5 + reject_both * 0.5, (1,): 0.5 * 0.3 + reject_both * 0.3,
             (2,): reject_both * 0.1, (3,): reject_both * 0.05, (4,): reject_both * 0.05}
    assert not _chi2_ok(counts, wrong, n)


@pytest.mark.slow  # many sampled decodes
def test_speculative_sampling_end_to_end_matches_plain_sampling():
    """tiny-mixtral, T=1 with top-k 3: the joint law of the first two generated tokens (the
    second one comes through tree acceptance) equals the target's, over 300 seeds."""
    loaded, head = loading.load_with_draft("tiny-mixtral", device="cpu", dtype="float32")
    settings = SamplingSettings(temperature=1.0, top_k=3)
    dec = EagleDecoder(loaded.model, head, tree=TreeSettings(16, 3, 4), sampling=settings)
    ids = prompt_ids(loaded.tokenizer, "gsm8k", 0, n=32)
    with torch.no_grad():
        p1 = acceptance.target_probs(loaded.model(input_ids=torch.tensor([ids])).logits[0, -1],
                                     settings)
        expected = {}
        for x1 in p1.nonzero().flatten().tolist():
            p2 = acceptance.target_probs(
                loaded.model(input_ids=torch.tensor([ids + [x1]])).logits[0, -1], settings)
            for x2 in p2.nonzero().flatten().tolist():
                expected[(x1, x2)] = float(p1[x1] * p2[x2])
    n, counts = 300, {}
    for seed in range(n):
        out = dec.generate(ids, max_new_tokens=2, seed=seed).output_ids
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-5)
    assert _chi2_ok(counts, expected, n)
