"""Damaged or hostile traces: names read from disk become paths only when they pass the name
check, results left out are said, damaged parts, types and manifests are refused naming the file
(or, for a summary, worked around), and a failed write names its file.

Every case ends in the exact result, a warning line saying what was left out, or one clear line
naming the problem, with exit code 2."""

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import recommit
from helpers import QUERY, call, copy_of, one_line_error

from moe_spec.tasks import benchmarks

BENCHMARKS = os.environ.get(benchmarks.ENV_VAR) or str(benchmarks.DEFAULT_DIR)


def manifest_of(traces):
    path = next(traces.glob("runs/**/_manifest.json"))
    return path, json.loads(path.read_text())


def edit_manifest(traces, **fields):
    path, manifest = manifest_of(traces)
    path.write_text(json.dumps({**manifest, **fields}))


# --- names read from disk become paths only when they pass the name check -------------------------
def test_a_manifest_run_name_never_becomes_a_path_outside_the_traces(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    outside = tmp_path / "outside_target"  # what the name resolves to from every table folder
    outside.mkdir()
    for part in traces.glob("sequences/**/part-*.parquet"):
        shutil.copy(part, outside / part.name)
    for table in ("sequences", "trees", "nodes", "routing", "moe_io", "quality"):  # so it resolves
        (traces / table / "model=tiny-olmoe" / "bench=mbpp" / "run=base").mkdir(parents=True,
                                                                              exist_ok=True)
    edit_manifest(traces, run="base/../../../../../outside_target")
    for module, args in (("moe_spec.analysis.evaluate_cli", ["--benchmarks", BENCHMARKS]),
                         ("moe_spec.replay.cli", ["--no-progress"]),
                         ("moe_spec.analysis.query_cli", [QUERY])):
        one_line_error(call(module, "--traces", traces, *args), "run 'base/../",
                       "_manifest.json")
    assert sorted(p.name for p in outside.iterdir()) == \
        sorted(p.name for p in traces.glob("sequences/**/part-*.parquet"))


@pytest.mark.parametrize("field,value", [("bench", "../mbpp"), ("run", ".hidden"),
                                         ("run", "a/b")])
def test_manifest_names_get_the_command_lines_check(replayed, tmp_path, field, value):
    traces = copy_of(replayed[0], tmp_path)
    edit_manifest(traces, **{field: value})
    one_line_error(call("moe_spec.analysis.query_cli", QUERY, "--traces", traces), f"{field} {value!r}")


def test_a_replay_block_id_never_becomes_a_path(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    for config in traces.glob("replay_open/**/_config.json"):
        state = json.loads(config.read_text())
        state["blocks"][0]["id"] = "../../../../../../escaped"
        config.write_text(json.dumps(state))
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
                        "--no-progress"), "corrupt replay result config")


# --- no silent partial answers --------------------------------------------------------------------
@pytest.mark.parametrize("content", ["[]", '{"blocks": ['])
def test_views_say_which_replay_results_they_leave_out(replayed, tmp_path, content):
    traces = copy_of(replayed[0], tmp_path)
    config = sorted(traces.glob("replay_open/**/_config.json"))[0]
    config.write_text(content)
    r = call("moe_spec.analysis.query_cli", "SELECT count(*) AS n FROM replay_open", "--traces", traces,
             "--format", "csv")
    assert r.returncode == 0
    assert "warning:" in r.stderr and str(config) in r.stderr and "replay again" in r.stderr


def test_a_deleted_moe_io_part_is_refused_by_query_as_by_replay(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    part = sorted(traces.glob("moe_io/**/part-000001-*.parquet"))[0]
    part.unlink()
    one_line_error(call("moe_spec.analysis.query_cli", QUERY, "--traces", traces), part.name, "recapture")
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--no-progress"),
                   part.name)


def test_a_repeated_expert_in_one_topk_row_is_refused(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    part = sorted(traces.glob("routing/**/part-000000-*.parquet"))[0]
    t = pq.read_table(part)
    ids = t["topk_ids"].to_pylist()
    ids[0] = [ids[0][0]] * len(ids[0])
    t = t.set_column(t.schema.get_field_index("topk_ids"), "topk_ids",
                     pa.array(ids, t.schema.field("topk_ids").type))
    pq.write_table(t, part)
    recommit(traces)  # as if captured so: the values themselves are checked
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
                        "--no-progress", "--out", tmp_path / "results"), "repeats an expert",
                   part.name)


def test_a_bogus_role_is_one_line_everywhere(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    edit_manifest(traces, role="bogus")
    one_line_error(call("moe_spec.analysis.report", "--traces", traces, "--out", tmp_path / "rep"),
                   "role 'bogus'")
    one_line_error(call("moe_spec.analysis.query_cli", QUERY, "--traces", traces), "role 'bogus'")


def test_a_retyped_column_is_refused_naming_the_file(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    part = sorted(traces.glob("trees/**/part-*.parquet"))[0]
    t = pq.read_table(part)
    i = t.schema.get_field_index("prefix_len")
    t = t.set_column(i, "prefix_len", pa.array([str(v) for v in t["prefix_len"].to_pylist()]))
    pq.write_table(t, part)
    recommit(traces)  # as if captured so: the types themselves are checked
    one_line_error(call("moe_spec.analysis.query_cli", "SELECT max(prefix_len) FROM trees", "--traces",
                        traces), part.name, "prefix_len")


# --- a damaged summary does not take query down ---------------------------------------------------
def test_a_damaged_summary_leaves_query_working(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    from moe_spec.analysis import summaries
    summaries.ensure(traces, workers=1)
    part = sorted(traces.glob("summaries/summary_layers/**/part-0.parquet"))[0]
    part.write_bytes(part.read_bytes()[:100])
    r = call("moe_spec.analysis.query_cli", QUERY, "--traces", traces, "--format", "csv")
    assert r.returncode == 0 and r.stdout == replayed[1], r.stderr
    assert "summary_layers" in r.stderr and "warning:" in r.stderr


# --- no tracebacks --------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("num_experts", "64"), ("moe_layers", "all"),
                                         ("top_k", True), ("settings", [])])
def test_manifest_field_types_are_checked_at_read(replayed, tmp_path, field, value):
    traces = copy_of(replayed[0], tmp_path)
    edit_manifest(traces, **{field: value})
    one_line_error(call("moe_spec.analysis.report", "--traces", traces, "--out", tmp_path / "rep"), field,
                   "_manifest.json")
    from moe_spec.catalog import Catalog, CatalogError
    with pytest.raises(CatalogError, match=field):  # what the app's tree viewer reads through
        Catalog(traces).all_runs()


# --- errors name the file -------------------------------------------------------------------------
def test_a_corrupt_parquet_page_is_named_by_query(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    part = sorted(traces.glob("trees/**/part-*.parquet"))[0]
    data = bytearray(part.read_bytes())
    data[4:44] = b"\xff" * 40  # the first page header, past the magic bytes
    part.write_bytes(bytes(data))
    one_line_error(call("moe_spec.analysis.query_cli", "SELECT * FROM trees", "--traces", traces,
                        "--format", "json"), part.name, "recapture")


def test_a_full_disk_names_the_quality_file(replayed, tmp_path, monkeypatch):
    from moe_spec.analysis import quality
    from moe_spec.catalog import Catalog, atomic
    traces = copy_of(replayed[0], tmp_path)
    run_ = Catalog(traces).runs()[0]

    def full(path, table):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic, "write_table", full)
    with pytest.raises(OSError) as caught:
        quality.write(run_, pa.table({"a": [1]}))
    message = str(caught.value)
    assert "part-0.parquet" in message and "No space left" in message and "\n" not in message
