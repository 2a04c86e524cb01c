"""The dashboard under Streamlit's AppTest: every page, its selectors, no-data and broken data."""

import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.views import PAGES
from capture import cli as capture_cli
from replay import cli as replay_cli

APP = str(Path(__file__).resolve().parent.parent / "app" / "main.py")
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
    at.select_slider(key="speed_b").set_value(16).run()
    assert at.metric[0].label == "projected speedup at B=16 on H200"
    value = at.metric[0].value
    at.select_slider(key="speed_b").set_value(64).run()
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
    at.text_area(key="sql_τ and experts by benchmark").set_value("SELECT nope FROM trees").run()
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
    assert at.warning and "could not be read" in at.warning[0].value


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
