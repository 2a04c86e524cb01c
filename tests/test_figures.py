"""analysis.figures: the co-activation heatmap masks never-seen pairs in their own colour, ticks
expert ids readably and leaves never-selected experts out; budget axes tick integers; the batch
figures colour by ranking, dash by b, and explain a saturated MoESD line."""

import numpy as np
import polars as pl
import pytest

from moe_spec.analysis import figures
from moe_spec.analysis.routing import moesd_uniform


# --- co-activation heatmap ------------------------------------------------------------------------
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
    # expert 5, never selected, is left out and named, not a grey band (issue 59): 15 rows
    assert z.shape == (15, 15) and "5" not in list(heat.x)
    assert any("1 of 16 experts never selected" in a.text and "left out:<br>5." in a.text
               for a in fig.layout.annotations)
    assert np.isnan(z[:4, 7:11]).all()  # off the colour scale (ids 8-11 at 7-10 without 5)
    assert (never[:4, 7:11] == 1).all()
    assert np.isfinite(z[0, 1]) and np.isnan(never[0, 1])  # a seen pair: the scale, no mask
    assert np.isnan(np.diag(z)).all() and np.isnan(np.diag(never)).all()
    assert mask.showscale is False and {c for _, c in mask.colorscale} == {figures.NEVER_SEEN}
    legend = {t.name for t in fig.data if t.type == "scatter"}
    assert {"never seen together", "diagonal: an expert with itself"} <= legend
    diagonal = np.array(fig.data[2].z, dtype=float)
    assert (np.diag(diagonal) == 1).all() and np.isnan(diagonal[0, 1])
    assert {c for _, c in fig.data[2].colorscale} == {figures.SELF_PAIR} != {figures.NEVER_SEEN}


@pytest.mark.parametrize("n", [16, 64, 128])
def test_expert_ids_are_readable_ticks_on_both_axes(n):
    m = np.ones((n, n))
    order = np.random.default_rng(1).permutation(n)
    fig = figures.coactivation(m, order, "t")
    cell = (fig.layout.width - 250) / n
    for axis in (fig.layout.xaxis, fig.layout.yaxis):
        # readable labels (issue 59: ~5 px before): at least 10 px, every k-th id where the
        # cells are smaller than a label, labels never overlapping
        step = len(order) // len(axis.tickvals) if len(axis.tickvals) < n else 1
        assert axis.tickmode == "array" and list(axis.tickvals) == [str(i) for i in order][::step]
        assert axis.tickfont.size >= 10 and step * cell >= axis.tickfont.size
    assert fig.layout.width - 250 >= 7 * n - 1  # at least 7 px an expert


# --- batch regime ---------------------------------------------------------------------------------
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


# --- integer axes (issue 59) ----------------------------------------------------------------------
def test_one_budget_gets_an_integer_tick_and_no_axis_down_to_the_noise_floor():
    """After the design card's commands the Replay page drew one oracle point with x ticks at
    23.5 and a log axis down to 1e-9 (the floor line): a budget axis is ticked at integers, and
    the floor is drawn only where a value is near it."""
    one = pl.DataFrame(dict(ranking=["oracle"], coverage=["truncation"], budget=[24],
                            rse=[0.02], rse_lo=[0.015], rse_hi=[0.025]))
    fig = figures.error_vs_budget(one, 64)
    assert list(fig.layout.xaxis.tickvals) == [24]
    assert not [s for s in fig.layout.shapes if s.y0 == figures.NOISE_FLOOR]
    many = pl.DataFrame(dict(ranking=["r"] * 20, coverage=["truncation"] * 20,
                             budget=list(range(1, 21)), rse=[1e-10] * 20))
    fig = figures.error_vs_budget(many, 64)
    assert fig.layout.xaxis.tickformat == "d"
    assert [s for s in fig.layout.shapes if s.y0 == figures.NOISE_FLOOR]


def test_compare_keeps_a_colour_per_run_and_names_the_runs_it_leaves_out():
    """Issue 59: a run keeps its colour in every figure of a comparison (its place among the
    runs compared), and a figure without a line for a run says so."""
    from moe_spec.analysis import compare
    only_b = pl.DataFrame(dict(run=["b", "b"], budget=[8, 16], rse=[0.1, 0.05]))
    fig = compare.lines(only_b, "budget", "rse", "t", "x", "y", runs=["a", "b"], why="no replay")
    assert [t.line.color for t in fig.data] == [figures.COLORS[1]]
    assert any("run a (no replay)" in a.text for a in fig.layout.annotations)
    assert list(fig.layout.xaxis.tickvals) == [8, 16]  # integer budgets
