"""Every documented query (README, docs/usage.md, the SQL console's examples) answers from one
variant per cell (issue 38): after a demo-like flow and the design card's commands, the rows of
the demo's run equal those of a folder that holds that run and its results alone."""

import re
import shutil
from pathlib import Path

import polars as pl
import pytest
from helpers import call
from polars.testing import assert_frame_equal

from moe_spec.capture import cli as capture_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

ROOT = Path(__file__).resolve().parent.parent
CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "8", "--no-progress",
       "--threads", "1"]


def documented_queries() -> list[str]:
    """The SQL of every ``query "…"`` command and ```sql block in README.md and docs/usage.md,
    and the console's examples."""
    found = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "usage.md"):
        text = doc.read_text()
        for m in re.finditer(r'query (?:--[a-z-]+ \S+ )*"((?:SELECT|WITH)[^"]*)"', text):
            found.append(" ".join(m.group(1).split()))
        for block in re.findall(r"```sql\n(.*?)```", text, re.S):
            body = "\n".join(line for line in block.splitlines()
                             if not line.strip().startswith("--"))
            found += [" ".join(q.split()) for q in body.split(";") if q.strip()]
    from moe_spec.app.screens.sql_console import EXAMPLES
    found += list(EXAMPLES.values())
    return sorted(set(found))


def test_the_docs_have_queries_to_check():
    queries = documented_queries()
    assert len(queries) >= 10 and any("replay_open" in q for q in queries)


def replay(traces, *args):
    r = call("moe_spec.replay.cli", "--traces", traces, "--no-progress", "--threads", "1", *args)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(a folder after a small demo and the design card's commands, a copy taken before the
    design card's commands: one run, one variant per cell)."""
    base = tmp_path_factory.mktemp("documented")
    traces = base / "a"
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(traces), "--run", "ev"]) == 0
    assert capture_cli.main([*CAP, "--offset", "100", "--limit", "3", "--out", str(traces),
                             "--run", "cal", "--role", "calibration"]) == 0
    replay(traces, "--run", "ev", "--calibration", "cal", "--ranking", "router", "oracle",
           "coact", "--budget", "8,16,24")
    replay(traces, "--run", "ev", "--calibration", "cal", "--ranking", "router", "coact",
           "--budget", "16", "--batch-size", "2")
    replay(traces, "--run", "ev", "--mode", "closed", "--ranking", "router", "--budget", "16",
           "--batch-size", "2")
    single = base / "b"
    shutil.copytree(traces, single)
    # the design card's commands, then an uncalibrated oracle beside the calibrated one
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(traces)]) == 0
    r = replay(traces, "--ranking", "oracle", "--budget", "24")
    assert "run ev: answered from the stored variant" in r.stderr, r.stderr
    r = replay(traces, "--run", "ev", "--ranking", "oracle", "--budget", "8,12")
    assert "adds a variant without calibration" in r.stderr, r.stderr
    return traces, single


def answer(traces, sql) -> pl.DataFrame:
    from moe_spec.analysis.sql import connect, run_query
    return pl.from_arrow(run_query(connect(traces, roles=("evaluation",)), sql))


@pytest.mark.parametrize("sql", documented_queries())
def test_a_documented_query_gives_one_variant_per_cell(folders, sql):
    busy, single = folders
    got, want = answer(busy, sql), answer(single, sql)
    if "LIMIT" in sql.upper() or "FROM variants" in sql:  # samples and listings: they run
        assert got.columns == want.columns
        return
    if "run" in got.columns:
        got = got.filter(pl.col("run") == "ev")
        want = want.filter(pl.col("run") == "ev")
    if "budget" in got.columns:  # B = 12 exists only in the busy folder (a new cell)
        got = got.filter(pl.col("budget") != 12)
    assert got.height, (sql, got)
    # the same rows; sums may differ in the last bits where DuckDB adds them in another order
    assert_frame_equal(got, want, check_exact=False, rel_tol=1e-9)


def test_the_oracle_rows_of_the_busy_folder_name_their_variants(folders):
    busy, _ = folders
    every = answer(busy, "SELECT DISTINCT budget, calibration FROM replay_open_all WHERE run = "
                         "'ev' AND ranking = 'oracle' ORDER BY ALL")
    assert (8, None) in every.rows() and (8, "cal") in every.rows()
    shown = answer(busy, "SELECT DISTINCT budget, calibration FROM replay_open WHERE run = 'ev' "
                         "AND ranking = 'oracle' ORDER BY ALL")
    # one whole variant per curve (issue 59): the calibrated sweep; B = 12, held only by the
    # uncalibrated variant, is a gap, never that variant's point
    assert shown.rows() == [(8, "cal"), (16, "cal"), (24, "cal")]
