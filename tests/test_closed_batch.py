"""Closed-loop replay over (virtual) batches (replay/closed_loop.py): a pass's trees re-verified
in one batched forward share one shortlist per MoE layer. b = 1 through that path is today's
per-tree closed loop (to float rounding: the cells of a pass share a forward); at B = N it is the
unbudgeted verification; at a tight B the
shortlist is really shared (results differ from b = 1) and equals a slow reference that forms
the union of the pass's router scores by hand, layer by layer. (Virtual vs real batches:
tests/test_virtual_batch.py.)"""

from types import SimpleNamespace

import pytest
import torch

from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import Catalog
from moe_spec.catalog.results import Block
from moe_spec.eagle import acceptance, verify
from moe_spec.moe import models
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.moe.recorder import VerifyRecorder
from moe_spec.policy import coverage, rankings
from moe_spec.replay import closed_loop, modes, virtual_batch
from moe_spec.replay.closed_loop import ClosedTask

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "16", "--no-progress",
       "--threads", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("closed_batch")
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(root), "--run", "eval"]) == 0
    run = Catalog(root).runs(names=["eval"])[0]
    loaded = models.load("tiny-olmoe", device="cpu", dtype="float32")
    return run, MoEAdapter(loaded.model)


def tasks(specs, budgets):
    """ClosedTasks for (ranking, coverage) pairs; nothing is written (no unit)."""
    return [ClosedTask(SimpleNamespace(table="replay_closed"), Block(None, budgets),
                       rankings.get(r), coverage.get(c), None) for r, c in specs]


def key(row):
    return row["prompt_index"], row["step"], row["ranking"], row["coverage"], row["budget"]


METRICS = ("accepted_length", "captured_accepted_length", "path_unchanged", "top1_agreement",
           "mean_kl", "experts_loaded")


@torch.no_grad()
def per_tree_reference(run, prompt, adapter, tasks_):
    """Today's closed loop, frozen: each tree verified alone (eagle.verify.verify_tree), the
    cache compacted back to the prefix after every forward."""
    model = adapter.model
    seq, trees, nodes = closed_loop._prompt_tables(run, prompt)
    by_step = closed_loop._trees_by_step(nodes, "cpu")
    committed = seq["prompt_token_ids"] + seq["output_token_ids"]
    cache, cached = verify.new_cache(model), 0
    pid = run.manifest["prompt_ids"][prompt - run.settings["offset"]]
    rows = {i: [] for i in range(len(tasks_))}
    for task in tasks_:
        for b in task.block.budgets:
            task.budget(b).reset()
    empty = torch.zeros(0, dtype=torch.long)
    for t in trees:
        prefix = t["prefix_len"]
        if prefix > cached:
            verify.forward_tokens(model, None, cache, torch.tensor(committed[cached:prefix]),
                                  cached)
            cached = prefix
        tree, captured_path = by_step[t["step"]]
        ref_logits, _ = verify.verify_tree(model, None, cache, tree, prefix)
        verify.compact_cache(cache, prefix, empty)
        ref = acceptance.accept_greedy(tree, ref_logits)
        ref_logp = torch.log_softmax(ref_logits.float(), -1)
        for i, task in enumerate(tasks_):
            for b in task.block.budgets:
                rec = VerifyRecorder(adapter, budget=task.budget(b), record_tensors=False)
                with rec(t["step"], tree, prefix):
                    logits, _ = verify.verify_tree(model, None, cache, tree, prefix)
                verify.compact_cache(cache, prefix, empty)
                got = acceptance.accept_greedy(tree, logits)
                loaded = [r.experts_loaded for r in rec.take()[0][1]]
                rows[i].append(dict(
                    prompt_index=prompt, prompt_id=pid, step=t["step"],
                    ranking=task.ranking.name, coverage=task.coverage.name, budget=b,
                    **closed_loop.tree_metrics(got, ref, captured_path, t["accepted_length"],
                                               logits, ref_logits, ref_logp, loaded)))
    return rows


DISCRETE = ("accepted_length", "captured_accepted_length", "path_unchanged", "experts_loaded")


def same_cell(a, b):
    """Equal discrete metrics; the continuous ones to float rounding (cells verified in one
    batched forward may sum in another order than a forward of their own)."""
    return {m: a[m] for m in DISCRETE} == {m: b[m] for m in DISCRETE} and all(
        a[m] == pytest.approx(b[m], rel=1e-4, abs=1e-7) for m in ("top1_agreement", "mean_kl"))


def test_b1_through_the_batched_path_is_todays_closed_loop(setup):
    run, adapter = setup
    specs = [("router", "truncation"), ("sqmass", "substitution"), ("previous", "truncation")]
    for prompt in run.prompt_indices():
        new = closed_loop.replay_group(run, [prompt], virtual_batch.virtual_passes(), adapter,
                                       tasks(specs, [8, 24]))
        old = per_tree_reference(run, prompt, adapter, tasks(specs, [8, 24]))
        for i in range(len(specs)):
            assert len(new[i]) == len(old[i]) > 0
            for a, b in zip(new[i], old[i]):
                assert key(a) == key(b) and a["trees"] == 1 and a["batch_pass"] == a["step"]
                assert same_cell(a, b), (a, b)


def group_rows(run, adapter, prompts, specs, budgets, b):
    """Every tree's rows with ``prompts`` cut into groups of ``b`` in order (passes: steps)."""
    out = {}
    for lo in range(0, len(prompts), b):
        rows = closed_loop.replay_group(run, prompts[lo:lo + b], virtual_batch.virtual_passes(),
                                        adapter, tasks(specs, budgets))
        out.update({key(r): r for i in rows for r in rows[i]})
    return out


def test_all_experts_is_the_unbudgeted_verification_and_a_tight_budget_is_shared(setup):
    run, adapter = setup
    prompts = run.prompt_indices()
    n = adapter.num_experts
    specs = [("router", "truncation"), ("router", "substitution")]
    together = group_rows(run, adapter, prompts, specs, [8, n], b=3)
    alone = group_rows(run, adapter, prompts, specs, [8, n], b=1)
    assert together.keys() == alone.keys()
    assert max(r["trees"] for r in together.values()) == 3
    full = [r for r in together.values() if r["budget"] == n]
    assert all(r["mean_kl"] < 1e-6 and r["top1_agreement"] == 1.0 for r in full)
    assert all(r["accepted_length"] == r["captured_accepted_length"] and r["path_unchanged"]
               for r in full)
    # one shortlist per pass: the pass's trees load the same experts at every layer, at most B
    passes = {}
    for r in together.values():
        passes.setdefault((r["step"], r["coverage"], r["budget"]), set()).add(
            tuple(r["experts_loaded"]))
    assert all(len(v) == 1 for v in passes.values())
    tight = [k for k, r in together.items() if r["budget"] == 8]
    assert all(max(together[k]["experts_loaded"]) <= 8 for k in tight)
    # ... ranked on all the pass's tokens, so at least one tree's outcome differs from b = 1
    assert any(together[k]["mean_kl"] != pytest.approx(alone[k]["mean_kl"], rel=1e-3)
               for k in tight if together[k]["trees"] > 1)


class HandUnion:
    """Router ranking × truncation with the shortlist formed by hand: per layer, the top B of
    s_i = Σ_t g_i(t) over every token of every tree given (ties to the lower id), from the
    router scores the previous sweep recorded; a token keeps its natural top-k weights inside S
    and 0 outside."""

    def __init__(self, adapter, budget: int):
        self.adapter, self.budget = adapter, budget
        self.keep: dict[int, torch.Tensor] = {}  # layer -> [N] bool, from the last sweep
        self.seen: dict[int, list[torch.Tensor]] = {}

    def hook(self, layer):
        def fn(module, args, out):
            logits, weights, idx = out
            probs = layer.rule.scores(logits)
            idx, natural, _ = layer.rule.natural(probs, idx, weights)
            self.seen.setdefault(layer.index, []).append(probs.float())
            if layer.index not in self.keep:
                return logits, natural.to(weights.dtype), idx
            inside = self.keep[layer.index][idx]
            w = torch.where(inside, natural, torch.zeros_like(natural))
            anchor = int(self.keep[layer.index].int().argmax())
            return logits, w.to(weights.dtype), torch.where(inside, idx, anchor)
        return fn

    def next_sweep(self):
        for layer, probs in self.seen.items():
            score = torch.cat(probs).sum(0)
            order = torch.argsort(-score, stable=True)[:self.budget]
            self.keep[layer] = torch.zeros_like(score, dtype=torch.bool).index_fill_(0, order,
                                                                                     True)
        self.seen = {}


@torch.no_grad()
def slow_union_reference(run, prompts, adapter, budget):
    """Each pass (the step-s trees of ``prompts``) verified one tree at a time with the hand
    shortlist: sweep s makes layers ≤ s right (a layer's input depends on the layers below), so
    L + 1 sweeps give every layer the union of the pass's true router scores."""
    model = adapter.model
    states = [closed_loop.PromptState(run, p, "cpu") for p in prompts]
    layers = len(list(adapter))
    rows = {}
    for step in sorted({t["step"] for s in states for t in s.trees}):
        members = [(s, t) for s in states for t in s.trees if t["step"] == step]
        hand = HandUnion(adapter, budget)
        hooks = [layer.router.register_forward_hook(hand.hook(layer)) for layer in adapter]
        try:
            for _ in range(layers + 1):
                hand.next_sweep()
                logits = []
                for s, t in members:
                    tree = s.by_step[step][0]
                    cache = s.cache_at(model, t["prefix_len"])
                    out, _ = verify.verify_tree(model, None, cache, tree, t["prefix_len"])
                    verify.compact_cache(cache, t["prefix_len"], torch.zeros(0, dtype=torch.long))
                    logits.append(out)
        finally:
            for h in hooks:
                h.remove()
        for (s, t), out in zip(members, logits):
            tree, path = s.by_step[step]
            cache = s.cache_at(model, t["prefix_len"])
            ref_logits, _ = verify.verify_tree(model, None, cache, tree, t["prefix_len"])
            verify.compact_cache(cache, t["prefix_len"], torch.zeros(0, dtype=torch.long))
            ref = acceptance.accept_greedy(tree, ref_logits)
            rows[(s.index, step)] = closed_loop.tree_metrics(
                acceptance.accept_greedy(tree, out), ref, path, t["accepted_length"], out,
                ref_logits, torch.log_softmax(ref_logits.float(), -1), [budget] * layers)
    return rows


def test_the_shared_shortlist_is_the_hand_union_of_the_pass(setup):
    run, adapter = setup
    prompts = run.prompt_indices()[:2]
    got = closed_loop.replay_group(run, prompts, virtual_batch.virtual_passes(), adapter,
                                   tasks([("router", "truncation")], [8]))[0]
    want = slow_union_reference(run, prompts, adapter, 8)
    assert {(r["prompt_index"], r["step"]) for r in got} == set(want) and len(want) > 2
    for r in got:
        w = want[(r["prompt_index"], r["step"])]
        assert r["accepted_length"] == w["accepted_length"]
        assert r["path_unchanged"] == w["path_unchanged"]
        assert r["top1_agreement"] == w["top1_agreement"]
        assert r["mean_kl"] == pytest.approx(w["mean_kl"], rel=1e-3, abs=1e-6)


def test_closed_loop_takes_a_batch_size():
    mode = modes.batched("closed", 4, seed=2)
    assert isinstance(mode, modes.BatchedClosedLoop) and mode.table == "replay_closed_batch"
    assert mode.key() == dict(batch_size=4, batch_seed=2) and mode.runtime_rankings_only
    assert modes.batched("closed", 1) is modes.MODES["closed"]
    assert isinstance(modes.batched("open", 4), modes.BatchedOpenLoop)
