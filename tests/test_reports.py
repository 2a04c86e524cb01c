"""report and profile-target through their real entry points."""

import polars as pl

from analysis import moesd, report
from capture import cli as capture_cli
from replay import cli as replay_cli


def test_report_writes_one_self_contained_html_per_dataset(tmp_path):
    traces = tmp_path / "traces"
    for bench in ("mbpp", "gsm8k"):
        assert capture_cli.main(["--bench", bench, "--limit", "2", "--max-new-tokens", "16",
                                 "--out", str(traces), "--no-progress"]) == 0
    assert replay_cli.main(["--traces", str(traces), "--bench", "mbpp", "--ranking", "router",
                            "oracle", "--budget", "16,32", "--no-progress"]) == 0
    assert moesd.main(["--model", "tiny-olmoe", "--batches", "1", "--gammas", "1,4,16",
                       "--prefix", "8", "--repeats", "1", "--out", str(traces)]) == 0
    assert report.main(["--traces", str(traces), "--out", str(tmp_path / "r")]) == 0
    files = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert files == ["tiny-olmoe_gsm8k.html", "tiny-olmoe_mbpp.html"]
    html = (tmp_path / "r" / "tiny-olmoe_mbpp.html").read_text()
    assert html.count('class="plotly-graph-div"') >= 11  # routing, replay, cost, eta figures
    assert "plotly.js" in html or "Plotly" in html[:200000]  # the library is inlined once
    for title in ("Oracle gap", "Projected speedup", "Cost model calibrated", "MoESD target "
                  "efficiency", "Co-activation, layer 0", "Expert activation growth"):
        assert title in html, title
    assert report.main(["--traces", str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2


def test_profile_target_stores_points_and_fits(tmp_path, capsys):
    assert moesd.main(["--model", "tiny-mixtral", "--batches", "1,2", "--gammas", "1,4",
                       "--prefix", "8", "--repeats", "1", "--out", str(tmp_path)]) == 0
    points = pl.read_parquet(tmp_path / "profile" / "model=tiny-mixtral" / "device=cpu" /
                             "part-0.parquet")
    assert points.height == 4 and (points["seconds"] > 0).all()
    assert "fit: T =" in capsys.readouterr().out


def test_every_report_figure_has_a_title_and_axis_titles(tmp_path, monkeypatch):
    import json

    from figcheck import problems
    traces = tmp_path / "traces"
    assert capture_cli.main(["--limit", "2", "--max-new-tokens", "12", "--out", str(traces),
                             "--no-progress"]) == 0
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
