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
    assert_frame_equal(got, want, check_exact=False, rtol=1e-9)
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
