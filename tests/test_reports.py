"""report and profile-target through their real entry points."""

import polars as pl
import pytest

from moe_spec.analysis import report
from moe_spec.capture import cli as capture_cli
from moe_spec.profiling import profile_target
from moe_spec.replay import cli as replay_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out


def test_report_writes_one_self_contained_html_per_dataset(tmp_path):
    traces = tmp_path / "traces"
    for bench in ("mbpp", "gsm8k"):
        assert capture_cli.main(["--bench", bench, "--limit", "2", "--max-new-tokens", "16",
                                 "--out", str(traces), "--no-progress"]) == 0
    assert replay_cli.main(["--traces", str(traces), "--bench", "mbpp", "--ranking", "router",
                            "oracle", "--budget", "16,32", "--no-progress"]) == 0
    assert profile_target.main(["--model", "tiny-olmoe", "--batches", "1", "--gammas", "1,4,16",
                       "--prefix", "8", "--repeats", "1", "--out", str(traces)]) == 0
    assert report.main(["--traces", str(traces), "--out", str(tmp_path / "r")]) == 0
    files = sorted(p.name for p in (tmp_path / "r").iterdir() if not p.name.startswith("."))
    assert files == ["index.html", "tiny-olmoe_gsm8k.html", "tiny-olmoe_mbpp.html"]  # (issue 59)
    html = (tmp_path / "r" / "tiny-olmoe_mbpp.html").read_text()
    assert html.count('class="plotly-graph-div"') >= 11  # routing, replay, cost, eta figures
    assert "plotly.js" in html or "Plotly" in html[:200000]  # the library is inlined once
    for title in ("Oracle gap", "Projected speedup", "MoESD target efficiency",
                  "Co-activation, layer 0", "Expert activation growth"):
        assert title in html, title
    # a calibration is drawn only when usable; else it is reported, with why, in words
    assert "Cost model calibrated" in html or "Cost-model calibration</b>: not usable (" in html \
        or "Cost-model calibration</b>: not fitted: only" in html  # too few passes (42.3)
    # open-loop replay only: the headline says so and states its RSE bound
    assert "within the quality bound: open-loop RSE ≤ 0.05 (no closed-loop replay" in html
    assert "Projected speedup and quality" in html and "budgets below top-8 not shown" in html
    assert "experts of 8, top-2" in html  # Mixtral's own budget axis
    other = (tmp_path / "r" / "tiny-olmoe_gsm8k.html").read_text()
    assert "no replay at all of this dataset, so only B = N (no budget) is measured" in other
    assert report.main(["--traces", str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2


def test_a_report_of_unchanged_traces_is_not_rewritten(tmp_path, capsys):
    traces, out = tmp_path / "traces", tmp_path / "r"
    assert capture_cli.main(["--limit", "1", "--max-new-tokens", "8", "--out", str(traces),
                             "--no-progress"]) == 0
    assert report.main(["--traces", str(traces), "--out", str(out)]) == 0
    page = out / "tiny-olmoe_mbpp.html"
    written = page.stat().st_mtime_ns
    capsys.readouterr()
    assert report.main(["--traces", str(traces), "--out", str(out)]) == 0
    assert "unchanged" in capsys.readouterr().out and page.stat().st_mtime_ns == written
    assert report.main(["--traces", str(traces), "--out", str(out), "--force"]) == 0
    assert page.stat().st_mtime_ns != written
    forced, before = page.stat().st_mtime_ns, page.read_text()
    assert replay_cli.main(["--traces", str(traces), "--ranking", "router", "--budget", "16",
                            "--no-progress"]) == 0  # new results: the report is stale
    assert report.main(["--traces", str(traces), "--out", str(out)]) == 0
    assert page.stat().st_mtime_ns != forced and page.read_text() != before


def test_profile_target_stores_points_and_fits(tmp_path, capsys):
    assert profile_target.main(["--model", "tiny-mixtral", "--batches", "1,2", "--gammas", "1,4",
                       "--prefix", "8", "--repeats", "1", "--out", str(tmp_path)]) == 0
    points = pl.read_parquet(tmp_path / "profile" / "model=tiny-mixtral" / "device=cpu" /
                             "part-0.parquet")
    assert points.height == 4 and (points["seconds"] > 0).all()
    out = capsys.readouterr().out  # 4 points for 3 parameters: refused in words, not fitted
    assert "fit: not fitted" in out and "nan" not in out.split("fit:")[1]
    assert profile_target.main(["--model", "tiny-mixtral", "--batches", "1,2,3", "--gammas", "1,4",
                       "--prefix", "8", "--repeats", "1", "--out", str(tmp_path)]) == 0
    assert "fit: T =" in capsys.readouterr().out  # 6 points: fitted


def test_every_report_figure_has_a_title_and_axis_titles(tmp_path, monkeypatch):
    import json

    from figcheck import problems
    traces = tmp_path / "traces"
    assert capture_cli.main(["--limit", "2", "--max-new-tokens", "12", "--out", str(traces),
                             "--no-progress"]) == 0
    assert capture_cli.main(["--limit", "1", "--offset", "50", "--max-new-tokens", "8", "--out",
                             str(traces), "--no-progress", "--run", "cal", "--role",
                             "calibration"]) == 0
    assert replay_cli.main(["--traces", str(traces), "--ranking", "router", "oracle", "sqmass",
                            "--budget", "16,32", "--no-progress"]) == 0
    assert replay_cli.main(["--traces", str(traces), "--mode", "closed", "--ranking", "router",
                            "--budget", "16,64", "--coverage", "substitution",
                            "--no-progress"]) == 0
    seen = []
    to_html = report.pio.to_html
    monkeypatch.setattr(report.pio, "to_html", lambda f, **kw: seen.append(f) or to_html(f, **kw))
    assert report.main(["--traces", str(traces), "--out", str(tmp_path / "r")]) == 0
    assert len(seen) >= 10
    found = [p for f in seen for p in problems(json.loads(f.to_json()))]
    assert not found, found
    html = next((tmp_path / "r").glob("*.html")).read_text()
    assert "Where coact's gain comes from" in html and "<th>sqmass</th>" in html
    # the headline is the best speedup at a stated closed-loop bound, with its quality
    assert "within the quality bound: closed-loop path unchanged ≥ 90%</th><td>" in html
    head = html.split("closed-loop path unchanged ≥ 90%</th><td>")[1].split("</td>")[0]
    assert "(no budget)" in head or "path unchanged 9" in head or "path unchanged 100%" in head
    assert "lift: observed \\u002f expected" in html  # co-activation: lift, diagonal masked
    # every budget or expert-count axis says of how many experts (N)
    titles = [a.title.text for f in seen for a in (f.layout.xaxis, f.layout.yaxis)
              if a.title.text]
    counted = [t for t in titles if t.startswith("budget B") or "experts needed" in t
               or t.startswith("unique experts")]
    assert counted and all("of " in t for t in counted), [t for t in counted if "of " not in t]
    # the Runs table: labelled columns, readable dtypes, calibration runs listed with their role
    runs = html.split("<h2>Runs</h2>")[1].split("</table>")[0]
    assert "<th>temperature</th>" in runs and "<th>T</th>" not in runs
    assert "torch." not in runs and "float32" in runs
    assert "<td>cal</td><td>calibration</td>" in runs and "<td>evaluation</td>" in runs
