"""Experts saved at matched quality vs router, with a bootstrap interval over prompts: the fast
path against a slow loop reference, its properties, and end to end through the real CLIs."""

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.analysis import replay_views
from moe_spec.analysis.replay_views import (
    budget_at,
    budgets_needed,
    experts_saved_frame,
    experts_saved_summary,
    prompt_totals,
    sweep_position,
)

SWEEPS = {"router": [8, 16, 24, 32], "oracle": [8, 16, 24, 32], "sqmass": [8, 16, 32],
          "static": [16, 24]}
QUALITY = {"router": 1.0, "oracle": 0.55, "sqmass": 0.8, "static": 1.3}  # error scale


def synthetic_rows(seed: int = 0) -> pl.DataFrame:
    """Row-level results of two benchmarks: 5 prompts in 2 runs, a varying number of rows per
    prompt (so a mean over rows is not a mean of prompt means), an error falling with B."""
    rng = np.random.default_rng(seed)
    rows = []
    for bench in ("mbpp", "gsm8k"):
        for run, prompt in [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 7)]:
            hard = rng.uniform(0.5, 2.0)  # a prompt's difficulty, shared by every ranking
            for tree in range(int(rng.integers(1, 4))):
                for coverage in ("truncation", "substitution"):
                    for ranking, budgets in SWEEPS.items():
                        for b in budgets:
                            base = hard * QUALITY[ranking] * np.exp(-b / 12)
                            rse = base * rng.uniform(0.7, 1.3)
                            rows.append(dict(model="m", bench=bench, run=run, prompt_index=prompt,
                                             tree=tree, ranking=ranking, coverage=coverage,
                                             budget=b, rse=rse, tau=4.0 - 3 * rse))
    return pl.DataFrame(rows)


def slow_reference(rows: pl.DataFrame, metric: str, higher: bool, resamples: int, seed: int
                   ) -> dict:
    """The rule, one resample at a time: draw prompts, concatenate their rows, take means per
    ranking × coverage × budget, then budget_at / sweep_position per router budget."""
    out = {}
    for (model, bench), data in rows.group_by(["model", "bench"]):
        prompts = data.select("run", "prompt_index").unique().sort("run", "prompt_index").rows()
        draws = np.random.default_rng(seed).integers(0, len(prompts),
                                                     size=(resamples, len(prompts)))
        picks = [list(range(len(prompts)))] + [list(d) for d in draws]
        for k, pick in enumerate(picks):
            sample = pl.concat([data.filter((pl.col("run") == prompts[i][0])
                                            & (pl.col("prompt_index") == prompts[i][1]))
                                for i in pick])
            means = sample.group_by("ranking", "coverage", "budget").agg(pl.col(metric).mean())
            sign = -1.0 if higher else 1.0
            for coverage in ("truncation", "substitution"):
                cov = means.filter(pl.col("coverage") == coverage)
                ref = cov.filter(pl.col("ranking") == "router").sort("budget")
                for ranking in ("oracle", "sqmass", "static"):
                    cur = cov.filter(pl.col("ranking") == ranking).sort("budget")
                    curve = [sign * v for v in cur[metric]]
                    for b, value in zip(ref["budget"], ref[metric]):
                        needed = budget_at(cur["budget"], curve, sign * value)
                        cell = out.setdefault((bench, coverage, ranking, b), {})
                        share = (b - needed) / b
                        if k == 0:
                            cell.update(needed=needed, saved=share, target=value,
                                        sweep=sweep_position(cur["budget"], curve, sign * value))
                        else:
                            cell.setdefault("resampled", []).append(share)
    return out


@pytest.mark.parametrize("metric, higher", [("rse", False), ("tau", True)])
def test_fast_bootstrap_equals_the_slow_loop(metric, higher):
    rows = synthetic_rows()
    fast = experts_saved_frame(prompt_totals(rows, [metric]), {metric: higher}, "open",
                               resamples=25, seed=3)
    slow = slow_reference(rows, metric, higher, resamples=25, seed=3)
    assert fast.height == len(slow) == 2 * 2 * 3 * 4
    sweeps = set()
    for r in fast.iter_rows(named=True):
        ref = slow[(r["bench"], r["coverage"], r["ranking"], r["budget"])]
        assert r["sweep"] == ref["sweep"]
        sweeps.add(r["sweep"])
        np.testing.assert_allclose([r["budget_needed"], r["saved"], r["target"]],
                                   [ref["needed"], ref["saved"], ref["target"]], rtol=1e-9)
        np.testing.assert_allclose(r["resampled"], ref["resampled"], rtol=1e-9)
        finite = np.array(ref["resampled"])[np.isfinite(ref["resampled"])]
        if finite.size:
            np.testing.assert_allclose([r["saved_lo"], r["saved_hi"]],
                                       np.percentile(finite, [2.5, 97.5]), rtol=1e-9)
    assert sweeps == {"inside", "below", "beyond"}  # every branch compared
    # deterministic for a seed, another seed another interval, the same point estimate
    again = experts_saved_frame(prompt_totals(rows, [metric]), {metric: higher}, "open",
                                resamples=25, seed=3)
    assert again.equals(fast)
    other = experts_saved_frame(prompt_totals(rows, [metric]), {metric: higher}, "open",
                                resamples=25, seed=4)
    assert other["saved"].equals(fast["saved"]) and not other["saved_lo"].equals(fast["saved_lo"])


def test_the_oracle_saves_experts_and_a_worse_ranking_does_not():
    summary = experts_saved_summary(experts_saved_frame(
        prompt_totals(synthetic_rows(), ["rse"]), {"rse": False}, "open", resamples=50))
    by = {(r["bench"], r["coverage"], r["ranking"]): r for r in summary.iter_rows(named=True)}
    for bench in ("mbpp", "gsm8k"):
        oracle = by[(bench, "truncation", "oracle")]
        assert oracle["budgets_inside"] >= 2 and 0.1 < oracle["saved"] < 0.9
        assert oracle["saved_lo"] <= oracle["saved"] <= oracle["saved_hi"]
        static = by[(bench, "truncation", "static")]  # worse than router: a negative saving
        assert static["budgets_inside"] == 0 or static["saved"] < 0


def test_budgets_needed_is_budget_at_and_sweep_position():
    rng = np.random.default_rng(1)
    budgets = np.array([32, 8, 24, 16])
    curves = rng.uniform(0, 1, size=(40, 4))
    targets = rng.uniform(-0.1, 1.1, size=(40, 6))
    needed, code = budgets_needed(budgets, curves, targets)
    for i in range(40):
        for j in range(6):
            assert np.isclose(needed[i, j], budget_at(budgets, curves[i], targets[i, j]),
                              equal_nan=True)
            assert replay_views.SWEEP[code[i, j]] == sweep_position(budgets, curves[i],
                                                                    targets[i, j])
    one, where = budgets_needed([16], [[0.3]], [[0.2, 0.3, 0.5]])  # a one-budget sweep
    assert np.isnan(one[0, 0]) and list(one[0, 1:]) == [16, 16]
    assert list(replay_views.SWEEP[where[0]]) == ["beyond", "inside", "below"]


def curve_frame(curves: dict[str, list[float]], budgets: list[int]) -> pl.DataFrame:
    """Totals of one prompt whose means are the given curves."""
    return pl.DataFrame([dict(model="m", bench="b", run="r", prompt_index=0, ranking=name,
                              coverage="truncation", budget=b, rse_sum=v, rse_n=1)
                         for name, values in curves.items() for b, v in zip(budgets, values)])


decreasing = st.lists(st.floats(0.001, 10.0, allow_nan=False), min_size=3, max_size=12,
                      unique=True).map(lambda v: sorted(v, reverse=True))


@settings(max_examples=60, deadline=None)
@given(values=decreasing, start=st.integers(1, 16), step=st.integers(1, 8))
def test_a_ranking_with_router_s_curve_saves_nothing(values, start, step):
    budgets = [start + i * step for i in range(len(values))]
    saved = experts_saved_frame(curve_frame({"router": values, "sqmass": values}, budgets),
                                {"rse": False}, "open", resamples=2)
    assert saved["sweep"].to_list() == ["inside"] * len(values)
    # equal curves: nothing saved, up to the interpolation's rounding (a run found 1.1e-16)
    assert saved["saved"].to_list() == pytest.approx([0.0] * len(values), abs=1e-12)
    assert saved["budget_needed"].to_list() == pytest.approx(budgets, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(values=decreasing, start=st.integers(1, 16), step=st.integers(1, 8), data=st.data())
def test_a_curve_shifted_left_by_s_budgets_saves_s_budgets(values, start, step, data):
    s = data.draw(st.integers(1, (len(values) - 1) // 2))
    n = len(values) - s  # router on n budgets; the oracle reaches router's value s budgets sooner
    budgets = [start + i * step for i in range(n)]
    saved = experts_saved_frame(curve_frame({"router": values[:n], "oracle": values[s:]},
                                            budgets), {"rse": False}, "open", resamples=2)
    for r in saved.iter_rows(named=True):
        i = budgets.index(r["budget"])
        if i >= s:
            assert r["sweep"] == "inside"
            assert r["saved"] == pytest.approx(s * step / r["budget"])
        else:  # router's error there is above the oracle's at its smallest budget: a lower bound
            assert r["sweep"] == "below"
            assert r["saved"] == pytest.approx((r["budget"] - start) / r["budget"])
    summary = experts_saved_summary(saved)
    assert summary["budgets_inside"][0] == n - s
    assert summary["saved"][0] == pytest.approx(np.mean([s * step / b for b in budgets[s:]]))
    # net of its own bytes: e experts a pass subtracted from every inside budget's saving
    e = data.draw(st.floats(0.01, 3.0 * step))
    shown = replay_views.experts_saved_display(saved, {"a shape": {"oracle": e},
                                                       "free": {"oracle": 0.0}})
    assert "net, free" not in shown.columns  # no ranking shown pays anything there
    assert shown["net, a shape"][0] == pytest.approx(
        np.mean([(s * step - e) / b for b in budgets[s:]]))
    assert replay_views.experts_saved_display(saved).columns == [
        c for c in shown.columns if c != "net, a shape"]


# ---- end to end: capture, replay open and closed loop, then the frame, the report, the app ----

CAP = ["--model", "tiny-olmoe", "--max-new-tokens", "10", "--no-progress"]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    from moe_spec.capture import cli as capture_cli
    from moe_spec.replay import cli as replay_cli
    root = tmp_path_factory.mktemp("saved")
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(root)]) == 0
    assert replay_cli.main(["--traces", str(root), "--ranking", "router", "sqmass", "oracle",
                            "--budget", "8,16,24,32,48", "--no-progress"]) == 0
    assert replay_cli.main(["--traces", str(root), "--mode", "closed", "--ranking", "router",
                            "sqmass", "--budget", "16,32,48", "--coverage", "substitution",
                            "--no-progress"]) == 0
    return root


def test_experts_saved_from_real_replays(replayed):
    from moe_spec.analysis.sql import connect
    con = connect(replayed, roles=("evaluation",))
    open_loop = replay_views.experts_saved_open(con)
    assert set(open_loop["ranking"]) == {"oracle", "sqmass"}
    assert set(open_loop["coverage"]) == {"truncation", "substitution"}
    assert set(open_loop["budget"]) == {8, 16, 24, 32, 48} and open_loop["metric"].unique()[0] == "rse"
    # the oracle is a bound: it never needs more experts than router for router's error
    oracle = open_loop.filter(pl.col("ranking") == "oracle")
    assert (oracle["saved"].drop_nans() >= -1e-9).all() and (oracle["sweep"] != "beyond").all()
    assert (oracle["saved"] > 0).any()
    # router's mean RSE at B, recomputed from the view, is the target
    curves = replay_views.error_vs_budget(con)
    router = {(r["coverage"], r["budget"]): r["rse"] for r in
              curves.filter(pl.col("ranking") == "router").iter_rows(named=True)}
    for r in oracle.iter_rows(named=True):
        assert r["target"] == pytest.approx(router[(r["coverage"], r["budget"])])
        assert r["saved_lo"] <= r["saved_hi"]
    closed = replay_views.experts_saved_closed(con)
    assert set(closed["metric"]) == {"tau", "kl"} and set(closed["ranking"]) == {"sqmass"}
    assert set(closed["loop"]) == {"closed"} and closed.height == 2 * 3
    again = replay_views.experts_saved_open(connect(replayed, roles=("evaluation",)))
    for column in ("saved", "saved_lo", "saved_hi"):  # seeded: the same intervals every time
        np.testing.assert_allclose(again[column], open_loop[column], rtol=1e-9)


def test_report_and_replay_page_show_experts_saved(replayed, tmp_path, monkeypatch):
    import sys

    from streamlit.testing.v1 import AppTest

    from moe_spec.analysis import report
    assert report.main(["--traces", str(replayed), "--out", str(tmp_path / "r")]) == 0
    html = (tmp_path / "r" / "tiny-olmoe_mbpp.html").read_text()
    assert "<h2>Experts saved at matched quality vs router</h2>" in html
    table = html.split("Experts saved at matched quality vs router</h2>")[1].split("</table>")[0]
    assert "<td>open</td><td>mean RSE</td><td>truncation</td><td>oracle</td>" in table
    assert "<td>closed</td><td>mean τ</td><td>substitution</td><td>sqmass</td>" in table
    assert "<td>closed</td><td>mean KL</td>" in table and " → " in table

    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(replayed)])
    app = str(Path(__file__).resolve().parent.parent / "app" / "main.py")
    at = AppTest.from_file(app, default_timeout=180)
    at.run()
    at.switch_page("screens/replay.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert any(h.value == "Experts saved at matched quality vs router" for h in at.subheader)
    shown = next(t.value for t in at.table if "matched on" in t.value.columns)
    assert {"mean RSE", "mean τ", "mean KL"} <= set(shown["matched on"])
    assert {"oracle", "sqmass"} == set(shown["ranking"])
