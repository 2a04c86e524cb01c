"""The dashboard under Streamlit's AppTest: every page, its selectors, no-data and broken data;
the pages' registry (adding a page is adding its module, docs/architecture.md)."""

import re
import sys
from pathlib import Path

import pytest
from helpers import dataframes_cut, overlay_env
from streamlit.testing.v1 import AppTest

from moe_spec.app.screens import PAGES
from moe_spec.capture import cli as capture_cli
from moe_spec.replay import cli as replay_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app" / "main.py")
CAP = ["--model", "tiny-olmoe", "--max-new-tokens", "10", "--no-progress"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(root), "--run", "a"]) == 0
    assert replay_cli.main(["--traces", str(root), "--ranking", "router", "oracle", "sqmass",
                            "--budget", "16,32,48", "--no-progress"]) == 0
    assert replay_cli.main(["--traces", str(root), "--mode", "closed", "--ranking", "router",
                            "--budget", "16,64", "--coverage", "substitution",
                            "--no-progress"]) == 0
    return root


def app_on(root, monkeypatch) -> AppTest:
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(root)])
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    return at


NAMES = {title: name for name, (title, _) in PAGES.items()}


def goto(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"screens/{NAMES[page]}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def chart_json(at: AppTest) -> list[str]:
    return [c.proto.spec for c in at.get("plotly_chart")]


@pytest.mark.parametrize("page", list(NAMES))
def test_every_page_renders_without_exception(traces, monkeypatch, page):
    import json

    from figcheck import problems
    at = goto(app_on(traces, monkeypatch), page)
    assert at.get("plotly_chart") or at.dataframe or at.metric, page
    assert any(c.value.startswith("How to read this") for c in at.caption), page
    found = [p for spec in chart_json(at) for p in problems(json.loads(spec))]
    assert not found, found


def test_selectors_change_the_output(traces, monkeypatch):
    at = goto(app_on(traces, monkeypatch), "Co-activation")
    before = chart_json(at)
    at.selectbox(key="coact_layer").set_value(7).run()
    assert chart_json(at) != before
    before = chart_json(at)
    at.selectbox(key="coact_conv").set_value("adjacent").run()
    assert chart_json(at) != before

    at = goto(at, "Coverage curves")
    first = at.dataframe[0].value
    at.slider(key="cov_b").set_value(8).run()
    assert not at.dataframe[0].value.equals(first)

    at = goto(at, "Tree viewer")
    text = [m.value for m in at.markdown]
    at.slider(key="tree_budget").set_value(8).run()
    assert [m.value for m in at.markdown] != text

    at = goto(at, "Speedup projection")
    at.multiselect(key="speed_hw").set_value(["H200"]).run()
    budget = f"speed_b:{at.selectbox(key='speed_target').value}"
    at.select_slider(key=budget).set_value(16).run()
    assert at.metric[0].label == "projected speedup at B=16 of 64 on H200"
    value = at.metric[0].value
    at.select_slider(key=budget).set_value(64).run()
    assert at.metric[0].value != value
    before = chart_json(at)
    at.selectbox(key="speed_target").set_value("Qwen/Qwen3-30B-A3B").run()
    assert chart_json(at) != before  # another target shape, another projection

    at = goto(at, "SQL console")
    first = at.dataframe[0].value
    at.selectbox(key="sql_example").set_value("Accepted path of one tree").run()
    assert list(at.dataframe[0].value.columns) != list(first.columns)

    at = goto(at, "Replay results")
    assert any(h.value == "Where coact's gain comes from" for h in at.subheader)
    assert any("sqmass" in d.value.columns for d in at.dataframe)  # the ablation table
    before = chart_json(at)
    at.multiselect(key="replay_rank").set_value(["router"]).run()
    assert chart_json(at) != before


def test_sql_errors_are_shown_not_raised(traces, monkeypatch):
    at = goto(app_on(traces, monkeypatch), "SQL console")
    at.text_area(key="sql_τ and experts by run").set_value("SELECT nope FROM trees").run()
    assert not at.exception and at.error and "Query failed" in at.error[0].value


def test_no_data_gives_the_capture_command(tmp_path, monkeypatch):
    at = app_on(tmp_path / "empty", monkeypatch)
    assert not at.exception
    assert any("capture --model tiny-olmoe" in m.value for m in at.markdown)


def test_broken_table_is_a_helpful_page(traces, tmp_path, monkeypatch):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(traces, copy)
    part = next((copy / "trees").rglob("*.parquet"))
    part.write_bytes(b"not parquet")
    at = app_on(copy, monkeypatch)
    assert not at.exception
    assert at.warning and "part-000000-0000.parquet" in at.warning[0].value
    assert "commit record" in at.warning[0].value


def test_new_captures_show_up_without_restart(traces, tmp_path, monkeypatch):
    import shutil
    copy = tmp_path / "live"
    shutil.copytree(traces, copy)
    at = app_on(copy, monkeypatch)
    runs = at.metric[0].value
    assert capture_cli.main([*CAP, "--limit", "1", "--offset", "5", "--out", str(copy),
                             "--run", "b"]) == 0
    at.run()
    assert at.metric[0].value != runs


def _values(v):
    """A trace's values as a list (plotly JSON may hold them as base64 typed arrays)."""
    if isinstance(v, dict) and "bdata" in v:
        import base64

        import numpy as np
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"])
        return a.reshape([int(n) for n in str(v.get("shape", len(a))).split(",")]).tolist()
    return list(v)


def _speedup_page(traces, monkeypatch):
    return goto(app_on(traces, monkeypatch), "Speedup projection")


def test_speedup_page_budgets_are_the_targets_and_start_at_the_headline(traces, monkeypatch):
    import plotly.io as pio
    at = _speedup_page(traces, monkeypatch)
    target = at.selectbox(key="speed_target").value
    slider = at.select_slider(key=f"speed_b:{target}")
    head = next(m.value for m in at.markdown if "within the quality bound" in m.value)
    assert "closed-loop path unchanged ≥ 90%" in head
    assert f"at B = {slider.value} of 64" in head  # the slider starts at the headline budget
    assert any("Quality at B = " in c.value and "the bound" in c.value for c in at.caption)
    table = next(t.value for t in at.table  # every budget's speedups, the quality it costs
                 if "quality at this budget" in t.value.columns)
    assert "quality at this budget" in table.columns and "within the bound" in table.columns
    mixtral = next(t for t in at.selectbox(key="speed_target").options if "Mixtral" in t)
    at.selectbox(key="speed_target").set_value(mixtral).run()
    fig = pio.from_json(chart_json(at)[0])
    assert "experts of 8" in fig.layout.xaxis.title.text
    xs = [x for trace in fig.data if trace.mode.startswith("lines") for x in _values(trace.x)]
    assert xs and all(2 <= x <= 8 for x in xs)  # never below Mixtral's top-2
    assert any("mapped by share of N" in (a.text or "") for a in fig.layout.annotations)
    slider = at.select_slider(key=f"speed_b:{mixtral}")
    options = [int(o) for o in slider.options]
    assert min(options) >= 2 and max(options) == 8


def test_unusable_calibration_is_not_offered(traces, monkeypatch):
    from moe_spec.analysis import cost, frames
    flat = cost.Calibration(0.0, 0.0, 0.05, 1.59, 0.0, 80)
    # the page's file runs as a script at every rerun: it imports the patched function
    monkeypatch.setattr(frames, "calibration_frame", lambda *a, **k: (None, flat))
    at = _speedup_page(traces, monkeypatch)
    assert not [r for r in at.radio if r.key == "speed_m"]  # no "calibrated" choice
    why = next(c.value for c in at.caption if "not offered" in c.value)
    assert "R² 0.00 < 0.5" in why and "α and β both fitted to 0" in why


def test_usable_calibration_adds_the_capturing_device(traces, monkeypatch):
    import polars as pl

    from moe_spec.analysis import cost, frames
    good = cost.Calibration(1.5, 0.2, 1e-3, 0.05, 0.95, 80)
    points = pl.DataFrame(dict(measured=[0.01, 0.02], predicted=[0.011, 0.019],
                               experts_loaded=[8.0, 16.0]))
    monkeypatch.setattr(frames, "calibration_frame", lambda *a, **k: (points, good))
    at = _speedup_page(traces, monkeypatch)
    captured = next(t for t in at.selectbox(key="speed_target").options
                    if t.startswith("captured shape"))
    at.selectbox(key="speed_target").set_value(captured).run()
    at.radio(key="speed_m").set_value("calibrated on this capture's timings").run()
    assert not at.exception
    assert any("capturing device (calibrated)" in spec for spec in chart_json(at))


def test_speedup_page_warns_that_tau_comes_from_the_captured_model(traces, monkeypatch):
    at = _speedup_page(traces, monkeypatch)
    target = at.selectbox(key="speed_target")
    assert not target.value.startswith("captured shape")  # a real shape by default
    assert any("carry over" in w.value and "captured model" in w.value for w in at.warning)
    captured = next(o for o in target.options if o.startswith("captured shape"))
    target.set_value(captured).run()
    assert not any("carry over" in w.value for w in at.warning)


def test_speedup_page_projects_every_replayed_ranking_with_intervals(traces, monkeypatch):
    at = _speedup_page(traces, monkeypatch)
    pick = at.selectbox(key="speed_ranking")
    assert pick.value == "router" and {"router", "oracle", "sqmass"} <= set(pick.options)
    router = chart_json(at)[0]
    pick.set_value("oracle").run()
    assert not at.exception and chart_json(at)[0] != router  # the oracle's own quality
    assert not any("no replay" in m.value for m in at.markdown)
    table = next(t.value for t in at.table  # every (budget, hardware): a row each, none cut
                 if "quality at this budget" in t.value.columns)
    assert {"H200", "H100-SXM", "A100-80G"} <= set(table["hardware"])
    assert table["speedup (95% CI)"].str.contains("95% CI|no interval").all()
    frontier = next(t.value for t in at.table if "throughput gain over EAGLE" in t.value.columns)
    assert not dataframes_cut(at)
    assert {"router", "oracle", "sqmass"} <= set(frontier["ranking"])
    assert frontier["throughput gain over EAGLE"].str.contains(r"\(").all()
    assert any("matched quality" in c.value for c in at.caption)


def test_coactivation_masks_the_diagonal_and_defaults_to_lift(traces, monkeypatch):
    import json
    import math
    at = goto(app_on(traces, monkeypatch), "Co-activation")
    heat = json.loads(chart_json(at)[0])["data"][0]
    assert "observed / expected" in heat["colorbar"]["title"]["text"] and heat["zmid"] == 0
    z = _values(heat["z"])
    assert all(z[i][i] is None or math.isnan(z[i][i]) for i in range(len(z)))
    at.radio(key="coact_scale").set_value("observed").run()
    heat = json.loads(chart_json(at)[0])["data"][0]
    assert "diagonal masked" in heat["colorbar"]["title"]["text"]
    z = _values(heat["z"])
    assert all(z[i][i] is None or math.isnan(z[i][i]) for i in range(len(z)))


def test_sql_downloads_work_for_list_columns(traces, monkeypatch):
    at = goto(app_on(traces, monkeypatch), "SQL console")
    at.text_area(key="sql_τ and experts by run").set_value(
        "SELECT * FROM routing LIMIT 5").run()
    assert not at.exception, [e.message for e in at.exception]
    labels = [b.proto.label for b in at.get("download_button")]
    assert labels == ["Download Parquet", "Download JSON", "Download CSV"]
    assert any("JSON text" in c.value for c in at.caption)


def test_batch_regime_page_shows_the_union_growing_with_batch_size(tmp_path, monkeypatch):
    for run, b in (("one", "1"), ("two", "2"), ("four", "4")):
        assert capture_cli.main([*CAP, "--limit", "4", "--out", str(tmp_path), "--run", run,
                                 "--batch-size", b]) == 0
    at = goto(app_on(tmp_path, monkeypatch), "Batch regime")
    table = at.dataframe[0].value
    assert list(table["b"])[0] == 1 and max(table["b"]) >= 3
    experts = dict(zip(table["b"], table["unique experts / layer (measured)"]))
    assert experts[max(experts)] > experts[1]  # the union over more trees loads more experts
    # three batch sizes are too few points for the model's three parameters (issue 42.3)
    assert any("MoESD's pass-time model not fitted: only" in w.value for w in at.warning)
    assert not any("MoESD's pass-time model fitted" in m.value for m in at.markdown)
    assert any("profile-batch --model" in c.value for c in at.caption)  # not measured yet
    from moe_spec.profiling import profile_batch
    assert profile_batch.main(["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "3",
                               "--max-new-tokens", "4", "--batch-sizes", "1,2,3", "--budget",
                               "16", "--out", str(tmp_path), "--no-progress", "--repeats",
                               "2"]) == 0
    at = goto(app_on(tmp_path, monkeypatch), "Batch regime")
    assert any("speedup vs batch size (measured on equal work" in spec
               for spec in chart_json(at))
    assert not dataframes_cut(at)  # the speedups' words wrap: no column cut on the right
    speed = at.table[0].value
    assert sorted(set(speed["b"])) == ["1", "2", "3"] and (speed["budget B"] == "none").sum() == 3
    assert speed["speedup (95% CI)"].str.contains("95% CI|no interval").all()
    assert (speed["equal work"] == "yes").all()
    assert any("replay --batch-size 4" in c.value for c in at.caption)  # not replayed yet
    from moe_spec.replay import cli as replay_cli
    for b in ("1", "2"):
        assert replay_cli.main(["--traces", str(tmp_path), "--run", "one", "--ranking", "router",
                                "oracle", "--budget", "8,16", "--batch-size", b,
                                "--no-progress"]) == 0
    at = goto(app_on(tmp_path, monkeypatch), "Batch regime")
    assert any("shared by a batch's trees" in spec for spec in chart_json(at))
    errors = at.dataframe[1].value
    assert set(errors["b"]) == {1, 2} and set(errors["ranking"]) == {"router", "oracle"}
    by = {(r["b"], r["ranking"], r["B"]): r["mean RSE"] for _, r in errors.iterrows()}
    assert by[(2, "oracle", 8)] <= by[(2, "router", 8)]  # the oracle bounds every ranking


@pytest.mark.parametrize("example", ["τ and experts by run",
                                     "Unique experts per layer (first tree)",
                                     "Accepted path of one tree", "Error vs budget (replay)",
                                     "Replay variants", "Runs and their settings"])
def test_every_sql_example_runs(traces, monkeypatch, example):
    from moe_spec.app.screens.sql_console import EXAMPLES
    assert example in EXAMPLES and len(EXAMPLES) == 6  # a new example: add it to this list
    at = goto(app_on(traces, monkeypatch), "SQL console")
    at.selectbox(key="sql_example").set_value(example).run()
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert at.dataframe[0].value.shape[0] > 0, example


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """gsm8k (alphabetically first) without replay, mbpp with replay, and a calibration run."""
    root = tmp_path_factory.mktemp("mixed")
    for bench, run, extra in (("mbpp", "ev", []), ("gsm8k", "g", []),
                              ("mbpp", "cal", ["--offset", "40", "--role", "calibration",
                                               "--max-new-tokens", "4"])):
        assert capture_cli.main([*CAP, "--limit", "1", "--bench", bench, "--out", str(root),
                                 "--run", run, *extra]) == 0
    assert replay_cli.main(["--traces", str(root), "--bench", "mbpp", "--ranking", "router",
                            "oracle", "--budget", "16,32", "--no-progress"]) == 0
    return root


def test_pages_start_at_a_dataset_with_results(mixed, monkeypatch):
    at = goto(app_on(mixed, monkeypatch), "Replay results")
    assert at.selectbox(key="replay_ds").value == "tiny-olmoe / mbpp"
    assert at.get("plotly_chart")
    at.selectbox(key="replay_ds").set_value("tiny-olmoe / gsm8k").run()
    assert not at.exception
    note = next(i.value for i in at.info if "No replay results" in i.value)
    assert "replay --traces" in note and "--bench gsm8k" in note


def test_overview_and_console_default_to_evaluation_runs(mixed, monkeypatch):
    from moe_spec.analysis.sql import connect
    at = app_on(mixed, monkeypatch)
    tile = next(m for m in at.metric if m.label.startswith("unique experts"))
    assert tile.label == "unique experts / layer / tree (evaluation runs)"
    ev = connect(mixed, roles=("evaluation",)).execute(
        "SELECT run, avg(list_avg(unique_experts)), count(*) FROM trees GROUP BY run").fetchall()
    # two datasets (mbpp, gsm8k) are two settings: the tiles never average them (issue 59),
    # a row each says their numbers; the tree count leaves the calibration run out
    assert tile.value == "—" and len(ev) == 2
    trees = next(m for m in at.metric if m.label.startswith("verification trees"))
    assert trees.label == "verification trees (evaluation runs)"
    assert trees.value == str(sum(n for _, _, n in ev))
    settings = at.dataframe[0].value.set_index("runs")
    for run, unique, _ in ev:
        assert abs(settings.loc[run, "unique_experts"] - unique) < 1e-9
    runs = at.dataframe[1].value
    assert set(runs["role"]) == {"evaluation", "calibration"}
    at = goto(at, "SQL console")
    roles = set(at.dataframe[0].value["role"])
    assert roles == {"evaluation"}
    at.radio(key="sql_roles").set_value("all roles").run()
    assert set(at.dataframe[0].value["role"]) == {"evaluation", "calibration"}


def test_selections_live_in_the_url(traces, monkeypatch):
    at = goto(app_on(traces, monkeypatch), "Co-activation")
    at.selectbox(key="coact_layer").set_value(5).run()
    assert at.query_params["layer"] == ["5"] or at.query_params["layer"] == "5"
    assert "dataset" in at.query_params
    # a deep link: a fresh session with the parameters in its URL starts at them
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(traces)])
    fresh = AppTest.from_file(APP, default_timeout=180)
    fresh.query_params["layer"] = "3"
    fresh.run()
    fresh.switch_page("screens/coactivation.py").run()
    assert fresh.selectbox(key="coact_layer").value == 3


def test_speedup_page_draws_eta_from_profile_target(traces, tmp_path, monkeypatch):
    import shutil

    from moe_spec.profiling import profile_target
    copy = tmp_path / "eta"
    shutil.copytree(traces, copy)
    at = _speedup_page(copy, monkeypatch)
    assert any("profile-target --model tiny-olmoe" in c.value for c in at.caption)
    assert profile_target.main(["--model", "tiny-olmoe", "--batches", "1", "--gammas", "1,4",
                       "--prefix", "8", "--repeats", "1", "--out", str(copy)]) == 0
    at = _speedup_page(copy, monkeypatch)
    assert any("MoESD target efficiency" in spec for spec in chart_json(at))


@pytest.fixture(scope="module")
def two_settings(tmp_path_factory):
    """One dataset captured with two settings (8 and 12 new tokens)."""
    root = tmp_path_factory.mktemp("settings")
    for run, tokens in (("short", "8"), ("long", "12")):
        assert capture_cli.main(["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "2",
                                 "--max-new-tokens", tokens, "--no-progress", "--out",
                                 str(root), "--run", run]) == 0
    return root


def test_pages_draw_one_setting_and_compare_sets_them_side_by_side(two_settings, monkeypatch):
    at = goto(app_on(two_settings, monkeypatch), "Heavy tails")
    picker = at.selectbox(key="tails_setting")
    assert len(picker.options) == 2 and "max_new_tokens" in picker.value
    assert any("2 capture settings" in c.value for c in at.caption)
    at = goto(app_on(two_settings, monkeypatch), "Compare runs")
    assert set(at.multiselect(key="cmp_runs").value) == {"short", "long"}
    diff = at.dataframe[0].value
    assert list(diff["setting"]) == ["max_new_tokens"], diff
    assert at.dataframe[1].value.shape[0] == 2  # key numbers: one row per run


def test_report_writes_one_file_per_setting_and_compares_runs(two_settings, tmp_path):
    import shutil

    from moe_spec.analysis import report
    out = tmp_path / "rep"
    assert report.main(["--traces", str(two_settings), "--out", str(out), "--threads", "1"]) == 0
    first = sorted(p.name for p in out.glob("*.html"))
    # stable names from the dataset and a run of the setting, and an index (issue 59)
    assert first == ["index.html", "tiny-olmoe_mbpp.html", "tiny-olmoe_mbpp_short.html"], first
    index = (out / "index.html").read_text()
    assert "max_new_tokens 12" in index and "tiny-olmoe_mbpp_short.html" in index
    runs_of = {p.name: "runs short" in p.read_text() for p in out.glob("tiny-olmoe_*.html")}
    # another run, of a new setting with the most prompts: no existing report is renamed
    copy = tmp_path / "more"
    shutil.copytree(two_settings, copy)
    assert capture_cli.main(["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "3",
                             "--max-new-tokens", "6", "--no-progress", "--out", str(copy),
                             "--run", "more", "--threads", "1"]) == 0
    assert report.main(["--traces", str(copy), "--out", str(out), "--threads", "1"]) == 0
    after = sorted(p.name for p in out.glob("*.html"))
    assert set(first) < set(after) and "tiny-olmoe_mbpp_more.html" in after, after
    assert {n: "runs short" in (out / n).read_text() for n in runs_of} == runs_of
    assert report.main(["--traces", str(two_settings), "--out", str(out), "--compare", "short",
                        "long", "--threads", "1"]) == 0
    page = (out / "compare_short_vs_long.html").read_text()
    assert "max_new_tokens" in page and "Settings that differ" in page
    assert report.main(["--traces", str(two_settings), "--out", str(out), "--compare", "short",
                        "nope"]) == 2


def test_cached_frames_never_see_a_sessions_connection(traces, tmp_path):
    from helpers import copy_of

    from moe_spec.analysis import summaries
    from moe_spec.app import data
    traces = copy_of(traces, tmp_path)
    summaries.ensure(traces, workers=1)
    root = str(traces)
    version = data.dataset_version(traces)
    hacked = data.connection(root, version, None)  # the first visitor's own connection
    hacked.execute("CREATE OR REPLACE VIEW trees AS SELECT 'tiny-olmoe' AS model, 'HACKED' AS "
                   "bench, 'r' AS run, 'evaluation' AS role, 0 AS prompt_index, 1.0 AS "
                   "accepted_length, [1] AS unique_experts, [1] AS experts_loaded, NULL AS budget")
    hacked.execute("CREATE OR REPLACE VIEW summary_layers AS SELECT 1 AS evil")
    overview = data.overview(root, version)
    assert "HACKED" not in overview["bench"].to_list() and overview["trees"].sum() > 1
    tails = data.frame("tails", root, version, ("evaluation",))
    assert len(tails) and "evil" not in tails.columns


# --- the pages' registry: one module per page, nothing else lists them ---------------------------
HELLO = '''"""A page added by the recipe's test."""
import streamlit as st

from moe_spec.app import views

TITLE = "Hello page"
ORDER = 55


def draw() -> None:
    ds = views.dataset()
    st.header("Hello page")
    st.caption(f"How to read this: {ds.runs.height} runs.")


if __name__ == "__main__":
    draw()
'''


def test_every_module_in_app_screens_is_a_page_and_every_page_a_module():
    modules = {p.stem for p in (ROOT / "app" / "screens").glob("*.py")} - {"__init__"}
    assert set(PAGES) == modules
    titles = [title for title, _ in PAGES.values()]
    assert len(set(titles)) == len(titles), titles
    assert list(PAGES)[0] == "overview"  # the landing page comes first
    for name in modules:  # Streamlit runs the file itself: it must draw its page when run so
        text = (ROOT / "app" / "screens" / f"{name}.py").read_text()
        assert re.search(r'^if __name__ == "__main__":.*\n    draw\(\)$', text, re.M), name


def test_pages_are_found_in_order_and_a_module_that_is_no_page_is_refused(tmp_path, monkeypatch):
    from moe_spec.app.screens import discover
    package = tmp_path / "somescreens"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "zeta.py").write_text(HELLO.replace("ORDER = 55", "ORDER = 1"))
    (package / "alpha.py").write_text(HELLO.replace("Hello page", "Alpha page"))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = discover("somescreens")
    assert [(name, title) for name, (title, _) in found.items()] == [
        ("zeta", "Hello page"), ("alpha", "Alpha page")]  # by ORDER, not by name
    (package / "helpers.py").write_text("def draw():\n    pass\n")
    with pytest.raises(TypeError, match=r"helpers\.py .*no page: it lacks TITLE, ORDER"):
        discover("somescreens")


def test_adding_a_page_is_adding_its_module(traces, tmp_path):
    """The recipe of docs/architecture.md: a copy of app/ with one new file in app/screens/ has
    the page in its navigation, in its ORDER, and draws it (tests/test_browser.py visits every
    registered page at its own URL)."""
    import shutil
    import subprocess
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "app", copy / "app", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "app" / "screens" / "hello_page.py").write_text(HELLO)
    code = f"""
import sys
sys.argv = ["main.py", "--traces", {str(traces)!r}]
from streamlit.testing.v1 import AppTest
from moe_spec import app
assert app.__file__.startswith({str(copy)!r}), app.__file__
at = AppTest.from_file({str(copy / "app" / "main.py")!r}, default_timeout=180)
at.run()
assert not at.exception, [e.message for e in at.exception]
at.switch_page("screens/hello_page.py").run()
assert not at.exception, [e.message for e in at.exception]
from moe_spec.app.screens import PAGES
print(list(PAGES).index("hello_page"), PAGES["hello_page"].title, at.header[0].value,
      at.caption[0].value)
"""
    env = overlay_env(copy)
    done = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == (
        f"{list(PAGES).index('batch_regime') + 1} Hello page Hello page How to read this: 1 runs.")


def test_no_function_of_the_app_is_longer_than_80_lines():
    import ast
    long = [f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in (ROOT / "app").rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """A capture (run cap, replayed) and the same routing exported to SGLang's format and
    imported (routing-only run imp); and a second folder holding the import alone."""
    from moe_spec.capture import export_routing, import_routing
    root = tmp_path_factory.mktemp("imports")
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(root / "both"), "--run",
                             "cap"]) == 0
    source = root / "s.jsonl"
    assert export_routing.main(["--format", "sglang", "--run", "cap", "--traces",
                                str(root / "both"), str(source)]) == 0
    for folder in ("both", "only"):
        assert import_routing.main(["--format", "sglang", str(source), "--model", "tiny-olmoe",
                                    "--bench", "mbpp", "--out", str(root / folder), "--run",
                                    "imp", "--prompt-start", "prompt"]) == 0  # decode rows only
    assert replay_cli.main(["--traces", str(root / "both"), "--ranking", "router", "--budget",
                            "16,32", "--no-progress"]) == 0  # leaves the import alone
    return root


ROUTING_PAGES = ("Heavy tails", "Coverage curves", "Activation growth", "Co-activation")


def test_compare_sets_an_import_beside_the_capture_it_came_from(imports, monkeypatch, tmp_path):
    """Issue 59: the import and its capture, ids-only figures side by side (identical lines:
    the import was exported from the capture), in the app and in report --compare."""
    import json

    from moe_spec.analysis import report
    at = goto(app_on(imports / "both", monkeypatch), "Compare runs")
    assert set(at.multiselect(key="cmp_runs").value) == {"cap", "imp"}
    specs = [json.loads(s) for s in chart_json(at)]
    ids = [s for s in specs if "Ids only" in str(s["layout"]["title"])]
    assert len(ids) == 2 and all({t["name"] for t in s["data"]} == {"run cap", "run imp"}
                                 for s in ids)
    for s in ids:  # the same ids: the same line
        cap, imp = (t for t in s["data"])
        assert cap["y"] == imp["y"]
    out = tmp_path / "rep"
    assert report.main(["--traces", str(imports / "both"), "--out", str(out), "--compare",
                        "cap", "imp", "--threads", "1"]) == 0
    page = (out / "compare_cap_vs_imp.html").read_text()
    assert "Ids only" in page and "routing-only import" in page
TREE_PAGES = ("Replay results", "Speedup projection", "Tree viewer", "Batch regime",
              "Compare runs")


def _pick_import(at: AppTest, page: str) -> AppTest:
    """Pick the imported run's setting on a routing page."""
    key = {"Coverage curves": "cov", "Heavy tails": "tails", "Activation growth": "growth",
           "Co-activation": "coact"}[page] + "_setting"
    picker = at.selectbox(key=key)
    picker.set_value(next(o for o in picker.options if "runs imp" in o)).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


@pytest.mark.parametrize("folder", ["both", "only"])
def test_every_page_renders_with_routing_only_runs(imports, monkeypatch, folder):
    at = app_on(imports / folder, monkeypatch)
    for page in NAMES:
        goto(at, page)
        assert not at.error, (page, [e.value for e in at.error])
    if folder == "only":
        at = app_on(imports / folder, monkeypatch)
        assert any(i.value.startswith("routing-only runs: no trees") for i in at.info)
        assert not any(m.label == "mean τ (evaluation runs)" for m in at.metric)
        for page in TREE_PAGES:
            goto(at, page)
            assert at.info and not at.get("plotly_chart"), page  # the usual no-data note


def test_overview_marks_routing_only_runs(imports, monkeypatch):
    at = app_on(imports / "both", monkeypatch)
    table = at.dataframe[0].value.set_index("run")
    assert table.loc["imp", "kind"] == "routing-only" and table.loc["imp", "source_format"] == \
        "sglang"
    assert table.loc["cap", "kind"] == "capture"
    assert any("routing-only run(s)" in c.value for c in at.caption)


@pytest.mark.parametrize("page", ROUTING_PAGES)
def test_routing_pages_mark_the_imported_run(imports, monkeypatch, page):
    at = goto(app_on(imports / "both", monkeypatch), page)
    assert not any("Routing-only run(s)" in i.value for i in at.info)  # the capture first
    assert not any("routing-only (ids)" in spec for spec in chart_json(at))
    at = _pick_import(at, page)
    assert any("Routing-only run(s) imp, imported from sglang" in i.value for i in at.info)
    assert any("routed-token counts" in c.value and "virtual_batch_size" in c.value
               for c in at.caption)
    assert all("routing-only (ids)" in spec for spec in chart_json(at)
               if "Truncation coverage" not in spec), page
    if page == "Coverage curves":
        assert any("Truncation coverage" in spec for spec in chart_json(at))
        assert any(h.value.startswith("Truncation coverage") for h in at.subheader)


@pytest.mark.parametrize("page", [p for p in TREE_PAGES if p != "Compare runs"])
def test_tree_pages_leave_imported_runs_out(imports, monkeypatch, page):
    at = goto(app_on(imports / "both", monkeypatch), page)
    assert any("left out" in c.value and "imp" in c.value for c in at.caption), page
    for box in [*at.selectbox, *at.multiselect]:
        assert not any("imp" == str(o) or "runs imp" in str(o) for o in box.options), page


def test_speedup_page_names_a_model_location_missing_here(tmp_path, monkeypatch):
    """Traces captured elsewhere (a GPU box, another checkout) name a model folder this machine
    lacks: the page says which and what to do, not only that a config could not be read."""
    import shutil

    from moe_spec.moe import models
    model = tmp_path / "tiny-olmoe"
    shutil.copytree(models.resolve("tiny-olmoe").path, model)
    args = [*CAP, "--limit", "1", "--out", str(tmp_path / "t"), "--run", "a", "--draft",
            str(models.DRAFTS_DIR / "tiny-olmoe")]
    args[args.index("--model") + 1] = str(model)
    assert capture_cli.main(args) == 0
    model.rename(tmp_path / "gone")  # as if the traces had been copied to another machine
    at = _speedup_page(tmp_path / "t", monkeypatch)
    assert not at.exception
    said = [w.value for w in at.warning if "cost model needs" in w.value]
    assert said and str(model) in said[0] and "Put the model there" in said[0], \
        [w.value for w in at.warning]
