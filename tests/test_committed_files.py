"""What is committed is what is read (issue 38): stray, duplicated, uncommitted or symlinked
files never change an answer, and a committed file that changed is named in one line."""

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
from helpers import call, one_line_error, run

COUNTS = ("SELECT (SELECT count(*) FROM trees) AS trees, (SELECT count(*) FROM routing) AS "
          "routing, (SELECT round(sum(list_sum(router_probs)), 3) FROM routing) AS mass, "
          "(SELECT count(*) FROM replay_open) AS results")


@pytest.fixture(scope="module")
def pristine(replayed):
    """A small capture with its replay results inside the traces (the session's, read-only:
    :func:`copy` it to change it), and what query answers."""
    traces = replayed[0]
    q = call("moe_spec.analysis.query_cli", COUNTS, "--traces", traces, "--format", "csv")
    assert q.returncode == 0, q.stderr
    return traces, q.stdout


def copy(pristine, tmp_path):
    traces = tmp_path / "t"
    shutil.copytree(pristine[0], traces, symlinks=True)
    return traces


def counts(traces):
    return call("moe_spec.analysis.query_cli", COUNTS, "--traces", traces, "--format", "csv")


def first(traces, pattern):
    return sorted(traces.glob(pattern))[0]


@pytest.mark.parametrize("stray", [
    "trees/model=tiny-olmoe/bench=mbpp/run=r/evil.parquet",
    "trees/model=tiny-olmoe/bench=mbpp/run=r/part-000000-0001.parquet",  # a capture-like name
    "routing/model=tiny-olmoe/bench=mbpp/run=r/part-000009-0000.parquet",
    "trees/model=tiny-olmoe/bench=mbpp/run=other/part-000000-0000.parquet",  # no manifest
])
def test_stray_files_in_trace_folders_change_nothing(pristine, tmp_path, stray):
    traces = copy(pristine, tmp_path)
    table = stray.split("/")[0]
    source = first(traces, f"{table}/**/part-000000-0000.parquet")
    (traces / stray).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, traces / stray)
    r = counts(traces)
    assert r.returncode == 0 and r.stdout == pristine[1], r.stderr


def test_a_stray_result_part_changes_nothing(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    block = first(traces, "replay_open/**/block=*")
    shutil.copy(first(block, "part-*.parquet"), block / "part-000007.parquet")
    r = counts(traces)
    assert r.returncode == 0 and r.stdout == pristine[1], r.stderr


def rewrite(part, table):
    pq.write_table(table, part)


@pytest.mark.parametrize("damage", ["zero_rows", "missing_column", "flipped_bytes", "truncated"])
def test_a_changed_committed_part_is_named_in_one_line(pristine, tmp_path, damage):
    traces = copy(pristine, tmp_path)
    part = first(traces, "routing/**/part-000000-0000.parquet")
    t = pq.read_table(part)
    if damage == "zero_rows":
        rewrite(part, t.slice(0, 0))
    elif damage == "missing_column":
        rewrite(part, t.drop_columns(["topk_weights"]))
    elif damage == "truncated":
        part.write_bytes(part.read_bytes()[:-50])
    else:  # 16 flipped bytes in the middle of a data page: same size, readable, other values
        data = bytearray(part.read_bytes())
        middle = len(data) // 2
        for i in range(middle, middle + 16):
            data[i] ^= 0x01
        part.write_bytes(bytes(data))
    one_line_error(counts(traces), part.name)
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "8",
                        "--no-progress"), part.name)


def test_a_symlinked_run_folder_is_refused(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    folder = traces / "trees" / "model=tiny-olmoe" / "bench=mbpp" / "run=r"
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder, elsewhere)
    os.symlink(elsewhere, folder)
    one_line_error(counts(traces), "symbolic link")


def edit_manifest(traces, **fields):
    path = first(traces, "runs/**/_manifest.json")
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, **fields}))


@pytest.mark.parametrize("fields", [dict(num_experts=4), dict(prompts_total=5),
                                    dict(top_k=2), dict(moe_layers=[0, 1])])
def test_manifest_facts_edited_after_commit_are_refused(pristine, tmp_path, fields):
    traces = copy(pristine, tmp_path)
    edit_manifest(traces, **fields)
    one_line_error(counts(traces), "_manifest.json", "edited after the run was committed")
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "8",
                        "--no-progress"), "_manifest.json")
    one_line_error(call("moe_spec.analysis.report", "--traces", traces, "--out", tmp_path / "rep"),
                   "_manifest.json")


def test_manifest_facts_are_checked_against_the_data(pristine, tmp_path, monkeypatch):
    """A run without a commit record (captured before trace schema 5) is read as found on
    --allow-legacy only; its manifest's N is still checked against its routing."""
    traces = copy(pristine, tmp_path)
    path = first(traces, "runs/**/_manifest.json")
    manifest = json.loads(path.read_text())
    for key in ("files", "commit_digest"):
        manifest.pop(key)
    path.write_text(json.dumps({**manifest, "num_experts": 4, "schema_version": 4}))
    args = ("--traces", traces, "--ranking", "router", "--budget", "4", "--no-progress", "--out",
            tmp_path / "res")
    one_line_error(run("moe_spec.replay.cli", *args), "predates committed file lists",
                   "--allow-legacy")
    monkeypatch.setenv("MOESPEC_ALLOW_LEGACY", "1")
    r = run("moe_spec.replay.cli", *args)
    warning, error = r.stderr.strip().splitlines()  # the run named, then the refusal
    assert r.returncode == 2 and "warning: run r " in warning and "num_experts 4" in error


def test_query_out_inside_the_traces_is_refused(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    target = first(traces, "trees/**/part-000000-0000.parquet")
    before = target.read_bytes()
    for out in (target, target.parent / "part-000001-0000.parquet", traces / "x.csv"):
        one_line_error(call("moe_spec.analysis.query_cli", "SELECT * FROM trees", "--traces", traces,
                            "--format", "parquet", "--out", out), "inside the traces folder")
    assert target.read_bytes() == before
    assert counts(traces).stdout == pristine[1]


def test_verification_is_cached_per_file_version(pristine, tmp_path, monkeypatch):
    """A file is hashed once per version: a second read of the same files hashes nothing; a
    rewritten file (same bytes, new version) is hashed again."""
    from moe_spec.catalog import commit
    traces = copy(pristine, tmp_path)
    monkeypatch.setenv(commit.CACHE_ENV, str(tmp_path / "verified.sqlite"))
    hashed = []
    real = commit.sha256_of
    monkeypatch.setattr(commit, "sha256_of", lambda p: hashed.append(p) or real(p))
    from moe_spec.analysis.sql import connect
    connect(traces).execute("SELECT count(*) FROM trees").fetchall()
    assert hashed, "nothing was verified"
    hashed.clear()
    connect(traces).execute("SELECT count(*) FROM trees").fetchall()
    assert hashed == []
    part = first(traces, "trees/**/part-000000-0000.parquet")
    part.write_bytes(part.read_bytes())  # a new version of the same bytes
    connect(traces).execute("SELECT count(*) FROM trees").fetchall()
    assert [p.name for p in hashed] == [part.name]


def test_a_run_whose_manifest_was_deleted_is_refused_not_skipped(pristine, tmp_path):
    """Hypothesis found it: with the manifest gone, query answered 0 trees with exit 0."""
    traces = copy(pristine, tmp_path)
    first(traces, "runs/**/_manifest.json").unlink()
    for r in (counts(traces), call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router",
                                   "--budget", "8", "--no-progress")):
        one_line_error(r, "no _manifest.json", "recapture")
    lock = first(traces, "runs/**/part-0.parquet").parent / ".lock"
    for part in traces.glob("*/model=*/bench=*/run=r/*.parquet"):
        part.unlink()  # a run being started: its folders, a lock, no parts and no manifest yet
    lock.write_text("")
    r = call("moe_spec.analysis.query_cli", "SELECT count(*) AS n FROM trees", "--traces", traces,
             "--format", "csv")
    assert r.returncode == 0 and r.stdout.split() == ["n", "0"], r.stderr


# --- issue 41: manifests and SQL that used to raise or hang ----------------------------------
@pytest.mark.parametrize("content", ["[" * 100000, json.dumps(dict(model="m" * 300))])
def test_pathological_manifests_are_one_line(pristine, tmp_path, content):
    traces = copy(pristine, tmp_path)
    path = first(traces, "runs/**/_manifest.json")
    if content.startswith("{"):
        manifest = json.loads(path.read_text())
        manifest.pop("commit_digest")  # (the long name is refused before the digest)
        content = json.dumps({**manifest, **json.loads(content)})
    path.write_text(content)
    one_line_error(counts(traces), "_manifest.json")
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "8",
                        "--no-progress"), "_manifest.json")


@pytest.mark.parametrize("sql", ["UPDATE EXTENSIONS", "SELECT 1; UPDATE EXTENSIONS",
                                 "SELECT system.main.repeat('x', 3000000000)",
                                 'SELECT "system".main.repeat(\'x\', 3000000000)',
                                 "SELECT SYSTEM . main.repeat('x', 3000000000)"])
def test_unknown_statements_are_refused_by_name(pristine, sql):
    """Refused before anything runs: the system catalog (bare, DuckDB tokenizes it as a keyword)
    would go around repeat's size guard and build a 3 GB string."""
    one_line_error(call("moe_spec.analysis.query_cli", sql, "--traces", pristine[0]), "query: error:",
                   *(["system catalog"] if "system" in sql.lower() else []))


@pytest.mark.parametrize("sql,limit,words", [
    ("SELECT length(repeat('x', 3000000000)) AS n", "60", ("repeat", "refused")),
    ("SELECT count(*) FROM range(1000000000000)", "1", ("1 s limit", "--timeout")),
    ("SELECT length(string_agg(repeat('x', 100000000), '')) FROM range(30)", "600",
     ("memory limit", "--memory-limit")),
])
def test_user_sql_is_bounded_in_time_and_memory(pristine, sql, limit, words):
    r = run("moe_spec.analysis.query_cli", sql, "--traces", pristine[0], "--timeout", limit,
            "--memory-limit", "512MB", timeout=900)
    one_line_error(r, *words)


def test_user_sql_cannot_read_the_spill_folder(pristine, tmp_path, monkeypatch):
    """DuckDB adds its spill folder (``.tmp`` under the working directory) to the folders a
    confined connection may read; the views' connection has none."""
    secret = tmp_path / ".tmp" / "secret.csv"
    secret.parent.mkdir()
    secret.write_text("a\n42\n")
    monkeypatch.chdir(tmp_path)
    from moe_spec.analysis.sql import connect
    con = connect(pristine[0])
    assert [a.rstrip("/") for a in con.execute(
        "SELECT current_setting('allowed_directories')").fetchall()[0][0]] == \
        [str(pristine[0].resolve())]
    r = call("moe_spec.analysis.query_cli", f"SELECT * FROM read_csv('{secret}')", "--traces",
             pristine[0])
    assert r.returncode == 2 and "42" not in r.stdout, r.stdout


def test_bf16_hidden_states_decode_in_sql_as_the_reader_decodes_them(pristine):
    import numpy as np

    from moe_spec.analysis.sql import connect
    from moe_spec.catalog.reader import matrix
    con = connect(pristine[0])
    t = con.execute("SELECT hidden, bf16_list(hidden) AS h FROM moe_io ORDER BY step, layer, "
                    "node LIMIT 50").to_arrow_table()
    assert t.num_rows == 50
    assert np.array_equal(matrix(t["hidden"]), matrix(t["h"]))


def test_a_string_schema_version_is_named_as_such(pristine, tmp_path):
    traces = copy(pristine, tmp_path)
    edit_manifest(traces, schema_version="4")
    r = counts(traces)
    one_line_error(r, "schema_version is '4', not a whole number")
    assert "this tool reads" not in r.stderr


def test_a_batch_names_a_prompt_that_stopped_before_its_first_pass(pristine):
    """issue 41.8: a virtual batch holding a prompt with no verification pass (its first token
    was EOS) has no rows to name it: its id comes from the manifest, never a KeyError."""
    from moe_spec.catalog import Catalog
    from moe_spec.replay.virtual_batch import BatchSource
    run = Catalog(pristine[0]).runs()[0]
    source = BatchSource(run, 2, 0)
    first = source.members(0)
    only_one = {first[0]: "seen"}  # the other prompt produced no rows
    name = source.name(0, only_one)
    ids = run.manifest["prompt_ids"]
    assert name.split("+") == [only_one.get(p) or ids[p] for p in first]
