"""Replay metrics are declared once (catalog/replay_metrics.py): the stored schema, the formulas'
output, the run summary and the analysis views all follow that list; a layout change without a
version bump fails here; results of another layout are recomputed, never read with NULLs; the two
modes are objects found by their --mode names."""

from types import SimpleNamespace

import duckdb
import polars as pl
import pyarrow as pa
import pytest
import torch

from moe_spec.analysis import replay_views
from moe_spec.catalog import replay_metrics, results, schema
from moe_spec.catalog.replay_metrics import (
    CLOSED_TABLE,
    FINGERPRINTS,
    LAYOUT_VERSION,
    METRICS,
    OPEN_TABLE,
)
from moe_spec.catalog.results import UnitResults
from moe_spec.policy import coverage
from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.coverage import prefix_masks
from moe_spec.policy.routing import RoutingRule
from moe_spec.replay import cli as replay_cli
from moe_spec.replay import closed_loop, engine, modes, open_loop, plan
from moe_spec.replay.cli import parser, summary_lines

# layouts results were stored under: their fingerprints never change (a layout change is a new
# version with its own FINGERPRINTS line in catalog/replay_metrics.py)
RELEASED = {(OPEN_TABLE, 1): "8f953f9016955a70", (CLOSED_TABLE, 1): "5b7c7fb80a18f8ed"}
KEY_COLUMNS = {OPEN_TABLE: ["prompt_index", "prompt_id", "step", "layer", "ranking", "coverage",
                            "budget", "budget_mode", "price"],
               CLOSED_TABLE: ["prompt_index", "prompt_id", "step", "ranking", "coverage",
                              "budget", "budget_mode", "price"]}


@pytest.mark.parametrize("table", [OPEN_TABLE, CLOSED_TABLE])
def test_a_layout_change_needs_a_version_bump(table):
    """The declared columns are those of their version's stored fingerprint."""
    assert replay_metrics.fingerprint(table) == FINGERPRINTS[(table, LAYOUT_VERSION[table])], \
        f"the metric columns of {table} changed: bump LAYOUT_VERSION and add its FINGERPRINTS line"


def test_released_layouts_keep_their_fingerprints():
    assert RELEASED.items() <= FINGERPRINTS.items()
    for table in (OPEN_TABLE, CLOSED_TABLE):
        versions = sorted(v for t, v in FINGERPRINTS if t == table)
        assert versions == list(range(1, LAYOUT_VERSION[table] + 1))
        assert len({FINGERPRINTS[(table, v)] for v in versions}) == len(versions)


@pytest.mark.parametrize("table", [OPEN_TABLE, CLOSED_TABLE])
def test_the_stored_schema_is_the_keys_then_the_declared_metrics(table):
    sch = schema.REPLAY_TABLES[table]
    assert sch.names == KEY_COLUMNS[table] + replay_metrics.names(table)
    for m in METRICS[table]:
        assert sch.field(m.name).type == m.type


def _batch(t=3, m=6, n=8, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rule = RoutingRule(k, renormalize=True)
    probs = torch.softmax(torch.randn(t, m, n, generator=g, dtype=torch.float64) * 2, -1)
    idx, w = rule.route(probs)
    experts = torch.randn(t, m, n, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(t, m, dtype=torch.bool)
    mask[0, -2:] = False  # a padded tree-layer
    return RoutingBatch(probs, idx, w, mask, torch.arange(t), rule,
                        ExpertTerms.from_outputs(experts, idx, w))


@pytest.mark.parametrize("cov", ["truncation", "substitution"])
def test_open_loop_produces_exactly_the_declared_metrics_and_they_are_stored(cov):
    batch = _batch()
    order = torch.argsort(batch.mass(), -1, descending=True)
    budgets = [2, 4, 8]
    keep = prefix_masks(order, budgets, batch.n)
    m = open_loop.metrics(batch, keep, coverage.get(cov))
    assert sorted(m) == sorted(replay_metrics.names(OPEN_TABLE))
    assert all(v.shape == (batch.size, len(budgets)) for v in m.values())
    # unique experts: the natural top-k union, the same at every budget
    assert m["unique_experts"][:, 0].tolist() == batch.union().sum(-1).tolist()
    assert float(m["rse"][:, -1].max()) < 1e-12  # B = N keeps every expert: exact
    assert not m["surrogate_ranked"].any()  # no ranking's word: none ranked by a surrogate
    said = torch.tensor([True, False, True])
    ranked = open_loop.metrics(batch, keep, coverage.get(cov), said)["surrogate_ranked"]
    assert torch.equal(ranked, said[:, None].expand(-1, len(budgets)))
    task = SimpleNamespace(ranking=SimpleNamespace(name="router"),
                           coverage=SimpleNamespace(name=cov))
    keys = dict(prompt_index=[0] * batch.size, prompt_id=["p"] * batch.size,
                step=list(range(batch.size)), layer=[0] * batch.size)
    table = engine.blocks_to_table([engine.columns(keys, task, budgets, m)], OPEN_TABLE)
    assert table.schema.equals(schema.REPLAY_TABLES[OPEN_TABLE])
    assert table.num_rows == batch.size * len(budgets)
    assert table.column("unique_experts").null_count == 0
    with pytest.raises(ValueError, match="declared"):  # an undeclared metric is refused
        engine.columns(keys, task, budgets, dict(m, extra=m["rse"]))
    with pytest.raises(ValueError, match="declared"):  # and so is a missing one
        engine.columns(keys, task, budgets, {k: v for k, v in m.items() if k != "rse"})


def test_closed_loop_produces_exactly_the_declared_metrics():
    g = torch.Generator().manual_seed(1)
    ref_logits = torch.randn(5, 11, generator=g)
    logits = ref_logits.clone()
    logits[2] = -logits[2]  # one node's argmax changes
    ref_logp = torch.log_softmax(ref_logits, -1)
    got = SimpleNamespace(path=[0, 1], bonus=7)
    ref = SimpleNamespace(path=[0, 1, 3], bonus=7)
    row = closed_loop.tree_metrics(got, ref, [0, 1, 3], 4, logits, ref_logits, ref_logp, [2, 3])
    assert sorted(row) == sorted(replay_metrics.names(CLOSED_TABLE))
    assert row["accepted_length"] == 2 and row["captured_accepted_length"] == 4
    assert row["path_unchanged"] is False and row["top1_agreement"] == pytest.approx(0.8)
    assert row["mean_kl"] > 0
    same = closed_loop.tree_metrics(ref, ref, [0, 1, 3], 4, ref_logits, ref_logits, ref_logp, [2])
    assert same["path_unchanged"] is True and same["mean_kl"] == pytest.approx(0, abs=1e-6)
    full = dict(prompt_index=0, prompt_id="p", step=0, ranking="router", coverage="truncation",
                budget=4, budget_mode="fixed", price=0.0, **row)
    table = pa.Table.from_pylist([full], schema=schema.REPLAY_TABLES[CLOSED_TABLE])
    assert all(table.column(c).null_count == 0 for c in table.column_names)


def _rows(table: str, n: int = 4) -> pa.Table:
    """``n`` rows of a result table, every column filled."""
    sch = schema.REPLAY_TABLES[table]
    value = {pa.types.is_floating: lambda i: 0.1 * (i + 1), pa.types.is_integer: lambda i: i + 1,
             pa.types.is_boolean: lambda i: i % 2 == 0, pa.types.is_string: lambda i: "router",
             pa.types.is_list: lambda i: [i, i + 2]}
    def one(f, i):
        return next(make(i) for test, make in value.items() if test(f.type))
    cols = {f.name: [one(f, i) for i in range(n)] for f in sch}
    cols["budget"] = [4] * n
    return pa.Table.from_pydict(cols, schema=sch)


@pytest.mark.parametrize("name", list(modes.MODES))
def test_summary_and_views_aggregate_every_declared_metric(name):
    mode = modes.get(name)
    rows = pl.from_arrow(_rows(mode.table))
    frame = rows.group_by(["ranking", "coverage", "budget"]).agg(mode.summary_aggregates())
    summarised = [m.name for m in mode.metrics if m.summary]
    assert frame.columns == ["ranking", "coverage", "budget", *summarised, mode.counted]
    assert frame[mode.counted].to_list() == [4]
    for m in summarised:
        assert frame[m].null_count() == 0
    con = duckdb.connect()
    con.register(mode.table, _rows(mode.table))
    view = (replay_views.error_vs_budget if mode.per_layer else replay_views.closed_loop)(
        con, by="ranking AS r")
    declared = [c for m in mode.metrics for c in
                ([m.view_name] + ([f"{m.view_name}_lo", f"{m.view_name}_hi"] if m.interval
                                  else [])) if m.view_name]
    assert view.columns == ["r", "ranking", "coverage", "budget_mode", "budget", "price",
                            *declared, mode.counted]
    assert all(view[c].null_count() == 0 for c in declared)
    lines = summary_lines(frame, mode, [SimpleNamespace(model="m", bench="b", name="e")],
                          ["router"], ["truncation"])
    assert f"{name}-loop replay" in lines[0] and mode.counted_unit in lines[0]


def test_the_summary_says_how_much_a_surrogate_ranked_without_rounding_to_all_or_none():
    frame = pl.DataFrame(dict(ranking=["sketch-gated", "sketch-gated", "sketch", "router"],
                              surrogate_ranked=[0.996, 0.996, 0.003, 0.0],
                              tree_layers=[100, 100, 100, 100]))
    lines = replay_cli.surrogate_lines(frame, ["sketch-gated", "sketch", "router"], "tree_layers",
                                       "tree-layers")
    assert lines == ["sketch-gated: its surrogate ranked >99% of the tree-layers, coact-prior's "
                     "shortlists the other <1%",
                     "sketch: its surrogate ranked <1% of the tree-layers, coact-prior's "
                     "shortlists the other >99%"]  # router reads no MoE input: no line
    whole = frame.with_columns(surrogate_ranked=pl.Series([1.0, 1.0, 0.0, 0.0]))
    assert replay_cli.surrogate_lines(whole, ["sketch-gated", "sketch"], "tree_layers",
                                      "tree-layers") == [
        "sketch-gated: its surrogate ranked every tree-layer",
        "sketch: its surrogate ranked no tree-layer (coact-prior's shortlists throughout)"]
    assert replay_cli.surrogate_lines(frame.drop("surrogate_ranked"), ["sketch"], "tree_layers",
                                      "tree-layers") == []  # closed loop: no such column


def _run(name="eval", run_id="r1"):
    return SimpleNamespace(model="tiny-olmoe", bench="mbpp", name=name, run_id=run_id,
                           prompt_indices=lambda: [0, 1])


def test_results_of_an_older_layout_are_recomputed_and_never_read(tmp_path, monkeypatch):
    key = dict(mode="open", ranking="router", coverage="truncation", calibration=[])
    monkeypatch.setitem(LAYOUT_VERSION, OPEN_TABLE, 1)  # results stored under the first layout
    old = UnitResults(tmp_path, OPEN_TABLE, _run(), key)
    assert old.unit == key  # version 1: keys written before the layout was versioned hold
    with old.locked():
        (block,) = old.plan([0, 1], [4])
    for p in (0, 1):
        old.write_part(block, p, _rows(OPEN_TABLE, 1))
    old.finish(block)
    assert len(results.complete_blocks(tmp_path, OPEN_TABLE)) == 1

    monkeypatch.setitem(LAYOUT_VERSION, OPEN_TABLE, 2)  # a metric added: the layout bumped
    said = []
    assert results.complete_blocks(tmp_path, OPEN_TABLE, said) == []  # readers leave it out
    assert len(said) == 1 and "1 result unit(s) of replay_open" in said[0] \
        and "older metric layout" in said[0], said  # and say so, once
    new = UnitResults(tmp_path, OPEN_TABLE, _run(), key)
    assert new.unit == dict(key, layout=2) and new.folder != old.folder
    with new.locked():
        assert [b.cells() for b in new.plan([0, 1], [4])] == [block.cells()]  # recomputed
        assert new.drop_superseded(plan.UNIT_IDENTITY, plan.SIDE_BY_SIDE) == [old.folder]
    assert not old.folder.exists()
    assert UnitResults(tmp_path, CLOSED_TABLE, _run(), dict(key, mode="closed")).unit == \
        dict(key, mode="closed")  # the other table's layout did not change


@pytest.mark.parametrize("field, value", [("dtype", "bfloat16"), ("token_aware_starts", True),
                                          ("batch_seed", 1)])
def test_variants_live_side_by_side_where_only_versions_supersede(tmp_path, field, value):
    """A unit differing from a stored one in a variant field (the model's dtype, the oracle's
    token-aware starts, the batch seed) is another experiment: storing it must not delete the
    other (the views choose one a cell and name it); a newer version deletes every older unit,
    whichever variant."""
    key = dict(mode="open", ranking="oracle", coverage="truncation", calibration=[["cal", "c1"]],
               version=7)
    units = [UnitResults(tmp_path, OPEN_TABLE, _run(), k)
             for k in (key, dict(key, **{field: value}), dict(key, version=8))]
    dropped = []
    for unit in units:  # each written as replay writes it: older units dropped first
        with unit.locked():
            dropped.append(unit.drop_superseded(plan.UNIT_IDENTITY, plan.SIDE_BY_SIDE))
            (block,) = unit.plan([0, 1], [4])
        for p in (0, 1):
            unit.write_part(block, p, _rows(OPEN_TABLE, 1))
        unit.finish(block)
    assert dropped[:2] == [[], []]  # the variant stays beside the first
    assert sorted(dropped[2]) == sorted([units[0].folder, units[1].folder])  # the newer
    # version: both older variants go
    assert units[2].folder.exists()


def test_modes_are_objects_looked_up_by_the_cli_names():
    assert set(modes.MODES) == {"open", "closed"}
    assert set(parser()._option_string_actions["--mode"].choices) == set(modes.MODES)
    open_, closed = modes.get("open"), modes.get("closed")
    assert isinstance(open_, modes.OpenLoop) and isinstance(closed, modes.ClosedLoop)
    assert (open_.table, closed.table) == (OPEN_TABLE, CLOSED_TABLE)
    assert plan.TABLES == {"open": OPEN_TABLE, "closed": CLOSED_TABLE}
    assert open_.cell_layers([1, 3]) == [1, 3] and closed.cell_layers([1, 3]) is None
    assert closed.runtime_rankings_only and not open_.runtime_rankings_only
    assert plan.ReplayRequest(mode="closed").mode is closed
    assert plan.ReplayRequest().mode is open_
    with pytest.raises(ValueError, match="open or closed"):
        modes.get("half")
    assert plan.unit_key(closed, "router", "truncation", []) == \
        plan.unit_key("closed", "router", "truncation", []) == \
        dict(mode="closed", ranking="router", coverage="truncation", calibration=[])


@pytest.mark.parametrize("router,oracle,other,want", [
    (0.4, 0.1, 0.25, 0.5), (0.4, 0.1, 0.4, 0.0), (0.4, 0.1, 0.1, 1.0), (0.4, 0.1, 0.5, -1 / 3),
    (0.1, 0.1, 0.05, None), (0.1, 0.2, 0.05, None), (None, 0.1, 0.05, None)])
def test_gap_closed_is_one_formula_for_numbers_and_columns(router, oracle, other, want):
    import polars as pl

    from moe_spec.catalog.replay_metrics import gap_closed
    got = gap_closed(router, oracle, other)
    assert got == pytest.approx(want) if want is not None else got is None
    if router is not None:
        frame = pl.DataFrame(dict(r=[router], o=[oracle], x=[other]))
        col = frame.select(gap_closed(pl.col("r"), pl.col("o"), pl.col("x")))[0, 0]
        assert col == pytest.approx(want) if want is not None else col is None
