"""A curve is one experiment (issue 59): the default result views, the analysis frames, the
experts-saved table and the report draw one whole variant per curve (run, ranking, coverage,
batch size), never a budget or a layer from another variant. The two repros of the issue, small:
a second calibration replayed at two budgets (one new), and a third one at two layers only."""

import shutil

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from moe_spec.analysis import frames, report
from moe_spec.analysis.sql import connect
from moe_spec.capture import cli as capture_cli
from moe_spec.replay import cli as replay_cli

CAP = ["--model", "tiny-olmoe", "--max-new-tokens", "8", "--no-progress", "--threads", "1"]


def capture(traces, bench, run, *extra):
    assert capture_cli.main([*CAP, "--bench", bench, "--limit", "2", "--out", str(traces),
                             "--run", run, *extra]) == 0


def replay(traces, *args):
    assert replay_cli.main(["--traces", str(traces), "--no-progress", "--threads", "1",
                            "--run", "ev", *args]) == 0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the busy folder after both repros, a copy taken before them: one variant per curve)."""
    base = tmp_path_factory.mktemp("curves")
    busy = base / "busy"
    capture(busy, "mbpp", "ev")
    capture(busy, "mbpp", "cal", "--offset", "100", "--role", "calibration")
    capture(busy, "gsm8k", "cal-gsm8k", "--role", "calibration")
    capture(busy, "mbpp", "cal16", "--offset", "200", "--role", "calibration")
    replay(busy, "--ranking", "router", "oracle", "coact", "--calibration", "cal",
           "--budget", "8,16,24")
    single = base / "single"
    shutil.copytree(busy, single)
    # repro 1: another calibration at B = 16 (also in the sweep) and 32 (not in it)
    replay(busy, "--ranking", "coact", "--calibration", "cal-gsm8k", "--budget", "16,32")
    # repro 2: a third calibration at two layers only
    replay(busy, "--ranking", "coact", "--calibration", "cal16", "--layers", "0,1",
           "--budget", "16")
    return busy, single


def con(traces, **kw):
    return connect(traces, roles=("evaluation",), **kw)


def test_the_default_view_draws_one_variant_per_curve(folders):
    busy, _ = folders
    per_curve = con(busy).sql("""SELECT ranking, coverage, count(DISTINCT config) AS n,
                                 count(DISTINCT calibration) AS cal FROM replay_open
                                 GROUP BY ALL""").pl()
    assert per_curve["n"].to_list() == [1] * per_curve.height, per_curve
    coact = con(busy).sql("SELECT DISTINCT calibration, budget FROM replay_open WHERE ranking = "
                          "'coact' ORDER BY ALL").pl()
    assert coact.rows() == [("cal", 8), ("cal", 16), ("cal", 24)]  # B = 32 is a gap
    every = con(busy).sql("SELECT DISTINCT calibration FROM replay_open_all WHERE ranking = "
                          "'coact' ORDER BY 1").pl()
    assert every["calibration"].to_list() == ["cal", "cal-gsm8k", "cal16"]


@pytest.mark.parametrize("name", ["errors", "saved_open"])
def test_frames_and_the_report_tables_are_the_single_variant_ones(folders, name):
    busy, single = folders
    got, want = (frames.ANALYSES[name](con(f)) for f in (busy, single))
    assert_frame_equal(got, want, check_exact=False, rel_tol=1e-9)
    fb, fs = ({name: frames.ANALYSES[name](con(f))} for f in (busy, single))
    if name == "saved_open":
        assert report.experts_saved_table(fb, "tiny-olmoe", "mbpp") == \
            report.experts_saved_table(fs, "tiny-olmoe", "mbpp")


def test_the_variants_view_says_which_variant_each_curve_shows(folders):
    busy, _ = folders
    v = con(busy).sql("SELECT calibration, shown_by_default, curve_variants FROM variants "
                      "WHERE ranking = 'coact' AND coverage = 'truncation' ORDER BY calibration").pl()
    assert v.rows() == [("cal", True, 3), ("cal-gsm8k", False, 3), ("cal16", False, 3)]


def test_a_chosen_variant_wins_its_curve_whole(folders):
    busy, _ = folders
    picked = con(busy, variants=("cal-gsm8k",)).sql(
        "SELECT DISTINCT calibration, budget FROM replay_open WHERE ranking = 'coact' "
        "ORDER BY ALL").pl()
    assert picked.rows() == [("cal-gsm8k", 16), ("cal-gsm8k", 32)]
    errors = frames.ANALYSES["errors"](con(busy, variants=("cal16",)))
    coact = errors.filter(pl.col("ranking") == "coact")
    assert coact["budget"].to_list() == [16] * coact.height and coact.height
    # the other rankings keep their own (only) variant
    assert set(errors["ranking"]) == {"router", "oracle", "coact"}


# --- the pages (Streamlit's AppTest, as tests/test_app.py drives them) ----------------------------
@pytest.fixture(scope="module")
def pages(folders, tmp_path_factory):
    """The busy folder and, as after the design card's commands, another evaluation run of
    another setting with more prompts and one replayed cell (the oracle at B = 24)."""
    root = tmp_path_factory.mktemp("pages") / "t"
    shutil.copytree(folders[0], root)
    assert capture_cli.main([*CAP, "--bench", "mbpp", "--limit", "3", "--out", str(root),
                             "--run", "more", "--max-new-tokens", "6"]) == 0
    assert replay_cli.main(["--traces", str(root), "--no-progress", "--threads", "1", "--run",
                            "more", "--ranking", "oracle", "--budget", "24"]) == 0
    return root


def replay_page(root, monkeypatch):
    import sys
    from pathlib import Path

    from streamlit.testing.v1 import AppTest
    app = str(Path(__file__).resolve().parent.parent / "app" / "main.py")
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(root)])
    at = AppTest.from_file(app, default_timeout=180)
    at.run()
    at.switch_page("screens/replay.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def coact_budgets(at) -> list:
    """The budgets of the coact lines of the error figure, per coverage panel."""
    import base64
    import json

    import numpy as np

    def values(v):  # plotly writes arrays as typed binary ({"dtype", "bdata"})
        if isinstance(v, dict):
            return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
        return list(v)

    for chart in at.get("plotly_chart"):
        spec = json.loads(chart.proto.spec)
        if "Reconstruction error" in str(spec["layout"].get("title")):
            return [[int(x) for x in values(t["x"])] for t in spec["data"]
                    if t.get("name") == "coact"]
    return []


def test_the_replay_page_opens_on_results_draws_one_variant_and_offers_the_others(
        pages, monkeypatch):
    at = replay_page(pages, monkeypatch)
    # the setting with results, not the one with most prompts (one oracle point)
    assert "runs ev" in at.selectbox(key="replay_setting").value
    assert coact_budgets(at) == [[8, 16, 24]] * 2  # both coverages: the cal sweep, whole
    picker = at.multiselect(key="replay_variant")
    gsm = [o for o in picker.options if "calibrated on cal-gsm8k" in o]  # labels, "… [hash]"
    assert len(gsm) == 2 and picker.value == []  # one per coverage; none picked: the rule's
    assert any("more than one stored variant" in c.value for c in at.caption)
    picker.set_value([o.rsplit("[", 1)[1].rstrip("]") for o in gsm]).run()
    assert not at.exception, [e.message for e in at.exception]
    assert coact_budgets(at) == [[16, 32], [16, 32]]  # both coverages: that variant, whole


def test_a_ranking_selection_of_another_setting_is_dropped(pages, monkeypatch):
    at = replay_page(pages, monkeypatch)
    at.multiselect(key="replay_rank").set_value(["coact"]).run()
    other = next(o for o in at.selectbox(key="replay_setting").options if "runs more" in o)
    at.selectbox(key="replay_setting").set_value(other).run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.multiselect(key="replay_rank").value == ["oracle"]  # its options, all of them


def test_the_report_notes_the_variants_and_draws_the_one_picked(folders, tmp_path, capsys):
    from helpers import one_line
    busy, _ = folders
    out = tmp_path / "rep"
    assert report.main(["--traces", str(busy), "--out", str(out), "--threads", "1"]) == 0
    page = (out / "tiny-olmoe_mbpp.html").read_text()
    assert "Replay variants" in page and "Drawn: coact, substitution: calibrated on cal," in page
    assert report.main(["--traces", str(busy), "--out", str(out), "--threads", "1",
                        "--variant", "cal-gsm8k"]) == 0
    page = (out / "tiny-olmoe_mbpp.html").read_text()
    assert "Drawn: coact, substitution: calibrated on cal-gsm8k," in page
    capsys.readouterr()
    one_line(capsys, report.main(["--traces", str(busy), "--out", str(out), "--variant",
                                  "nope"]), "--variant nope names no stored replay variant")


def test_the_speedup_projection_reads_one_variant_per_ranking(folders, tmp_path):
    """The projection's measured quality is one whole variant of the ranking: the default
    rule's (the cal sweep, B = 8, 16, 24) or the one picked (cal-gsm8k: B = 16, 32), never
    budgets of both."""
    from moe_spec.analysis import summaries
    busy = tmp_path / "t"
    shutil.copytree(folders[0], busy)
    summaries.ensure(busy, workers=1)  # the routing summaries the projection reads
    default = frames.routing_statistics(con(busy), "tiny-olmoe", "mbpp", ranking="coact",
                                        coverage="substitution")
    picked = frames.routing_statistics(con(busy, variants=("cal-gsm8k",)), "tiny-olmoe", "mbpp",
                                       ranking="coact", coverage="substitution")
    assert sorted(default["quality"]) == [8, 16, 24]
    assert sorted(picked["quality"]) == [16, 32]


def test_the_speedup_page_offers_the_variants(pages, monkeypatch):
    at = replay_page(pages, monkeypatch)
    at.switch_page("screens/speedup.py").run()
    assert not at.exception, [e.message for e in at.exception]
    setting = at.selectbox(key="speed_setting")
    setting.set_value(next(o for o in setting.options if "runs ev" in o)).run()
    assert not at.exception, [e.message for e in at.exception]
    picker = at.multiselect(key="speed_variant")
    assert any("calibrated on cal-gsm8k" in o for o in picker.options)
    assert any("more than one stored variant" in c.value for c in at.caption)
