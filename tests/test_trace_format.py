"""The trace format has one owner (catalog): part names built and parsed in one place, runs
written through one writer, the profile table declared and read where it is written; and user
errors share one base class and one error line."""

import importlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_spec.catalog import Catalog, CatalogError, schema
from moe_spec.catalog.runs import (
    PART_GLOB,
    part_name,
    profile_dir,
    profile_parts,
    prompt_of_part,
    prompt_parts_glob,
)
from moe_spec.catalog.writer import RunWriter, list_column, write_profile
from moe_spec.errors import UserError, fail


def test_part_names_parse_back_and_sort_by_prompt_then_chunk(tmp_path):
    names = [part_name(p, c) for p in (0, 7, 123456) for c in (0, 1, 12)]
    assert names == sorted(names) and names[0] == "part-000000-0000.parquet"
    assert [prompt_of_part(tmp_path / n) for n in names] == [0] * 3 + [7] * 3 + [123456] * 3
    for n in names:
        (tmp_path / n).touch()
    assert sorted(p.name for p in tmp_path.glob(PART_GLOB)) == names
    assert [p.name for p in sorted(tmp_path.glob(prompt_parts_glob(7)))] == names[3:6]
    with pytest.raises(CatalogError, match="not a part capture writes"):
        prompt_of_part(tmp_path / "part-x.parquet")


def _manifest(prompts: int) -> dict:
    return dict(model="m/x", bench="b", run="r", role="evaluation", settings={"offset": 0},
                schema_version=schema.SCHEMA_VERSION,
                prompt_ids=[f"p{i}" for i in range(prompts)], prompts_total=prompts)


def _sequence(p: int) -> pa.Table:
    return pa.Table.from_pylist([dict(prompt_index=p, prompt_id=f"p{p}", steps=1)],
                                schema=schema.TABLES["sequences"])


def test_a_run_written_through_the_writer_is_what_the_catalog_reads(tmp_path):
    writer = RunWriter(tmp_path, "m/x", "b", "r")
    manifest, done = writer.start(_manifest(3))
    assert done == set() and manifest["status"] == "running"
    for p in (0, 1):
        for table in schema.TRACE_TABLES:  # sequences last
            writer.write_part(table, p, 0, schema.storage_schema(table).empty_table()
                              if table != "sequences" else _sequence(p))
        writer.record_progress(manifest)
    writer.write_part("routing", 2, 0, schema.TABLES["routing"].empty_table())  # incomplete
    writer.close()
    running = Catalog(tmp_path).runs(complete=False)[0]
    assert running.manifest["prompts_done"] == 2 and running.prompt_indices() == [0, 1]

    writer = RunWriter(tmp_path, "m/x", "b", "r")  # resume: the incomplete prompt is dropped
    manifest, done = writer.start(_manifest(3))
    assert done == {0, 1} and running.parts("routing", 2) == []
    for table in schema.TRACE_TABLES:
        writer.write_part(table, 2, 0, schema.storage_schema(table).empty_table()
                          if table != "sequences" else _sequence(2))
    writer.finish({**manifest, "prompts_done": 3})
    writer.close()
    (run,) = Catalog(tmp_path).runs()
    assert run.complete and run.prompt_indices() == [0, 1, 2] and run.run_id == manifest["run_id"]
    row = pq.read_table(run.dir("runs") / "part-0.parquet").to_pylist()[0]
    assert row["run_id"] == manifest["run_id"] and row["prompts"] == 3
    with pytest.raises(CatalogError, match="exists with different settings"):
        RunWriter(tmp_path, "m/x", "b", "r").start({**_manifest(3), "settings": {"offset": 1}})


def test_list_columns_hold_the_rows_of_a_matrix():
    matrix = np.arange(12, dtype=np.float32).reshape(4, 3)
    column = list_column(matrix, pa.float32())
    assert column.to_pylist() == matrix.tolist()
    assert column.type == schema.vector(pa.float32()) and not column.type.value_field.nullable


def test_per_node_vectors_are_stored_non_null_and_older_nullable_ones_still_type_check():
    """Schema 4 declares routing's and moe_io's vectors non-null (Parquet stores no definition
    level per value); a file of schema 3 (nullable values) passes the same type check, a file
    whose values are of another type does not."""
    from moe_spec.catalog import reader
    for table in ("routing", "moe_io"):
        for f in schema.TABLES[table]:
            if pa.types.is_list(f.type):
                assert not f.type.value_field.nullable, (table, f.name)
    old = pa.schema([pa.field("router_probs", pa.list_(pa.float32()))]).empty_table()
    reader._expected_types(old, "routing")  # no error
    wrong = pa.schema([pa.field("router_probs", pa.list_(pa.float64()))]).empty_table()
    with pytest.raises(ValueError, match="router_probs"):
        reader._expected_types(wrong, "routing")


def test_the_profile_table_is_declared_written_and_found_where_it_is_declared(tmp_path):
    points = pa.table({"top_k": pa.array([2, 2], pa.int32()), "seconds": [0.5, 0.25],
                       "gamma": [1, 4], "batch": [1, 1], "prefix": pa.array([8, 8], pa.int32()),
                       "num_experts": pa.array([8, 8], pa.int32()), "extra": [0, 0]})
    folder = write_profile(tmp_path, "org/model", "cpu", points)
    assert folder == profile_dir(tmp_path, "org/model", "cpu")
    assert folder.relative_to(tmp_path).parts == (schema.PROFILE_TABLE, "model=org--model",
                                                  "device=cpu")
    assert profile_parts(tmp_path, "org/model") == [folder / "part-0.parquet"]
    stored = pq.read_table(profile_parts(tmp_path, "org/model")[0])
    assert stored.schema.equals(schema.PROFILE) and stored["gamma"].to_pylist() == [1, 4]
    assert profile_parts(tmp_path, "other") == []


ERRORS = [("moe_spec.catalog.names", "InvalidName", ValueError), ("moe_spec.catalog.runs",
          "CatalogError", RuntimeError),
          ("moe_spec.catalog.atomic", "UnsafeTarget", OSError), ("moe_spec.tasks.sandbox",
          "SandboxUnavailable", OSError),
          ("moe_spec.tasks.benchmarks", "BenchmarkError", ValueError),
          ("moe_spec.policy.rankings.base", "RankingError", ValueError),
          ("moe_spec.replay.plan", "ReplayError", RuntimeError), ("moe_spec.replay.open_loop",
          "GoldMismatch", ValueError),
          ("moe_spec.capture.storage", "StorageError", ValueError),
          ("moe_spec.capture.settings", "CaptureError", RuntimeError),
          ("moe_spec.capture.background", "WriterFailed", RuntimeError),
          ("moe_spec.eagle.draft_head", "DraftHeadError", ValueError),
          ("moe_spec.moe.families", "UnsupportedModelError", ValueError),
          ("moe_spec.moe.models", "ModelError", ValueError), ("moe_spec.cluster",
          "ClusterError", RuntimeError),
          ("moe_spec.analysis.sql", "QueryRefused", ValueError)]


@pytest.mark.parametrize("module, name, builtin", ERRORS)
def test_every_user_error_has_the_one_base_and_keeps_its_builtin(module, name, builtin):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, UserError) and issubclass(cls, builtin)


def test_the_error_line_is_argparses_and_returns_the_status(capsys):
    assert fail("capture", CatalogError("run 'r' is locked; wait")) == 2
    assert fail("query", "give a SQL query or --schema", 1) == 1
    assert capsys.readouterr().err == ("capture: error: run 'r' is locked; wait\n"
                                       "query: error: give a SQL query or --schema\n")
