"""Issue 42, round 4's surface: the co-activation heatmap masks never-seen pairs in their own
colour and ticks every expert, the batch figures colour by ranking and explain a saturated
MoESD line, the tree viewer's tidy layout and visible whitespace, the replay summary's and the
report's gap closed say how they are aggregated, the speedup page's τ caveat, the batched
capture's per-pass summary, and evaluate naming the quality table's folder."""

from __future__ import annotations

import json
import sys

import numpy as np
import polars as pl
import pytest

from analysis import figures
from analysis.routing import moesd_uniform
from capture import cli as capture_cli

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "10", "--no-progress"]


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """A b = 2 capture of 3 prompts (an odd count: the last pass holds one tree)."""
    root = tmp_path_factory.mktemp("round4")
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(root), "--run", "b2",
                             "--batch-size", "2", "--threads", "1"]) == 0
    return root


# --- 6. co-activation heatmap ----------------------------------------------------------------
def _pairs(n=16):
    """Counts with a block of pairs never seen together and one expert never selected."""
    rng = np.random.default_rng(0)
    m = rng.integers(1, 20, (n, n)).astype(float)
    m = m + m.T
    m[:4, 8:12] = m[8:12, :4] = 0  # never together
    m[5, :] = m[:, 5] = 0  # expert 5 never selected
    np.fill_diagonal(m, 99)
    lift = m / m.mean()
    lift[5, :] = lift[:, 5] = np.nan
    np.fill_diagonal(lift, np.nan)
    return m, lift


@pytest.mark.parametrize("lift", [True, False])
def test_never_seen_pairs_have_their_own_colour_not_the_bottom_of_the_scale(lift):
    m, ratio = _pairs()
    fig = figures.coactivation(m, None, "t", lift=ratio if lift else None)
    heat, mask = fig.data[0], fig.data[1]
    z = np.array(heat.z, dtype=float)
    never = np.array(mask.z, dtype=float)
    assert np.isnan(z[:4, 8:12]).all() and np.isnan(z[5, :]).all()  # off the colour scale
    assert (never[:4, 8:12] == 1).all() and (never[5, np.arange(16) != 5] == 1).all()
    assert np.isfinite(z[0, 1]) and np.isnan(never[0, 1])  # a seen pair: the scale, no mask
    assert np.isnan(np.diag(z)).all() and np.isnan(np.diag(never)).all()
    assert mask.showscale is False and {c for _, c in mask.colorscale} == {figures.NEVER_SEEN}
    legend = {t.name for t in fig.data if t.type == "scatter"}
    assert {"never seen together", "diagonal: an expert with itself"} <= legend
    diagonal = np.array(fig.data[2].z, dtype=float)
    assert (np.diag(diagonal) == 1).all() and np.isnan(diagonal[0, 1])
    assert {c for _, c in fig.data[2].colorscale} == {figures.SELF_PAIR} != {figures.NEVER_SEEN}


@pytest.mark.parametrize("n", [16, 64, 128])
def test_every_expert_id_is_a_tick_on_both_axes(n):
    m = np.ones((n, n))
    order = np.random.default_rng(1).permutation(n)
    fig = figures.coactivation(m, order, "t")
    for axis in (fig.layout.xaxis, fig.layout.yaxis):
        assert axis.tickmode == "array" and list(axis.tickvals) == [str(i) for i in order]
        assert axis.tickfont.size >= 6
    assert fig.layout.width - 250 >= 7 * n - 1  # at least 7 px an expert


# --- 7. batch regime figures -------------------------------------------------------------------
def test_batch_errors_colour_by_ranking_and_dash_by_b():
    rows = [dict(batch_size=b, ranking=r, budget=B, rse=0.1 / B * (1 + i + b))
            for b in (1, 2, 4) for i, r in enumerate(("router", "oracle", "coact"))
            for B in (8, 16)]
    fig = figures.batch_errors(pl.DataFrame(rows), 64)
    lines = {t.name: t.line for t in fig.data}
    assert len(lines) == 9
    at_one = [lines[f"{r}, b = 1"] for r in ("router", "oracle", "coact")]
    assert len({line.color for line in at_one}) == 3  # b = 1's rankings stay apart
    assert len({line.dash for line in at_one}) == 1
    router = [lines[f"router, b = {b}"] for b in (1, 2, 4)]
    assert len({line.color for line in router}) == 1 and len({line.dash for line in router}) == 3


def _regime(tokens):
    n, k = 64, 8
    return pl.DataFrame(dict(model="m", bench="mbpp", batch_size=[1, 2, 4], tokens=tokens,
                             unique_experts=[20.0, 25.0, 30.0], seconds=[0.1] * 3,
                             passes=[5, 5, 5], n=n, k=k,
                             uniform=moesd_uniform(n, k, np.array(tokens, dtype=float))))


def test_a_saturated_moesd_line_is_said_to_be_saturated():
    fig = figures.batch_regime(_regime([63.0, 126.0, 252.0]), 64)
    uniform = next(t for t in fig.data if "MoESD" in t.name)
    assert np.allclose(uniform.y, 64 * (1 - (56 / 64) ** np.array([63, 126, 252])))
    assert "saturated" in uniform.name
    note = " ".join(a.text for a in fig.layout.annotations)
    assert "≥ 99%" in note and "34 tokens" in note and "not clipped" in note


def test_an_unsaturated_moesd_line_has_no_saturation_note():
    fig = figures.batch_regime(_regime([2.0, 4.0, 8.0]), 64)
    uniform = next(t for t in fig.data if "MoESD" in t.name)
    assert "saturated" not in uniform.name and uniform.y[0] < 20
    assert not any("saturates" in (a.text or "") for a in fig.layout.annotations)


# --- 8. tree viewer ----------------------------------------------------------------------------
def _tree():
    """A draft tree whose breadth-first rows interleave subtrees (the old layout crossed them)."""
    parent = [-1, 0, 0, 0, 1, 2, 1, 3, 2, 4, 5, 4]
    depth = [0]
    for p in parent[1:]:
        depth.append(depth[p] + 1)
    nodes = pl.DataFrame(dict(node=range(len(parent)), parent=parent, depth=depth,
                              token_id=range(len(parent)), draft_logprob=[-0.5] * len(parent),
                              accepted=[i in (0, 1, 4) for i in range(len(parent))]))
    text = [" ", "\n", "\t", "def", " return", "x", "\n    ", "", "y", "z", "(", ")"]
    return nodes, text


def test_tree_layout_is_tidy_parents_centred_and_edges_never_cross():
    from app.views import _tidy_x
    nodes, _ = _tree()
    parent = np.array(nodes["parent"].to_list())
    depth = nodes["depth"].to_numpy()
    x = _tidy_x(parent)
    kids = {j: [c for c in range(len(parent)) if parent[c] == j] for j in range(len(parent))}
    leaves = [j for j in range(len(parent)) if not kids[j]]
    assert sorted(x[leaves]) == list(range(len(leaves)))  # leaves evenly spaced
    for j, c in kids.items():
        if c:
            assert x[j] == pytest.approx((x[c[0]] + x[c[-1]]) / 2)
    for d in np.unique(depth)[1:]:  # edges into depth d keep their parents' order: no crossing
        idx = np.flatnonzero(depth == d)
        idx = idx[np.argsort(x[idx])]
        assert list(x[parent[idx]]) == sorted(x[parent[idx]])
        assert len(set(x[idx])) == len(idx)  # no two nodes of a depth on one spot


def test_tree_labels_show_whitespace_and_alternate_when_close():
    from app.views import _tree_figure
    nodes, text = _tree()
    fig = _tree_figure(nodes, [[]] * nodes.height, text)
    labels = [t for trace in fig.data if trace.mode == "markers+text" for t in trace.text]
    assert {"␣", "⏎", "⇥", "∅", "⏎␣␣␣…", "␣ret…"} <= set(labels)
    assert all(label.strip() for label in labels)  # no blank label
    hover = " ".join(h for trace in fig.data if trace.hovertext for h in trace.hovertext)
    assert "␣return" in hover and "' return'" in hover  # the whole token on hover
    places = [p for trace in fig.data if trace.mode == "markers+text"
              for p in trace.textposition]
    assert "bottom center" in places and "top center" in places


# --- 9. gap closed: how it is aggregated -------------------------------------------------------
def test_report_key_number_says_it_is_one_budget(monkeypatch):
    from types import SimpleNamespace

    import duckdb

    from analysis import report
    con = duckdb.connect()
    con.execute("CREATE TABLE trees AS SELECT 'm' AS model, 'mbpp' AS bench, 'r' AS run, "
                "NULL AS budget, "
                "4.0 AS accepted_length, [30, 32] AS unique_experts")
    errors = pl.DataFrame([dict(model="m", bench="mbpp", ranking=r, budget=b,
                                coverage="truncation", rse=v / b)
                           for b in (8, 16, 24) for r, v in (("router", 3.0), ("oracle", 1.0),
                                                             ("coact", 1.5))])
    monkeypatch.setattr(report, "headline_projection", lambda *a: None)
    runs = [SimpleNamespace(manifest=dict(num_experts=64))]
    numbers = dict(report.key_numbers(con, {"errors": errors}, "m", "mbpp", runs))
    (label,) = [k for k in numbers if "gap coact closes" in k]
    assert "at one budget, B = 16" in label and "not averaged over budgets" in label
    assert numbers[label] == "75%"  # (3 − 1.5) / (3 − 1) at B = 16


# --- 10. speedup page: τ from the captured model ----------------------------------------------
def test_speedup_page_warns_that_tau_comes_from_the_captured_model(batched, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from app.views import PAGES
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(batched)])
    at = AppTest.from_file(str(__import__("pathlib").Path(__file__).parents[1] / "app" /
                               "main.py"), default_timeout=180)
    at.run()
    name = next(n for n, (title, _) in PAGES.items() if title == "Speedup projection")
    at.switch_page(f"screens/{name}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    target = at.selectbox(key="speed_target")
    assert not target.value.startswith("captured shape")  # a real shape by default
    assert any("carry over" in w.value and "captured model" in w.value for w in at.warning)
    captured = next(o for o in target.options if o.startswith("captured shape"))
    target.set_value(captured).run()
    assert not any("carry over" in w.value for w in at.warning)


# --- 11 and 15. the batched capture's summary --------------------------------------------------
def test_batched_capture_summary_has_passes_the_union_and_a_replay_hint(batched, capsys):
    from capture.run import summarise
    from catalog.writer import RunWriter
    s = summarise(RunWriter(batched, "tiny-olmoe", "mbpp", "b2"), "tiny-olmoe", "mbpp", "b2", 0,
                  1.0, 0.5)
    trees = pl.read_parquet(batched / "trees" / "**" / "*.parquet")
    per_pass = trees.group_by("batch_pass").agg(pl.col("batch_unique_experts").first()
                                                .list.mean())
    assert s.batch_size == 2 and s.passes == per_pass.height < s.trees
    assert s.pass_unique_experts == pytest.approx(per_pass["batch_unique_experts"].mean())
    assert s.pass_unique_experts >= s.unique_experts  # a union holds each of its trees
    assert s.prompts_with_trees == trees["prompt_index"].n_unique()
    capture_cli.print_summary(s)
    out = capsys.readouterr().out
    assert "verification passes" in out and "unique experts / layer / pass" in out
    assert "--run b2" in out and "--batch-size 2" in out


def test_summary_says_how_many_prompts_have_verification_passes(tmp_path, capsys):
    from capture.run import CaptureSummary
    s = CaptureSummary(tmp_path, "m", "mbpp", "r", 8, 0, 12, 3.0, 30.0, 30.0, 2 ** 20, 1.0,
                       prompts_with_trees=6)
    capture_cli.print_summary(s)
    out = capsys.readouterr().out
    assert "8 (6 with verification passes)" in out
    assert "verification passes " not in out.split("prompts")[0]  # b = 1: no per-pass rows
    assert "unique experts / layer / pass" not in out and "--batch-size" not in out


# --- 14. evaluate names the quality table's folder ---------------------------------------------
def test_evaluate_says_where_it_wrote_the_quality_table(batched, capsys):
    from analysis import evaluate_cli
    assert evaluate_cli.main(["--traces", str(batched), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "quality table written" in out
    folder = (batched / "quality" / "model=tiny-olmoe" / "bench=mbpp" / "run=b2").resolve()
    assert str(folder) in out and any(folder.glob("*.parquet"))
    json.dumps(out)  # one printable block
