"""Batched EAGLE verification (eagle.batched): lossless against b = 1 for every family."""

import pytest

from moe_spec.eagle import loading
from moe_spec.eagle.batched import BatchedDecoder, BatchPass, generate_batched
from moe_spec.eagle.decoding import EagleDecoder
from moe_spec.moe import models
from moe_spec.tasks import benchmarks

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out


@pytest.fixture(scope="module", params=models.EMBEDDED)
def pair(request):
    return loading.load_with_draft(request.param, device="cpu", dtype="float32")


def prompts(tok, count=7):
    """Prompts of different lengths (the padded cache is exercised), some from each benchmark."""
    out = []
    for i in range(count):
        bench = ("mbpp", "gsm8k", "humaneval")[i % 3]
        text = benchmarks.load(bench, offset=i, limit=1)[0].text
        out.append(tok(text)["input_ids"][: 24 + 5 * i])
    return out


def test_greedy_batched_outputs_equal_batch_size_one(pair):
    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    ids = prompts(loaded.tokenizer)
    caps = [8 + 3 * (i % 3) for i in range(len(ids))]  # sequences finish at different passes
    alone = [dec.generate(p, max_new_tokens=c) for p, c in zip(ids, caps)]
    for b in (2, 4, 8):
        got = {}
        for event in BatchedDecoder(dec, b).run(
                ((i, p) for i, p in enumerate(ids)), max_new_tokens=max(caps)):
            if isinstance(event, BatchPass):
                assert len(event.slots) <= b and len(set(event.slots)) == len(event.slots)
                got.update(event.finished)
        for i, ref in enumerate(alone):  # the cap only cuts the stream: compare its prefix
            assert got[i].output_ids[: caps[i]] == ref.output_ids, (loaded.name, b, i)
    full = generate_batched(dec, ids[:4], 4, max_new_tokens=12)
    assert [g.output_ids for g in full] == [dec.generate(p, max_new_tokens=12).output_ids
                                             for p in ids[:4]]
    assert all(g.stop_reason == "max_new_tokens" for g in full)


def test_batched_drafting_builds_each_sequence_its_own_tree(pair):
    """build_trees over sequences with different cache lengths and new-token counts gives the
    trees each sequence builds alone (same tokens and parents; scores to float noise), and
    leaves each draft cache as its own round would."""
    import torch

    from moe_spec.eagle import verify
    from moe_spec.eagle.tree import DraftCache, DraftInput, build_tree, build_trees

    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    ids = prompts(loaded.tokenizer, 4)
    firsts = []
    for p in ids:
        logits, feats, _ = verify.prefill(dec.target, dec.tap, torch.tensor([p]))
        root = int(logits.argmax())
        firsts.append((feats, torch.tensor(p[1:] + [root]), root))
    seconds = [(f[: j + 1], t[: j + 1], int(t[j])) for j, (f, t, _) in enumerate(firsts)]
    alone, together = [DraftCache() for _ in ids], [DraftCache() for _ in ids]
    for round_inputs in (firsts, seconds):  # the second round starts from unequal caches
        ref = [build_tree(head, c, *x, dec.tree_settings) for c, x in zip(alone, round_inputs)]
        got = build_trees(head, [DraftInput(c, *x) for c, x in zip(together, round_inputs)],
                          dec.tree_settings)
        for r, g in zip(ref, got):
            assert torch.equal(r.tokens, g.tokens) and torch.equal(r.parents, g.parents)
            assert torch.allclose(r.scores, g.scores, atol=1e-4)
        for a, t in zip(alone, together):
            assert a.length == t.length
            for (ka, va), (kt, vt) in zip(a.past, t.past):
                assert ka.shape == kt.shape and torch.allclose(ka, kt, atol=1e-5)


def test_prompts_prefilled_together_match_each_prefilled_alone(pair):
    import torch

    from moe_spec.eagle import verify

    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    ids = prompts(loaded.tokenizer, 3)
    logits, feats, cache = BatchedDecoder(dec, 3)._prefill(ids)
    for i, p in enumerate(ids):
        ref_logits, ref_feats, ref_cache = verify.prefill(dec.target, dec.tap, torch.tensor([p]))
        assert torch.allclose(logits[i], ref_logits, atol=1e-4)
        assert int(logits[i].argmax()) == int(ref_logits.argmax())
        assert feats[i].shape == ref_feats.shape and torch.allclose(feats[i], ref_feats,
                                                                    atol=1e-4)
        for mine, theirs in zip(cache.layers, ref_cache.layers):
            assert torch.allclose(mine.keys[i, :, :len(p)], theirs.keys[0], atol=1e-4)


def test_batch_stays_full_while_prompts_remain_and_ar_matches(pair):
    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    ids = prompts(loaded.tokenizer, 6)
    sizes = []
    for event in BatchedDecoder(dec, 4).run(enumerate(ids), max_new_tokens=8):
        if isinstance(event, BatchPass) and event.slots:
            sizes.append(len(event.slots))
            assert event.tokens_verified == len(event.slots) * dec.tree_settings.total_tokens
    queued_passes = sizes[: sizes.index(min(sizes))] if min(sizes) < 4 else sizes
    assert all(s == 4 for s in queued_passes[:2])  # full at the start (6 prompts, 4 slots)
    ar = generate_batched(dec, ids[:3], 3, max_new_tokens=6, autoregressive=True)
    assert [g.output_ids for g in ar] == [dec.generate(p, max_new_tokens=6).output_ids
                                           for p in ids[:3]]
    assert all(len(s.path) == 1 for g in ar for s in g.steps)


def test_a_prompt_that_stops_at_once_never_joins_the_batch(pair):
    loaded, head = pair
    dec = EagleDecoder(loaded.model, head)
    ids = prompts(loaded.tokenizer, 3)
    first = dec.generate(ids[1], max_new_tokens=1).output_ids[0]
    events = list(BatchedDecoder(dec, 2).run(enumerate(ids), max_new_tokens=6,
                                             eos_token_ids={first}))
    stopped = [e for e in events if not isinstance(e, BatchPass)]
    assert any(k == 1 and g.output_ids == [first] and not g.steps for k, g in stopped)
    with pytest.raises(ValueError):
        BatchedDecoder(dec, 0)


# --- capture --batch-size ------------------------------------------------------------------------
CAPTURE = ["--limit", "5", "--max-new-tokens", "14", "--no-progress", "--threads", "1"]


def _table(root, name, run):
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    t = pq.read_table(root / name, partitioning="hive")
    return t.filter(ds.field("run") == run)


@pytest.fixture(scope="module")
def batch_traces(tmp_path_factory):
    from moe_spec.capture import cli
    root = tmp_path_factory.mktemp("batched")
    assert cli.main([*CAPTURE, "--out", str(root), "--run", "b1"]) == 0
    assert cli.main([*CAPTURE, "--out", str(root), "--run", "b3", "--batch-size", "3"]) == 0
    return root


def test_batched_capture_writes_the_same_sequences_and_routing(batch_traces):
    import numpy as np
    one, three = (_table(batch_traces, "sequences", r).sort_by("prompt_index")
                  for r in ("b1", "b3"))
    assert one["output_token_ids"].equals(three["output_token_ids"])
    keys = [("prompt_index", "ascending"), ("step", "ascending"), ("layer", "ascending"),
            ("node", "ascending")]
    a, b = (_table(batch_traces, "routing", r).sort_by(keys) for r in ("b1", "b3"))
    assert a.num_rows == b.num_rows and a["topk_ids"].equals(b["topk_ids"])
    pa_, pb = (np.stack(t["router_probs"].to_numpy(zero_copy_only=False)) for t in (a, b))
    assert np.abs(pa_ - pb).max() < 1e-4
    trees = _table(batch_traces, "trees", "b3").to_pylist()
    assert {t["batch_size"] for t in trees} <= {1, 2, 3} and max(t["batch_size"] for t in trees) == 3
    for t in trees:  # the union over the batch holds each tree's own experts
        assert all(u >= e for u, e in zip(t["batch_unique_experts"], t["unique_experts"]))
        assert t["batch_tokens"] == t["batch_size"] * t["nodes"]
    assert all(t["batch_pass"] is None and t["batch_size"] == 1
               for t in _table(batch_traces, "trees", "b1").to_pylist())


def test_union_over_a_batch_is_a_group_by_in_sql(batch_traces):
    from moe_spec.analysis.sql import connect, run_query
    con = connect(batch_traces)
    got = run_query(con, """
        SELECT t.batch_pass, r.layer, count(DISTINCT e) AS experts,
               any_value(list_extract(t.batch_unique_experts, 1)) AS stored
        FROM routing r JOIN trees t USING (model, bench, run, prompt_index, step),
             unnest(r.topk_ids) AS u(e)
        WHERE r.run = 'b3' AND r.layer = 0
        GROUP BY ALL""").to_pylist()
    assert got and all(r["experts"] == r["stored"] for r in got)


def test_a_budget_caps_the_union_over_the_whole_batch(tmp_path):
    from moe_spec.capture import cli
    assert cli.main([*CAPTURE, "--out", str(tmp_path), "--run", "bb", "--batch-size", "3",
                     "--budget", "16", "--ranking", "router"]) == 0
    trees = _table(tmp_path, "trees", "bb").to_pylist()
    assert all(max(t["batch_experts_loaded"]) <= 16 for t in trees)
    assert any(max(t["batch_unique_experts"]) > 16 for t in trees)
    assert cli.main([*CAPTURE, "--out", str(tmp_path), "--run", "st", "--batch-size", "2",
                     "--budget", "16", "--ranking", "previous"]) == 2
