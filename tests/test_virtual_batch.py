"""Virtual batches (replay.virtual_batch): grouping and merging of tree-layers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.catalog.reader import PromptTreeLayers
from moe_spec.replay import virtual_batch

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out


def data(prompt: int, steps: int, layers=(0, 1), n=4, k=2, m=3, seed=0) -> PromptTreeLayers:
    rng = np.random.default_rng([seed, prompt])
    keys = [(s, layer) for s in range(steps) for layer in layers]
    sizes = [m + (s % 2) for s, _ in keys]  # trees of different sizes
    rows = sum(sizes)
    probs = rng.random((rows, n)).astype(np.float32)
    return PromptTreeLayers(
        prompt, f"p{prompt}", np.array([s for s, _ in keys]), np.array([lay for _, lay in keys]),
        np.r_[0, np.cumsum(sizes)], probs, np.argsort(-probs, 1)[:, :k],
        np.sort(probs, 1)[:, ::-1][:, :k].copy(), rng.random((rows, 5)).astype(np.float32),
        None, rng.random(rows).astype(np.float32))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=40, unique=True),
       st.integers(1, 9), st.integers(0, 2**31))
def test_groups_partition_the_prompts_in_batches_of_b(prompts, b, seed):
    found = virtual_batch.groups(prompts, b, seed)
    assert sorted(p for g in found for p in g) == sorted(prompts)
    assert all(len(g) == b for g in found[:-1]) and 1 <= len(found[-1]) <= b
    assert all(g == sorted(g) for g in found)
    assert found == virtual_batch.groups(list(reversed(prompts)), b, seed)  # seeded, not ordered


def test_merge_puts_each_step_of_the_group_in_one_tree_layer():
    datas = [data(3, steps=4), data(7, steps=2), data(9, steps=3)]
    merged = virtual_batch.merge(datas, virtual_batch.virtual_passes(), index=0, name="g0")
    assert list(zip(merged.step.tolist(), merged.layer.tolist())) == [
        (s, layer) for s in range(4) for layer in (0, 1)]
    for r in range(len(merged)):
        s, layer = int(merged.step[r]), int(merged.layer[r])
        parts = [d.probs[d.rows(q)] for d in datas for q in range(len(d))
                 if d.step[q] == s and d.layer[q] == layer]
        assert np.array_equal(merged.probs[merged.rows(r)], np.concatenate(parts))
        hidden = [d.hidden[d.rows(q)] for d in datas for q in range(len(d))
                  if d.step[q] == s and d.layer[q] == layer]
        assert np.array_equal(merged.hidden[merged.rows(r)], np.concatenate(hidden))
    # a step only the longest prompt reached holds its tree alone
    last = [r for r in range(len(merged)) if merged.step[r] == 3]
    assert all(merged.rows(r).stop - merged.rows(r).start == datas[0].rows(6).stop
               - datas[0].rows(6).start for r in last[:1])


def test_real_passes_follow_the_trees_table():
    datas = [data(0, steps=3), data(1, steps=2)]
    passes = {(0, 0): 0, (1, 0): 0, (0, 1): 1, (1, 1): 2, (0, 2): 2}
    merged = virtual_batch.merge(datas, virtual_batch.real_passes(passes), index=0, name="b")
    sizes = {(int(merged.step[r]), int(merged.layer[r])): merged.rows(r).stop - merged.rows(r).start
             for r in range(len(merged))}
    per = {(d.prompt_index, int(d.step[r]), int(d.layer[r])): d.rows(r).stop - d.rows(r).start
           for d in datas for r in range(len(d))}
    assert sizes[(2, 0)] == per[(1, 1, 0)] + per[(0, 2, 0)]
    assert sizes[(1, 1)] == per[(0, 1, 1)]


@pytest.fixture(scope="module")
def alone_and_together(tmp_path_factory):
    """The same two prompts captured one at a time (run ``alone``) and together (``together``,
    --batch-size 2: each pass holds step s of both while both run)."""
    from moe_spec.capture import cli as capture_cli

    root = tmp_path_factory.mktemp("alone_and_together")
    cap = ["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "2", "--max-new-tokens", "10",
           "--out", str(root), "--no-progress", "--threads", "1"]
    assert capture_cli.main([*cap, "--run", "alone"]) == 0
    assert capture_cli.main([*cap, "--run", "together", "--batch-size", "2"]) == 0
    return root


def replay_both_runs(root, options: list[str], sql: str, keys: list[str]):
    """Replay runs ``alone`` (b = 1 capture, virtual batches of 2) and ``together`` (captured
    with --batch-size 2) with ``options``; refuse ``together`` at a b it was not captured with;
    return ``sql``'s rows of each run, sorted by ``keys``."""
    import polars as pl

    from moe_spec.analysis.sql import connect
    from moe_spec.replay import cli as replay_cli

    rep = ["--traces", str(root), *options, "--batch-size", "2", "--no-progress", "--threads",
           "1"]
    for run in ("alone", "together"):
        assert replay_cli.main([*rep, "--run", run]) == 0
    assert replay_cli.main([*rep, "--run", "together", "--batch-size", "3"]) == 2  # not its b
    rows = connect(root).sql(sql).pl()
    return tuple(rows.filter(pl.col("run") == run).sort(keys) for run in ("alone", "together"))


def test_a_virtual_batch_replays_as_the_real_batched_capture_of_the_same_grouping(
        alone_and_together):
    """Two prompts captured one at a time and replayed as virtual batches of 2 give the
    shortlists and errors of the same two prompts captured together replayed over their real
    passes."""


    keys = ["step", "layer", "ranking", "coverage", "budget"]
    alone, together = replay_both_runs(
        alone_and_together, ["--ranking", "router", "sqmass", "oracle", "--budget", "8,16,24"],
        "SELECT run, step, layer, ranking, coverage, budget, trees, batch_size, rse, "
        "experts_loaded, unique_experts FROM replay_batch", keys)
    assert alone.height == together.height > 0
    assert alone.select(keys).equals(together.select(keys))
    assert (alone["trees"] == together["trees"]).all() and alone["trees"].max() == 2
    assert (alone["batch_size"] == 2).all()
    assert (alone["unique_experts"] == together["unique_experts"]).all()
    assert (alone["experts_loaded"] == together["experts_loaded"]).all()
    assert alone["rse"].to_numpy() == pytest.approx(together["rse"].to_numpy(), rel=1e-3,
                                                      abs=1e-6)


def test_closed_loop_over_a_virtual_batch_is_closed_loop_over_the_real_passes(
        alone_and_together):
    """The closed-loop version: each pass's trees re-verified together in one batched forward
    under one shortlist per layer give, tree by tree, the same acceptance, path, top-1 agreement,
    KL and experts loaded whether the pass is virtual (b = 1 capture) or real (--batch-size 2)."""
    import polars as pl


    keys = ["prompt_index", "step", "ranking", "coverage", "budget"]
    alone, together = replay_both_runs(
        alone_and_together, ["--mode", "closed", "--ranking", "router", "sqmass", "--budget",
                             "8,16,64"],
        "SELECT run, prompt_index, step, batch_pass, trees, batch_size, ranking, coverage, "
        "budget, accepted_length, captured_accepted_length, path_unchanged, top1_agreement, "
        "mean_kl, experts_loaded FROM replay_closed_batch", keys)
    assert alone.height == together.height > 0
    same = ["batch_pass", "trees", "accepted_length", "captured_accepted_length",
            "path_unchanged", "experts_loaded"]
    assert alone.select(keys + same).equals(together.select(keys + same))
    assert alone["trees"].max() == 2 and (alone["batch_size"] == 2).all()
    assert alone["top1_agreement"].to_numpy() == pytest.approx(
        together["top1_agreement"].to_numpy(), abs=1e-9)
    assert alone["mean_kl"].to_numpy() == pytest.approx(together["mean_kl"].to_numpy(),
                                                        rel=1e-3, abs=1e-6)
    full = alone.filter(pl.col("budget") == 64)
    assert full["path_unchanged"].all() and full["mean_kl"].max() < 1e-6


def test_replay_loads_the_model_in_the_dtype_it_was_captured_in(tmp_path):
    """A bf16 capture replayed on a CPU stays bf16 in memory (a full-size model in fp32 would
    not fit); --dtype overrides."""
    import json

    from moe_spec.capture import cli as capture_cli
    from moe_spec.replay import cli as replay_cli

    assert capture_cli.main(["--model", "tiny-olmoe", "--limit", "1", "--max-new-tokens", "4",
                             "--dtype", "bfloat16", "--device", "cpu", "--out", str(tmp_path),
                             "--no-progress"]) == 0
    for option, expected, budget in ((None, "bfloat16", "16"), ("float32", "float32", "24")):
        extra = [] if option is None else ["--dtype", option]  # (a new budget: computed)
        assert replay_cli.main(["--traces", str(tmp_path), "--ranking", "router", "--budget",
                                budget, "--no-progress", "--output", str(tmp_path.parent / "r.json"),
                                *extra]) == 0  # (--output inside the traces root is refused)
        assert json.loads((tmp_path.parent / "r.json").read_text())["model_dtype"] == expected
