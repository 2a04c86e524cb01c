"""Hostile input, round 3 (issue 31): names from disk that become paths, outputs that must never
clobber, silent partial answers, tracebacks, hangs and errors that name no file.

Every case ends in the exact result, a warning line saying what was left out, or one clear
line naming the problem, with exit code 2."""

import json
import os
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import recommit
from test_hardening import CAP, QUERY, one_line_error, run  # noqa: I001 - tests/ module

from capture import cli as capture_cli
from tasks import benchmarks

BENCHMARKS = os.environ.get(benchmarks.ENV_VAR) or str(benchmarks.DEFAULT_DIR)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A small capture (two prompts) with replay results beside it, and the query's answer."""
    root = tmp_path_factory.mktemp("pristine3")
    traces = root / "traces"
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(traces), "--run", "r"]) == 0
    r = run("replay.cli", "--traces", traces, "--run", "r", "--ranking", "router", "--budget",
            "16", "--no-progress")
    assert r.returncode == 0, r.stderr
    q = run("analysis.query_cli", QUERY, "--traces", traces, "--format", "csv")
    assert q.returncode == 0
    return traces, q.stdout


def copy(pristine, tmp_path, name="t"):
    traces = tmp_path / name
    shutil.copytree(pristine[0], traces)
    return traces


def manifest_of(traces):
    path = next(traces.glob("runs/**/_manifest.json"))
    return path, json.loads(path.read_text())


def edit_manifest(traces, **fields):
    path, manifest = manifest_of(traces)
    path.write_text(json.dumps({**manifest, **fields}))


# --- 3. names read from disk become paths only when they pass the name check ----------------
def test_a_manifest_run_name_never_becomes_a_path_outside_the_traces(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    outside = tmp_path / "outside_target"  # what the name resolves to from every table folder
    outside.mkdir()
    for part in traces.glob("sequences/**/part-*.parquet"):
        shutil.copy(part, outside / part.name)
    for table in ("sequences", "trees", "nodes", "routing", "moe_io", "quality"):  # so it resolves
        (traces / table / "model=tiny-olmoe" / "bench=mbpp" / "run=base").mkdir(parents=True,
                                                                              exist_ok=True)
    edit_manifest(traces, run="base/../../../../../outside_target")
    for module, args in (("analysis.evaluate_cli", ["--benchmarks", BENCHMARKS]),
                         ("replay.cli", ["--no-progress"]), ("analysis.query_cli", [QUERY])):
        one_line_error(run(module, "--traces", traces, *args), "run 'base/../",
                       "_manifest.json")
    assert sorted(p.name for p in outside.iterdir()) == \
        sorted(p.name for p in traces.glob("sequences/**/part-*.parquet"))


@pytest.mark.parametrize("field,value", [("bench", "../mbpp"), ("run", ".hidden"),
                                         ("run", "a/b")])
def test_manifest_names_get_the_command_lines_check(pristine, tmp_path, field, value):
    traces = copy(pristine, tmp_path)
    edit_manifest(traces, **{field: value})
    one_line_error(run("analysis.query_cli", QUERY, "--traces", traces), f"{field} {value!r}")


def test_a_replay_block_id_never_becomes_a_path(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    for config in traces.glob("replay_open/**/_config.json"):
        state = json.loads(config.read_text())
        state["blocks"][0]["id"] = "../../../../../../escaped"
        config.write_text(json.dumps(state))
    one_line_error(run("replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
                       "--no-progress"), "corrupt replay result config")


# --- 5. outputs never clobber ------------------------------------------------------------------
def test_query_never_replaces_a_fifo_or_a_symlink(pristine, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run("analysis.query_cli", QUERY, "--traces", pristine[0], "--format", "csv", "--out",
            fifo, timeout=60)
    one_line_error(r, "not a regular file")
    assert fifo.is_fifo()
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("precious")
    link = tmp_path / "out.csv"
    link.symlink_to(target)
    for fmt in ("csv", "parquet"):
        r = run("analysis.query_cli", QUERY, "--traces", pristine[0], "--format", fmt, "--out",
                link)
        one_line_error(r, "symbolic link")
        assert link.is_symlink() and target.read_text() == "precious"
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_query_out_dash_is_stdout(pristine, tmp_path):
    r = run("analysis.query_cli", QUERY, "--traces", pristine[0], "--format", "csv", "--out", "-")
    assert r.returncode == 0 and r.stdout.strip() == pristine[1].strip()
    assert not (pristine[0].parent / "-").exists() and not (tmp_path / "-").exists()


def test_replay_and_evaluate_outputs_refuse_links_and_folders(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    target = tmp_path / "precious.json"
    target.write_text("precious")
    link = tmp_path / "summary.json"
    link.symlink_to(target)
    r = run("replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
            "--no-progress", "--output", link)
    one_line_error(r, "symbolic link")
    assert target.read_text() == "precious" and link.is_symlink()
    folder = tmp_path / "a-folder"
    folder.mkdir()
    r = run("analysis.evaluate_cli", "--traces", traces, "--benchmarks", BENCHMARKS, "--output",
            folder)
    one_line_error(r, "a folder")
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_failed_writes_leave_no_temporary_files(tmp_path, monkeypatch):
    import console
    from catalog import atomic
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError):
        console.write_json(tmp_path / "summary.json", loop)  # not serialisable
    (tmp_path / "keep.txt").write_text("x")

    def half_written(table, where, **kwargs):
        open(where, "wb").write(b"PAR1 half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic.pq, "write_table", half_written)
    with pytest.raises(OSError):
        atomic.write_table(tmp_path / "t.parquet", pa.table({"a": [1]}))
    with pytest.raises(atomic.UnsafeTarget, match="symbolic link"):
        (tmp_path / "link").symlink_to(tmp_path / "keep.txt")
        atomic.write_bytes(tmp_path / "link", b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "link"]
    assert (tmp_path / "keep.txt").read_text() == "x"


# --- 6. no silent partial answers ------------------------------------------------------------
@pytest.mark.parametrize("content", ["[]", '{"blocks": ['])
def test_views_say_which_replay_results_they_leave_out(pristine, tmp_path, content):
    traces = copy(pristine, tmp_path)
    config = sorted(traces.glob("replay_open/**/_config.json"))[0]
    config.write_text(content)
    r = run("analysis.query_cli", "SELECT count(*) AS n FROM replay_open", "--traces", traces,
            "--format", "csv")
    assert r.returncode == 0
    assert "warning:" in r.stderr and str(config) in r.stderr and "replay again" in r.stderr


def test_a_deleted_moe_io_part_is_refused_by_query_as_by_replay(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    part = sorted(traces.glob("moe_io/**/part-000001-*.parquet"))[0]
    part.unlink()
    one_line_error(run("analysis.query_cli", QUERY, "--traces", traces), part.name, "recapture")
    one_line_error(run("replay.cli", "--traces", traces, "--ranking", "router", "--no-progress"),
                   part.name)


def test_a_repeated_expert_in_one_topk_row_is_refused(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    part = sorted(traces.glob("routing/**/part-000000-*.parquet"))[0]
    t = pq.read_table(part)
    ids = t["topk_ids"].to_pylist()
    ids[0] = [ids[0][0]] * len(ids[0])
    t = t.set_column(t.schema.get_field_index("topk_ids"), "topk_ids",
                     pa.array(ids, t.schema.field("topk_ids").type))
    pq.write_table(t, part)
    recommit(traces)  # as if captured so: the values themselves are checked
    one_line_error(run("replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
                       "--no-progress", "--out", tmp_path / "results"), "repeats an expert",
                   part.name)


def test_a_bogus_role_is_one_line_everywhere(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    edit_manifest(traces, role="bogus")
    one_line_error(run("analysis.report", "--traces", traces, "--out", tmp_path / "rep"),
                   "role 'bogus'")
    one_line_error(run("analysis.query_cli", QUERY, "--traces", traces), "role 'bogus'")


def test_a_retyped_column_is_refused_naming_the_file(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    part = sorted(traces.glob("trees/**/part-*.parquet"))[0]
    t = pq.read_table(part)
    i = t.schema.get_field_index("prefix_len")
    t = t.set_column(i, "prefix_len", pa.array([str(v) for v in t["prefix_len"].to_pylist()]))
    pq.write_table(t, part)
    recommit(traces)  # as if captured so: the types themselves are checked
    one_line_error(run("analysis.query_cli", "SELECT max(prefix_len) FROM trees", "--traces",
                       traces), part.name, "prefix_len")


# --- 7. a damaged summary does not take query down -------------------------------------------
def test_a_damaged_summary_leaves_query_working(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    from analysis import summaries
    summaries.ensure(traces, workers=1)
    part = sorted(traces.glob("summaries/summary_layers/**/part-0.parquet"))[0]
    part.write_bytes(part.read_bytes()[:100])
    r = run("analysis.query_cli", QUERY, "--traces", traces, "--format", "csv")
    assert r.returncode == 0 and r.stdout == pristine[1], r.stderr
    assert "summary_layers" in r.stderr and "warning:" in r.stderr


# --- 8. tracebacks -----------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("num_experts", "64"), ("moe_layers", "all"),
                                         ("top_k", True), ("settings", [])])
def test_manifest_field_types_are_checked_at_read(pristine, tmp_path, field, value):
    traces = copy(pristine, tmp_path)
    edit_manifest(traces, **{field: value})
    one_line_error(run("analysis.report", "--traces", traces, "--out", tmp_path / "rep"), field,
                   "_manifest.json")
    from catalog import Catalog, CatalogError
    with pytest.raises(CatalogError, match=field):  # what the app's tree viewer reads through
        Catalog(traces).all_runs()


@pytest.mark.parametrize("content,words", [
    ("", ["holds no rows"]),
    ('{"text": "no task id"}\n', ["'task_id'", "line 1"]),
    ('{"task_id": 11,\n', ["not valid JSON", "line 1"]),
    (b'{"task_id": 11, "text": "\xff\xfe"}\n', ["not valid UTF-8"]),
    ("[1, 2]\n", ["not a JSON object"]),
])
def test_bad_benchmark_files_are_one_line_naming_the_file(pristine, tmp_path, content, words):
    bench = tmp_path / "benchmarks"
    shutil.copytree(BENCHMARKS, bench, ignore=shutil.ignore_patterns("*.gz"))
    target = bench / "mbpp" / "mbpp.jsonl"
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line_error(run("capture.cli", *CAP, "--limit", "1", "--out", tmp_path / "x",
                       "--benchmarks", bench), "mbpp.jsonl", *words)
    one_line_error(run("analysis.evaluate_cli", "--traces", pristine[0], "--benchmarks", bench),
                   "mbpp.jsonl", *words)


def test_train_tiny_refuses_a_symlink_out_before_training(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    start = time.monotonic()
    r = run("training.cli:train_tiny", "--model", "tiny-olmoe", "--out", tmp_path / "link",
            "--force", "--steps", "2000", timeout=120)
    one_line_error(r, "symbolic link")
    assert time.monotonic() - start < 60 and (tmp_path / "link").is_symlink()


# --- 9. hangs ----------------------------------------------------------------------------------
def test_an_unreachable_ray_address_fails_fast(pristine, tmp_path):
    pytest.importorskip("ray")
    start = time.monotonic()
    r = run("capture.cli", *CAP, "--limit", "1", "--out", tmp_path / "x", "--ray-address",
            "127.0.0.1:1", timeout=120)
    one_line_error(r, "127.0.0.1:1", "--ray-address")
    r = run("replay.cli", "--traces", copy(pristine, tmp_path), "--ranking", "router", "--budget",
            "8", "--no-progress", "--ray-address", "127.0.0.1:1", timeout=120)
    one_line_error(r, "127.0.0.1:1", "--ray-address")
    assert time.monotonic() - start < 110


def test_workers_are_capped_at_the_prompts_and_cpus(capsys):
    from cluster import cap_workers
    assert cap_workers(999, 1, "cpu") == 1
    assert "capped at 1" in capsys.readouterr().err
    assert cap_workers(999, 10_000, "cpu") == (os.cpu_count() or 1)
    assert cap_workers(999, 3, "cuda", local=False) == 3
    assert cap_workers(2, 10, "cpu", local=False) == 2 and cap_workers(0, 10, "cpu") == 0


@pytest.mark.parametrize("module,args,words", [
    ("replay.cli", ["--workers", "-2"], ["--workers -2"]),
    ("capture.cli", ["--workers", "-2"], ["--workers -2"]),
    ("capture.cli", ["--max-new-tokens", "99999999999999999999"], ["--max-new-tokens", "1000000"]),
    ("capture.cli", ["--seed", "99999999999999999999"], ["--seed"]),
    ("capture.cli", ["--batch-size", "100000"], ["--batch-size"]),
    ("capture.cli", ["--temperature", "inf"], ["--temperature"]),
])
def test_numeric_options_are_bounded(pristine, tmp_path, module, args, words):
    extra = {"capture.cli": [*CAP[:4], "--out", tmp_path / "x"],
             "replay.cli": ["--traces", pristine[0], "--no-progress"]}[module]
    one_line_error(run(module, *extra, *args, timeout=120), *words)


def test_a_config_file_cannot_ask_for_absurd_numbers(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("max_new_tokens = 99999999999999999999\n")
    one_line_error(run("capture.cli", *CAP[:4], "--config", config, "--out", tmp_path / "x",
                       timeout=120), "--max-new-tokens", "out of range")


# --- 10. errors name the file ------------------------------------------------------------------
def test_a_corrupt_parquet_page_is_named_by_query(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    part = sorted(traces.glob("trees/**/part-*.parquet"))[0]
    data = bytearray(part.read_bytes())
    data[4:44] = b"\xff" * 40  # the first page header, past the magic bytes
    part.write_bytes(bytes(data))
    one_line_error(run("analysis.query_cli", "SELECT * FROM trees", "--traces", traces,
                       "--format", "json"), part.name, "recapture")


def test_a_full_disk_names_the_quality_file(pristine, tmp_path, monkeypatch):
    from analysis import quality
    from catalog import Catalog, atomic
    traces = copy(pristine, tmp_path)
    run_ = Catalog(traces).runs()[0]

    def full(path, table):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic, "write_table", full)
    with pytest.raises(OSError) as caught:
        quality.write(run_, pa.table({"a": [1]}))
    message = str(caught.value)
    assert "part-0.parquet" in message and "No space left" in message and "\n" not in message


# --- 2. the dashboard's shared cache is computed on a pristine connection --------------------
def test_cached_frames_never_see_a_sessions_connection(pristine, tmp_path):
    from analysis import summaries
    from app import data
    traces = copy(pristine, tmp_path)
    summaries.ensure(traces, workers=1)
    root = str(traces)
    version = data.dataset_version(traces)
    hacked = data.connection(root, version, None)  # the first visitor's own connection
    hacked.execute("CREATE OR REPLACE VIEW trees AS SELECT 'tiny-olmoe' AS model, 'HACKED' AS "
                   "bench, 'r' AS run, 'evaluation' AS role, 0 AS prompt_index, 1.0 AS "
                   "accepted_length, [1] AS unique_experts, [1] AS experts_loaded, NULL AS budget")
    hacked.execute("CREATE OR REPLACE VIEW summary_layers AS SELECT 1 AS evil")
    overview = data.overview(root, version)
    assert "HACKED" not in overview["bench"].to_list() and overview["trees"].sum() > 1
    tails = data.frame("tails", root, version, ("evaluation",))
    assert len(tails) and "evil" not in tails.columns
