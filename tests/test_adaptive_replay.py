"""Adaptive budgets in the product (issue 63): the ``budget_mode`` key column, the price λ
calibrated in the one calibration step, open- and closed-loop replay and capture's online budget
through :class:`policy.budget.Budget`."""

import json

import pyarrow.parquet as pq
import pytest
from helpers import QUERY, call, copy_of

from moe_spec.analysis import sql
from moe_spec.catalog import Catalog
from moe_spec.catalog.results import UnitResults
from moe_spec.policy import index
from moe_spec.replay import plan


# --- 1. the key column ---------------------------------------------------------------------------
def test_budget_mode_names_round_trip_and_unknown_ones_are_refused():
    assert index.budget_mode() == "fixed" and index.budget_mode_parts(None) == (None, False)
    assert index.budget_mode("mass") == "adaptive:mass"
    assert index.budget_mode_parts("adaptive:mass+cap") == ("mass", True)
    with pytest.raises(ValueError, match="unknown budget mode"):
        index.budget_mode_parts("adaptive:nothing")


def test_fixed_keys_stay_as_they_were_and_adaptive_ones_are_other_units():
    fixed = plan.unit_key("open", "router", "truncation", [])
    assert "budget_mode" not in fixed  # results stored before the column existed are reused
    cal = [type("R", (), dict(name="cal", run_id="x"))()]
    adaptive = plan.unit_key("open", "router", "truncation", cal, budget_mode="adaptive:mass")
    assert adaptive["budget_mode"] == "adaptive:mass" and adaptive["calibration"] == [["cal", "x"]]
    capped = plan.unit_key("open", "router", "truncation", cal, budget_mode="adaptive:mass+cap",
                           pass_cap=1.25)
    assert capped["pass_cap"] == 1.25
    assert "budget_mode" in plan.UNIT_IDENTITY  # an adaptive unit never supersedes a fixed one


def _block(config, mode=None, budgets=(4, 8)):
    unit = dict(mode="open", ranking="router", coverage="truncation")
    if mode:
        unit["budget_mode"] = mode
    return dict(table="replay_open", model="m", bench="b", run="r", config=config, block=config,
                unit=unit, layers=[0, 1], budgets=list(budgets), committed_at="2026")


def test_fixed_and_adaptive_are_separate_curves_in_the_default_views():
    blocks = [_block("f"), _block("a", "adaptive:mass", budgets=(4,))]
    cells = sql.default_cells(blocks, {})
    assert {c["config"] for c in cells} == {"f", "a"}  # both drawn, never one the other's points
    assert sql.curve_of(blocks[0])[-1] == "fixed" and sql.curve_of(blocks[1])[-1] == "adaptive:mass"


def _drop_budget_mode(traces):
    """Rewrite every stored result file without the ``budget_mode`` column and commit the blocks
    again: results as stored before the column existed."""
    catalog = Catalog(traces)
    for run in catalog.runs():
        for key, unit in plan.stored_variants(traces, "replay_open", run):
            assert "budget_mode" not in key
            for block in unit.complete_blocks():
                for part in unit.block_dir(block).glob("part-*.parquet"):
                    table = pq.read_table(part)
                    assert table.column("budget_mode").to_pylist()[0] == "fixed"
                    pq.write_table(table.drop(["budget_mode"]), part)
                unit.finish(block)
            assert isinstance(unit, UnitResults)


def test_results_stored_before_the_column_read_as_fixed(replayed, tmp_path, no_model):
    traces = copy_of(replayed[0], tmp_path)
    _drop_budget_mode(traces)
    q = call("moe_spec.analysis.query_cli", "SELECT DISTINCT budget_mode FROM replay_open",
             "--traces", traces, "--format", "json")
    assert q.returncode == 0, q.stderr
    assert [r["budget_mode"] for r in json.loads(q.stdout)] == ["fixed"]
    # and a fixed replay of the same cells reuses them (the key did not change): no model loaded
    r = call("moe_spec.replay.cli", "--traces", traces, "--run", "r", "--ranking", "router",
             "--budget", "16", "--no-progress")
    assert r.returncode == 0 and "reused stored results" in r.stderr, r.stderr
    assert call("moe_spec.analysis.query_cli", QUERY, "--traces", traces,
                "--format", "csv").stdout == replayed[1]
