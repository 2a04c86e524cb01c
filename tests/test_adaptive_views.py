"""Adaptive budgets on the analysis side (issue 63): the cost model charges each MoE layer its own
load, and the frames, pages and report draw error and throughput against the mean experts
loaded per layer, one curve per budget mode, never fixed and adaptive averaged together."""

import json
from pathlib import Path

import numpy as np
import pytest

from moe_spec.analysis import cost

# A shape small enough to price by hand, on a device with 1 byte/s and 1 flop/s (time = max of
# bytes and flops): per MoE layer bytes = 14 + 3·n (attention 4, router 8, norms 2; an expert
# 3·1·1), flops at one token and no prefix = 2·4 + 4·1·1 + 2·3·2 = 24; the head: 2 bytes, 2 flops.
TINY = cost.ModelShape(layers=2, hidden=1, expert_inter=1, num_experts=8, top_k=2, heads=1,
                       kv_heads=1, head_dim=1, vocab=1, bytes_per_param=1.0)
UNIT = cost.Hardware("unit", 1.0, 1.0)
REAL = cost.ModelShape(layers=16, hidden=2048, expert_inter=768, num_experts=128, top_k=8,
                       heads=32, kv_heads=4, head_dim=128, vocab=151936, dense_layers=2,
                       dense_inter=6144)


def test_a_constant_allocation_costs_exactly_what_one_budget_does():
    hw = cost.PROFILES["H100-SXM"]
    for tokens, b in ((63, 40.0), (1, 8), (63, 12.5)):
        one = cost.pass_time(REAL, hw, tokens, 512, b)
        assert cost.pass_time(REAL, hw, tokens, 512, [b] * 14) == one  # one load per MoE layer
        assert cost.pass_time(REAL, hw, tokens, 512, np.full(70, b)) == one  # a pooled sample
    extra = REAL.overhead("sketch")
    assert cost.projected_speedup(REAL, hw, 3.0, [40] * 14, 63, 512, 1e-4, overhead=extra) == \
        cost.projected_speedup(REAL, hw, 3.0, 40, 63, 512, 1e-4, overhead=extra)


def test_each_layer_is_charged_its_own_load():
    # loads 1 and 7: layer 1 compute-bound max(17, 24) = 24, layer 2 memory-bound max(35, 24)
    # = 35, head 2: 61 s; memory only 17 + 35 + 2 = 54, compute only 24 + 24 + 2 = 50
    assert cost.pass_time(TINY, UNIT, 1, 0, [1, 7]) == (61.0, 54.0, 50.0)
    # the same mean load everywhere, 4: max(26, 24) twice + 2 = 54 (same bytes, less time:
    # a spread costs more than its mean where a layer falls under the compute floor)
    assert cost.pass_time(TINY, UNIT, 1, 0, 4) == (54.0, 54.0, 50.0)
    assert cost.pass_time(TINY, UNIT, 1, 0, [4, 4]) == (54.0, 54.0, 50.0)
    # a sample of per-layer loads (tree-layers of many passes) stands for the expected pass
    assert cost.pass_time(TINY, UNIT, 1, 0, [1, 7, 7, 1]) == (61.0, 54.0, 50.0)
    assert cost.pass_time(TINY, UNIT, 1, 0, [7, 7, 7, 1]) == (2 * (0.25 * 24 + 0.75 * 35) + 2,
                                                               2 * (0.25 * 17 + 0.75 * 35) + 2,
                                                               50.0)
    # the speedup charges the same: T_AR at top-2 (max(20, 24) · 2 + 2 = 50), no draft time
    assert cost.projected_speedup(TINY, UNIT, 3.0, [1, 7], 1, 0, 0.0) == pytest.approx(
        3.0 * 50 / 61)


def test_loads_must_be_numbers():
    for bad in ([], [float("nan")], [1, float("inf")]):
        with pytest.raises(ValueError, match="experts loaded per layer"):
            cost.pass_time(TINY, UNIT, 1, 0, bad)


# --- frames on result tables with the contract's columns ----------------------------------------
import duckdb  # noqa: E402
import polars as pl  # noqa: E402

from moe_spec.analysis import figures, frames, replay_views  # noqa: E402


def open_rows(mode_column: bool = True) -> pl.DataFrame:
    """Open-loop rows of one dataset, 2 passes × 2 layers: router and oracle at fixed B = 4
    and 8, router adaptive (``adaptive:mass``) at B̄ = 4 loading 2 or 6 experts per tree-layer
    (mean 4) and at B̄ = 8 loading 4 or 12 (mean 8)."""
    rows = []
    for mode, ranking, budget, loads, rse in (
            ("fixed", "router", 4, (4, 4, 4, 4), (0.4, 0.4, 0.2, 0.2)),
            ("fixed", "router", 8, (8, 8, 8, 8), (0.2, 0.2, 0.1, 0.1)),
            ("fixed", "oracle", 4, (4, 4, 4, 4), (0.2, 0.2, 0.1, 0.1)),
            ("fixed", "oracle", 8, (8, 8, 8, 8), (0.1, 0.1, 0.05, 0.05)),
            ("adaptive:mass", "router", 4, (2, 6, 2, 6), (0.3, 0.3, 0.1, 0.1)),
            ("adaptive:mass", "router", 8, (4, 12, 4, 12), (0.1, 0.1, 0.04, 0.04))):
        for i, (n, e) in enumerate(zip(loads, rse)):
            rows.append(dict(model="m", bench="b", run="r", prompt_index=i // 2, step=0,
                             layer=i % 2, ranking=ranking, coverage="truncation",
                             budget=budget, budget_mode=mode, rse=e, token_error=e,
                             mass_excluded=e, experts_loaded=n, surrogate_ranked=False))
    frame = pl.DataFrame(rows)
    return frame if mode_column else frame.filter(pl.col("budget_mode") == "fixed").drop(
        "budget_mode")


def closed_rows() -> pl.DataFrame:
    """Closed-loop rows: router fixed at B = 4 (τ 2.0, 2.0) and adaptive at B̄ = 4 (τ 3.0, 2.0)."""
    rows = []
    for mode, taus, loads in (("fixed", (2, 2), [[4, 4], [4, 4]]),
                              ("adaptive:mass", (3, 2), [[2, 6], [2, 6]])):
        for i, (tau, n) in enumerate(zip(taus, loads)):
            rows.append(dict(model="m", bench="b", run="r", prompt_index=i, step=0,
                             ranking="router", coverage="truncation", budget=4, budget_mode=mode,
                             accepted_length=tau, captured_accepted_length=3,
                             path_unchanged=tau == 3, top1_agreement=1.0, mean_kl=0.1,
                             experts_loaded=n))
    return pl.DataFrame(rows)


def connection(**tables: pl.DataFrame) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    for name, frame in tables.items():
        con.register(f"_{name}", frame.to_arrow())
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}")
    return con


def test_every_mode_is_a_curve_of_its_own_with_its_mean_experts_loaded():
    curves = replay_views.error_vs_budget(connection(replay_open=open_rows()))
    router = curves.filter(pl.col("ranking") == "router").sort("budget_mode", "budget")
    assert router.select("budget_mode", "budget", "experts_loaded").rows() == [
        ("adaptive:mass", 4, 4.0), ("adaptive:mass", 8, 8.0), ("fixed", 4, 4.0),
        ("fixed", 8, 8.0)]
    assert router["rse"].to_list() == pytest.approx([0.2, 0.07, 0.3, 0.15])  # never averaged
    # rows stored before the column existed read as fixed budgets
    old = replay_views.error_vs_budget(connection(replay_open=open_rows(mode_column=False)))
    assert set(old["budget_mode"]) == {"fixed"} and old.height == 4
    # the fixed-budget analyses never see an adaptive row
    gap = replay_views.oracle_gap(curves)
    assert gap["target_rse"].to_list() == pytest.approx([0.3, 0.15])  # router's fixed B = 4, 8
    assert gap.equals(replay_views.oracle_gap(curves.filter(pl.col("budget_mode") == "fixed")))
    closed = replay_views.closed_loop(connection(replay_closed=closed_rows()))
    assert closed.sort("budget_mode").select("budget_mode", "tau", "experts_loaded").rows() == [
        ("adaptive:mass", 2.5, 4.0), ("fixed", 2.0, 4.0)]


def test_experts_saved_compares_fixed_budgets_only():
    con = connection(replay_open=open_rows())
    saved = replay_views.experts_saved(con, resamples=5)
    alone = replay_views.experts_saved(
        connection(replay_open=open_rows().filter(pl.col("budget_mode") == "fixed")), resamples=5)
    assert saved.drop("resampled").equals(alone.drop("resampled"))


STATS = dict(ranking="router", coverage="truncation", num_experts=16, nodes=8, prefix=64,
             unique=12.0, tau=3.0, tau_ci=(2.5, 3.5), tau_source="unbudgeted capture")


def test_the_speedup_against_experts_charges_each_mode_its_own_loads():
    con = connection(replay_open=open_rows(), replay_closed=closed_rows())
    hw = cost.PROFILES["H100-SXM"]
    frame = frames.mode_speedup_frame(con, "m", "b", STATS, REAL, [hw])
    at = {(r["budget_mode"], r["budget"]): r for r in frame.iter_rows(named=True)}
    assert set(at) == {("fixed", 4), ("fixed", 8), ("adaptive:mass", 4), ("adaptive:mass", 8),
                       ("none (B = N)", 16)}
    draft = frames.draft_seconds(REAL.hidden, 4 * REAL.hidden, 32000, 7, hw)
    # loads mapped by share of N (16 → 128: × 8); the adaptive mode pays 16 and 48 experts at
    # alternate layers, not 32 everywhere; τ from the closed loop of the same mode and budget
    fixed, adaptive = at[("fixed", 4)], at[("adaptive:mass", 4)]
    assert fixed["experts_loaded"] == adaptive["experts_loaded"] == 32.0
    assert (adaptive["experts_p10"], adaptive["experts_p90"]) == (16.0, 48.0)
    assert adaptive["tau"] == 2.5 and adaptive["tau_source"] == "closed-loop replay"
    assert adaptive["speedup"] == cost.projected_speedup(REAL, hw, 2.5, [16, 48], 8, 64, draft)
    assert fixed["speedup"] == cost.projected_speedup(REAL, hw, 2.0, 32, 8, 64, draft)
    # without closed loop at B̄ = 8 the unbudgeted τ stands in, and the rows say so
    assert at[("adaptive:mass", 8)]["tau_source"] == "unbudgeted capture"
    assert at[("none (B = N)", 16)]["experts_loaded"] == 96.0
    # a mode replayed closed loop is judged by the path: where closed loop did not replay a
    # budget, its open-loop RSE (0.07 ≤ 0.05? no; 0.15) does not stand in for it
    assert at[("adaptive:mass", 8)]["judged_by"] == "closed"
    assert at[("adaptive:mass", 8)]["within_bound"] is None
    assert at[("fixed", 8)]["within_bound"] is None
    rows = frames.mode_headline_rows(frame)
    # at B = 4 closed loop changed every fixed path and half the adaptive ones: neither holds
    assert {(r["budget mode"], r["fastest within the bound"], r["judged by"]) for r in rows} == {
        ("fixed", "no budget (B = N)", "closed-loop path unchanged ≥ 90%"),
        ("adaptive:mass", "no budget (B = N)", "closed-loop path unchanged ≥ 90%")}
    best = frames.mode_headlines(frame)
    assert set(best["budget_mode"]) == {"fixed", "adaptive:mass"}
    assert best.filter(pl.col("budget_mode") == "fixed")["within_bound"].to_list() == [True]


def test_the_error_figure_draws_a_curve_per_mode_against_experts_loaded():
    curves = replay_views.error_vs_budget(connection(replay_open=open_rows()))
    fig = figures.error_vs_experts(curves, 16)
    lines = {t.name: t for t in fig.data if t.mode == "lines+markers"}
    assert set(lines) == {"router · fixed", "router · adaptive:mass", "fixed-B oracle (bound)"}
    assert list(lines["router · adaptive:mass"].x) == [4.0, 8.0]
    assert lines["router · adaptive:mass"].line.dash != lines["router · fixed"].line.dash
    assert "mean experts loaded per layer" in fig.layout.xaxis.title.text
    closed = figures.closed_loop(replay_views.closed_loop(connection(replay_closed=closed_rows())))
    assert {t.name for t in closed.data if t.mode == "lines+markers"} == {
        "router · fixed", "router · adaptive:mass"}


def test_the_new_figures_say_what_they_draw():
    from figcheck import problems
    con = connection(replay_open=open_rows(), replay_closed=closed_rows())
    curves = replay_views.error_vs_budget(con)
    speed = frames.mode_speedup_frame(con, "m", "b", STATS, REAL, [cost.PROFILES["H100-SXM"]])
    for fig in (figures.error_vs_experts(curves, 16),
                figures.closed_loop(replay_views.closed_loop(con), 16),
                figures.speedup_vs_experts(speed, "t", "note")):
        assert not problems(json.loads(fig.to_json()))
    lines = {t.name for t in figures.speedup_vs_experts(speed, "t").data}
    assert lines == {"fixed", "adaptive:mass", "no budget (B = N)"}


def priced(rows: pl.DataFrame) -> pl.DataFrame:
    """``rows`` with the price column replay writes: λ = 0.01 · B̄ for an adaptive mode's rows
    (one per cell), null for fixed budgets."""
    return rows.with_columns(price=pl.when(pl.col("budget_mode") != "fixed")
                             .then(pl.col("budget") * 0.01).otherwise(None))


def test_the_price_of_every_adaptive_point_is_shown():
    con = connection(replay_open=priced(open_rows()), replay_closed=priced(closed_rows()))
    curves = replay_views.error_vs_budget(con)
    at = {(r["ranking"], r["budget_mode"], r["budget"]): r["price"]
          for r in curves.iter_rows(named=True)}
    assert at[("router", "adaptive:mass", 4)] == pytest.approx(0.04)
    assert at[("router", "adaptive:mass", 8)] == pytest.approx(0.08)
    assert at[("router", "fixed", 4)] is None and at[("oracle", "fixed", 8)] is None
    assert curves.height == 6  # the price splits no curve: one per cell
    # rows stored before prices (no column) read as no price
    assert replay_views.error_vs_budget(connection(replay_open=open_rows()))["price"] \
        .is_null().all()
    # hover: an adaptive point says its B̄ and λ; a fixed one its B and no λ
    fig = figures.error_vs_experts(curves, 16)
    hover = {t.name: t for t in fig.data if t.mode == "lines+markers"}
    adaptive = hover["router · adaptive:mass"]
    assert "B̄ = %{customdata[0]}" in adaptive.hovertemplate
    assert [list(c) for c in adaptive.customdata] == [["4", ", λ 0.04"], ["8", ", λ 0.08"]]
    assert "B = %{customdata[0]}" in hover["router · fixed"].hovertemplate
    assert all(c[1] == "" for c in hover["router · fixed"].customdata)
    closed = figures.closed_loop(replay_views.closed_loop(con), 16)
    line = next(t for t in closed.data if t.name == "router · adaptive:mass" and t.mode)
    assert [c[1] for c in line.customdata] == [", λ 0.04"] and "τ" in line.hovertemplate
    # the speedup frame and its per-mode table carry λ where an adaptive budget is the best
    speed = frames.mode_speedup_frame(con, "m", "b", STATS, REAL, [cost.PROFILES["H100-SXM"]])
    prices = {(r["budget_mode"], r["budget"]): r["price"] for r in speed.iter_rows(named=True)}
    assert prices[("adaptive:mass", 4)] == pytest.approx(0.04)
    assert prices[("fixed", 4)] is None and prices[("none (B = N)", 16)] is None
    trace = next(t for t in figures.speedup_vs_experts(speed, "t").data
                 if t.name == "adaptive:mass")
    assert trace.hovertemplate.startswith("B̄ = ") and "λ 0.04" in trace.customdata[0][5]
    loose = speed.with_columns(within_bound=pl.lit(True))  # every budget within the bound
    rows = {r["budget mode"]: r for r in frames.mode_headline_rows(loose)}
    assert rows["adaptive:mass"]["price λ"] == "0.04"
    assert rows["adaptive:mass"]["fastest within the bound"] == "B̄ = 4"
    assert rows["fixed"]["price λ"] == "—"
    assert rows["fixed"]["fastest within the bound"].startswith("B = ")  # a fixed B has no bar
    keys = list(rows["fixed"])  # what B̄ achieved stands beside it, then λ
    assert keys.index("mean experts per layer (p10–p90)") == keys.index(
        "fastest within the bound") + 1 == keys.index("price λ") - 1


# --- end to end: a folder with fixed and adaptive replays -----------------------------------------
@pytest.fixture(scope="module")
def adaptive_traces(tmp_path_factory):
    """tiny-olmoe, two prompts (``eval``) and a calibration run (``cal``): router open loop at
    fixed B and adaptive B̄ (``mass``), closed loop both at B = 16."""
    from moe_spec.capture import cli as capture_cli
    from moe_spec.replay import cli as replay_cli
    root = tmp_path_factory.mktemp("adaptive") / "traces"
    cap = ["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "2", "--max-new-tokens", "8",
           "--out", str(root), "--no-progress", "--threads", "1"]
    assert capture_cli.main([*cap, "--run", "eval"]) == 0
    assert capture_cli.main([*cap, "--run", "cal", "--offset", "100", "--role",
                             "calibration"]) == 0
    rep = ["--traces", str(root), "--run", "eval", "--ranking", "router", "--coverage",
           "truncation", "--no-progress", "--threads", "1"]
    adaptive = ["--budget-mode", "adaptive", "--calibration", "cal"]
    assert replay_cli.main([*rep, "--budget", "8,16,32"]) == 0
    assert replay_cli.main([*rep, "--budget", "8,16,32", *adaptive]) == 0
    assert replay_cli.main([*rep, "--mode", "closed", "--budget", "16"]) == 0
    assert replay_cli.main([*rep, "--mode", "closed", "--budget", "16", *adaptive]) == 0
    return root


@pytest.mark.slow
def test_pages_and_report_draw_fixed_vs_adaptive(adaptive_traces, monkeypatch, tmp_path):
    import sys

    from streamlit.testing.v1 import AppTest

    from moe_spec.analysis import report
    from moe_spec.app.screens import PAGES
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(adaptive_traces)])
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app" / "main.py"),
                           default_timeout=180)
    at.run()
    titles = {}
    for name in ("replay", "speedup"):
        at.switch_page(f"screens/{name}.py").run()
        assert not at.exception, [e.message for e in at.exception]
        titles[name] = [json.loads(c.proto.spec)["layout"]["title"]["text"]
                        for c in at.get("plotly_chart")]
        assert PAGES[name]
    assert any("vs mean experts loaded per layer" in t for t in titles["replay"])
    assert any("fixed vs adaptive" in t for t in titles["speedup"])
    assert report.main(["--traces", str(adaptive_traces), "--out", str(tmp_path)]) == 0
    page = next(tmp_path.glob("*.html")).read_text()
    assert "Fixed vs adaptive budgets at matched quality" in page
    assert "adaptive:mass" in page and "vs mean experts loaded per layer" in page


@pytest.mark.slow
def test_pages_show_each_adaptive_price_in_tables_that_fit(adaptive_traces, monkeypatch):
    """Issue 59.4 and 63.3: the price λ beside B̄ and what it achieved, on the Replay and Speedup
    pages, and no table wider than the page (a column past its right edge is lost)."""
    import sys

    from helpers import dataframes_cut
    from streamlit.testing.v1 import AppTest

    from moe_spec.analysis import sql
    stored = dict(sql.connect(adaptive_traces).execute(
        "SELECT DISTINCT budget, price FROM replay_open WHERE budget_mode != 'fixed'").fetchall())
    assert len(stored) == 3 and all(p > 0 for p in stored.values())
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(adaptive_traces)])
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app" / "main.py"),
                           default_timeout=180)
    at.run()
    at.switch_page("screens/replay.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert not dataframes_cut(at)
    adaptive = next(d.value for d in at.dataframe if "price λ" in d.value.columns)
    columns = list(adaptive.columns)
    assert columns.index("mean experts loaded") == columns.index("mean budget asked B̄") + 1
    assert {int(b): p for b, p in zip(adaptive["mean budget asked B̄"], adaptive["price λ"])} \
        == pytest.approx(stored)
    closed = next(t.value for t in at.table if "τ (95% CI)" in t.value.columns)
    by_mode = dict(zip(closed["budget mode"], closed["price λ"]))
    assert by_mode["fixed"] == "—" and float(by_mode["adaptive:mass"]) == pytest.approx(
        stored[16], rel=1e-3)
    assert "None" not in closed.to_string()
    at.switch_page("screens/speedup.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert not dataframes_cut(at)
    modes = next(t.value for t in at.table if "budget mode" in t.value.columns)
    assert "price λ" in modes.columns and set(modes["budget mode"]) == {"fixed", "adaptive:mass"}
    hover = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert any("λ" in str(trace.get("customdata")) for fig in hover for trace in fig["data"])


def test_the_quality_frontier_charges_a_budgeted_run_its_loads_per_layer():
    """An online adaptive capture loads 2 and 14 experts at alternate layers: its pass is priced
    layer by layer, not at the mean 8 (the same numbers as cost.pass_time on those loads)."""
    hw = cost.Hardware("compute-poor", 3.35e12, 150e12)  # a 2-expert layer is compute-bound
    trees = pl.DataFrame(dict(
        model=["m"] * 4, bench=["b"] * 4, run=["plain", "plain", "ad", "ad"],
        budget=[None, None, 8, 8], ranking=[None, None, "router", "router"],
        coverage=[None, None, "truncation", "truncation"], accepted_length=[4] * 4,
        experts_loaded=[[12, 12]] * 2 + [[2, 14]] * 2, unique_experts=[[12, 12]] * 4,
        prefix_len=[100] * 4, nodes=[63] * 4))
    q = pl.DataFrame(dict(model=["m"], bench=["b"], run=["ad"], twin_run=["plain"], score=[0.5],
                          twin_score=[0.5], exact_match=[True], metric=["pass@1"]))
    shape = cost.ModelShape(2, 1024, 512, 16, 4, 8, 8, 128, 1000)
    f = frames.frontier_frame(connection(trees=trees, quality=q), "m", "b", shape, hw)
    per_layer = cost.pass_time(shape, hw, 63, 100, [2, 14])[0]
    mean = cost.pass_time(shape, hw, 63, 100, 8)[0]
    twin = cost.pass_time(shape, hw, 63, 100, 12)[0]
    assert per_layer > mean  # the test means something: a spread costs more here
    assert f["speedup_vs_eagle"][0] == pytest.approx(twin / per_layer)


def test_the_comparison_of_runs_reads_fixed_budgets_only():
    from moe_spec.analysis import compare
    rows = open_rows().with_columns(calibration=pl.lit(None, pl.String))
    found = compare.errors(connection(replay_open=rows))
    router = found.filter(pl.col("ranking") == "router").sort("budget")
    assert router["rse"].to_list() == pytest.approx([0.3, 0.15])  # never the adaptive rows


def test_a_curve_drawn_in_the_second_panel_only_is_in_the_legend():
    """Fixed budgets replayed under both policies, adaptive under truncation only (the second
    panel): every curve has one legend entry, wherever it is first drawn."""
    rows = open_rows()
    fixed = rows.filter(pl.col("budget_mode") == "fixed")
    both = pl.concat([fixed.with_columns(coverage=pl.lit("substitution")), rows])
    for fig in (figures.error_vs_experts(replay_views.error_vs_budget(
            connection(replay_open=both)), 16),
                figures.error_vs_budget(replay_views.error_vs_budget(connection(
                    replay_open=both.filter(pl.col("budget_mode") == "fixed"))), 16)):
        listed = [t.name for t in fig.data if t.showlegend is not False and t.name]
        drawn = {t.name for t in fig.data if t.name}
        assert sorted(listed) == sorted(drawn), (listed, drawn)
    assert "router · adaptive:mass" in {t.name for t in figures.error_vs_experts(
        replay_views.error_vs_budget(connection(replay_open=both)), 16).data
        if t.showlegend is not False}
