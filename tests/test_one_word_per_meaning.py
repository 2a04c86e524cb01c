"""One word per meaning (issue 62): b is ``batch_size`` in every table, a pass's own count of
sequences is ``pass_sequences``, a (virtual) batch's number ``batch_index``. Files stored under
the older names (``batch`` for all three) still read, under the new ones: each test writes a
file of the old layout and reads it back."""

import shutil

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from moe_spec.analysis import frames
from moe_spec.analysis.sql import connect
from moe_spec.catalog import Catalog, replay_metrics, results, schema
from moe_spec.catalog.replay_metrics import CLOSED_BATCH_TABLE
from moe_spec.catalog.results import UnitResults
from moe_spec.catalog.runs import batch_profile_dir, profile_dir


def _old(sch: pa.Schema, new: str, old: str = "batch") -> pa.Schema:
    """``sch`` as an older layout stored it: column ``new`` under its old name."""
    i = sch.get_field_index(new)
    return sch.set(i, sch.field(i).with_name(old))


def _filled(sch: pa.Schema, n: int, **given) -> pa.Table:
    """``n`` rows of ``sch``, every column filled (``given`` columns as given)."""
    value = {pa.types.is_floating: lambda i: 0.5 + i, pa.types.is_integer: lambda i: i + 1,
             pa.types.is_boolean: lambda i: i % 2 == 0, pa.types.is_string: lambda i: "x",
             pa.types.is_list: lambda i: [i, i + 1]}
    cols = {f.name: given.get(f.name) or [next(make(i) for test, make in value.items()
                                               if test(f.type)) for i in range(n)] for f in sch}
    return pa.Table.from_pydict(cols, schema=sch)


def test_no_stored_column_is_called_batch_and_b_is_batch_size():
    tables = {**schema.ALL_TABLES, **schema.BATCH_PROFILE_TABLES, **schema.REPLAY_TABLES,
              schema.PROFILE_TABLE: schema.PROFILE}
    assert [t for t, sch in tables.items() if "batch" in sch.names] == []
    assert "batch_size" in schema.PROFILE.names
    assert "pass_sequences" in schema.BATCH_PROFILE_TABLES["batch_profile_passes"].names
    assert "batch_index" in schema.REPLAY_TABLES[CLOSED_BATCH_TABLE].names
    assert schema.renamed(schema.PROFILE_TABLE, ["batch", "gamma"]) == {"batch": "batch_size"}
    assert schema.renamed(schema.PROFILE_TABLE, ["batch", "batch_size"]) == {}
    assert schema.renamed("trees", ["batch"]) == {}


def test_a_profile_of_the_old_layout_reads_with_batch_size(tmp_path):
    """profile-target's points stored with ``batch`` (before round 5): MoESD's efficiency frame
    reads them as ``batch_size``."""
    folder = profile_dir(tmp_path, "org/model", "cpu")
    folder.mkdir(parents=True)
    rows = [dict(batch_size=b, gamma=g, seconds=1e-3 * (1 + b * g / 8), prefix=8, num_experts=8,
                 top_k=2) for b in (1, 2, 4) for g in (1, 2, 4)]
    old = pa.Table.from_pylist(rows, schema=schema.PROFILE).rename_columns(
        _old(schema.PROFILE, "batch_size").names)
    assert "batch" in old.column_names
    pq.write_table(old, folder / "part-0.parquet")
    eff = frames.efficiency_frame(tmp_path, "org/model")
    assert "batch" not in eff.columns
    assert sorted(set(eff["batch_size"].to_list())) == [1, 2, 4]
    assert eff.filter(pl.col("gamma") == 1)["eta"].to_list() == [1.0] * 3


def test_profile_batch_passes_of_the_old_layout_read_as_pass_sequences(tmp_path):
    """A measurement stored with ``batch`` beside one stored with ``pass_sequences``: the view
    has one column, ``pass_sequences``, holding both."""
    sch = schema.BATCH_PROFILE_TABLES["batch_profile_passes"]
    folder = batch_profile_dir(tmp_path, "batch_profile_passes", "tiny-olmoe", "mbpp", "batch-x")
    folder.mkdir(parents=True)
    old = _filled(sch, 2, pass_sequences=[3, 2], measurement=["old", "old"])
    pq.write_table(old.rename_columns(_old(sch, "pass_sequences").names),
                   folder / "part-old.parquet")
    pq.write_table(_filled(sch, 2, pass_sequences=[4, 1], measurement=["new", "new"]),
                   folder / "part-new.parquet")
    con = connect(tmp_path)
    got = con.sql("SELECT * FROM batch_profile_passes ORDER BY measurement DESC, "
                  "pass_sequences").pl()
    assert "batch" not in got.columns
    assert got["pass_sequences"].to_list() == [2, 3, 1, 4]
    only_old = tmp_path / "old-only"
    shutil.copytree(tmp_path / "batch_profile_passes", only_old / "batch_profile_passes",
                    ignore=shutil.ignore_patterns("part-new.parquet"))
    got = connect(only_old).sql("SELECT * FROM batch_profile_passes").pl()
    assert "batch" not in got.columns and sorted(got["pass_sequences"]) == [2, 3]


def test_closed_batch_results_of_layout_1_read_as_batch_index(one_prompt, tmp_path, monkeypatch):
    """replay_closed_batch's layout 2 renamed ``batch`` to ``batch_index``: results stored under
    layout 1 still read (renamed) beside layout 2's, and a new replay's key is layout 2's."""
    traces = tmp_path / "traces"
    shutil.copytree(one_prompt, traces)
    (run,) = Catalog(traces).runs()
    sch = schema.REPLAY_TABLES[CLOSED_BATCH_TABLE]
    assert replay_metrics.LAYOUT_VERSION[CLOSED_BATCH_TABLE] == 2
    key = dict(mode="closed", ranking="router", coverage="truncation", calibration=[],
               batch_size=2, batch_seed=0)

    def store(unit: UnitResults, rows: pa.Table) -> None:
        with unit.locked():
            (block,) = unit.plan(None, [4])
        unit.write_part(block, run.prompt_indices()[0], rows)
        unit.finish(block)

    monkeypatch.setitem(replay_metrics.LAYOUT_VERSION, CLOSED_BATCH_TABLE, 1)
    old = UnitResults(traces, CLOSED_BATCH_TABLE, run, key)
    assert "layout" not in old.unit  # as layout 1 keyed its units
    store(old, _filled(sch, 2, batch_index=[7, 7], budget=[4, 4], ranking=["router"] * 2)
          .rename_columns(
        _old(sch, "batch_index").names))
    monkeypatch.undo()
    new = UnitResults(traces, CLOSED_BATCH_TABLE, run, dict(key, ranking="oracle"))
    assert new.unit["layout"] == 2
    store(new, _filled(sch, 2, batch_index=[9, 9], budget=[4, 4], ranking=["oracle"] * 2))
    assert len(results.complete_blocks(traces, CLOSED_BATCH_TABLE)) == 2  # both read
    con = connect(traces)
    for view in (CLOSED_BATCH_TABLE, f"{CLOSED_BATCH_TABLE}_all"):
        got = con.sql(f"SELECT ranking, batch_index FROM {view} ORDER BY ALL").pl()
        assert got.rows() == [("oracle", 9), ("oracle", 9), ("router", 7), ("router", 7)]
        columns = con.sql(f"DESCRIBE {view}").pl()["column_name"].to_list()
        assert "batch" not in columns
    # a replay now keys its unit by layout 2: the layout-1 unit is recomputed, never extended
    assert UnitResults(traces, CLOSED_BATCH_TABLE, run, key).folder != old.folder
