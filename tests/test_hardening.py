"""Hostile input: corrupt traces, read-only SQL, stale and partial results, bad options.

Every case ends in the exact result or one clear line naming the problem, with exit code 2:
never a traceback, a NaN, or exit 0 with wrong data."""

import json
import random
import shutil
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import recommit
from helpers import CAP, QUERY, call, one_line_error
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moe_spec.capture import cli as capture_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A small capture, its replay results, query output and report, computed once."""
    root = tmp_path_factory.mktemp("pristine")
    traces = root / "traces"
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(traces), "--run", "r"]) == 0
    r = call("moe_spec.replay.cli", "--traces", traces, "--run", "r", "--ranking", "router", "--budget",
             "16", "--no-progress", "--out", root / "results")
    assert r.returncode == 0, r.stderr
    q = call("moe_spec.analysis.query_cli", QUERY, "--traces", traces, "--format", "csv")
    assert q.returncode == 0
    return traces, results_of(root / "results"), q.stdout


def results_of(folder):
    t = pq.read_table(folder / "replay_open").to_pandas()
    return t.sort_values(["prompt_index", "step", "layer", "coverage"]).reset_index(drop=True)[
        ["prompt_index", "step", "layer", "coverage", "rse", "token_error"]]


# --- 1. silent NaN -------------------------------------------------------------------------------
def test_absurd_values_in_a_trace_are_caught_naming_the_file(pristine, tmp_path):
    traces = tmp_path / "t"
    shutil.copytree(pristine[0], traces)
    part = sorted((traces / "moe_io").rglob("part-000000-*.parquet"))[0]
    t = pq.read_table(part)
    from moe_spec.catalog.reader import bfloat16_bits, matrix
    hidden = matrix(t["hidden"]) * 1e25  # what flipped exponent bits look like
    from moe_spec.catalog.writer import list_column as _lists
    t = t.set_column(t.schema.get_field_index("hidden"), "hidden",
                     _lists(bfloat16_bits(hidden), pa.uint16()))
    pq.write_table(t, part)
    r = call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--no-progress")
    one_line_error(r, part.name, "commit record")  # the file is not the one captured
    recommit(traces)  # and as if a capture had written these values: its values are checked
    r = call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--no-progress")
    one_line_error(r, part.name, "non-finite or out-of-range")


# --- 2. SQL is read-only and confined to the traces ----------------------------------------------
@pytest.mark.parametrize("sql,words", [
    ("SELECT * FROM read_text('/etc/passwd')", ["Permission"]),
    ("COPY (SELECT 1) TO '/tmp/moespec-evil.csv'", ["only read-only queries", "COPY"]),
    ("COPY (SELECT 1) TO 'TRACES/inside.csv'", ["only read-only queries"]),
    ("ATTACH '/tmp/moespec-evil.db'", ["only read-only queries"]),
    ("INSTALL httpfs", ["only read-only queries"]),
    ("CREATE OR REPLACE VIEW trees AS SELECT 1", ["only read-only queries"]),
    ("SET enable_external_access = true", ["only read-only queries"]),
    ("SELECT 1; DROP VIEW trees", ["only read-only queries"]),
])
def test_query_refuses_anything_but_a_read_only_query(pristine, sql, words):
    traces = pristine[0]
    r = call("moe_spec.analysis.query_cli", sql.replace("TRACES", str(traces)), "--traces", traces)
    one_line_error(r, *words)
    assert not (traces / "inside.csv").exists()
    assert call("moe_spec.analysis.query_cli", QUERY, "--traces", traces, "--format", "csv").stdout == \
        pristine[2]


def test_the_app_console_is_read_only_and_per_session(pristine, monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest
    app = str(Path(__file__).resolve().parent.parent / "app" / "main.py")
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(pristine[0])])
    a = AppTest.from_file(app, default_timeout=180)
    a.run()
    a.switch_page("screens/sql_console.py").run()
    a.text_area(key="sql_τ and experts by run").set_value(
        "CREATE OR REPLACE VIEW trees AS SELECT 42 AS evil").run()
    assert a.error and "only read-only queries" in a.error[0].value
    b = AppTest.from_file(app, default_timeout=180)  # another visitor
    b.run()
    b.switch_page("screens/sql_console.py").run()
    b.text_area(key="sql_τ and experts by run").set_value(
        "SELECT count(*) AS n FROM trees").run()
    assert not b.error and int(b.dataframe[0].value["n"][0]) > 1


def test_the_app_binds_to_localhost_by_default():
    from moe_spec.app.launch import parser
    assert parser().parse_args([]).host == "127.0.0.1"


@pytest.fixture
def launched(monkeypatch):
    """``workbench-app``'s main with Streamlit replaced by a recorder: the arguments it would
    have been started with (a run that gets that far), never a server."""
    from streamlit.web import cli as stcli
    started: list = []
    monkeypatch.setattr(stcli, "main", lambda: started.append(list(sys.argv)) or 0)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return started


@pytest.mark.parametrize("host", ["", " ", "::", "[::]", "*", "0"])
def test_the_app_refuses_an_empty_or_wildcard_host(launched, capsys, tmp_path, host):
    """``--host ""`` listened on every interface (Streamlit reads empty as all)."""
    from helpers import exit_code, one_line

    from moe_spec.app import launch
    code = exit_code(launch.main, ["--traces", str(tmp_path), "--host", host, "--headless"])
    one_line(capsys, code, "--host", "every interface", "0.0.0.0")
    assert not launched


def test_the_app_listens_everywhere_only_on_an_explicit_0000_with_a_warning(launched, capsys,
                                                                           tmp_path):
    from moe_spec.app import launch
    assert launch.main(["--traces", str(tmp_path), "--host", "0.0.0.0", "--headless"]) == 0
    assert "warning" in capsys.readouterr().err and "0.0.0.0" in launched[0]
    assert launch.main(["--traces", str(tmp_path), "--headless"]) == 0
    assert "warning" not in capsys.readouterr().err and "127.0.0.1" in launched[1]


@pytest.mark.parametrize("traces", ["/etc/passwd", "/dev/zero", "file"])
def test_the_app_refuses_traces_that_are_not_a_folder(launched, capsys, tmp_path, traces):
    from helpers import exit_code, one_line

    from moe_spec.app import launch
    if traces == "file":
        traces = tmp_path / "traces.txt"
        traces.write_text("not a folder")
    code = exit_code(launch.main, ["--traces", str(traces), "--headless"])
    one_line(capsys, code, "--traces", "not a folder")
    assert not launched


# --- 4. never destroy data -----------------------------------------------------------------------
def test_training_refuses_a_non_empty_folder_without_force(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("precious")
    r = call("moe_spec.training.cli:train_tiny", "--model", "tiny-olmoe", "--out", tmp_path / "model")
    one_line_error(r, "exists and is not empty", "--force")
    assert (tmp_path / "model" / "keep.txt").read_text() == "precious"
    r = call("moe_spec.training.cli:train_tiny", "--model", "tiny-olmoe")  # the shipped model's folder
    one_line_error(r, "exists and is not empty")


# --- 5. stale results ----------------------------------------------------------------------------
def test_results_follow_the_runs_prompts(pristine, tmp_path):
    traces = tmp_path / "t"
    shutil.copytree(pristine[0], traces)
    seq = traces / "sequences" / "model=tiny-olmoe" / "bench=mbpp" / "run=r"
    moved = tmp_path / "seq"
    shutil.move(seq, moved)
    r = call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--no-progress")
    one_line_error(r, "sequences", "part-000000-0000.parquet is missing")
    shutil.move(moved, seq)
    r = call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
             "--no-progress")
    assert r.returncode == 0 and "reused" not in r.stderr
    assert results_of(traces).equals(pristine[1])


# --- 6. partial results are not final ------------------------------------------------------------
def test_running_captures_and_interrupted_replays_are_not_shown(pristine, tmp_path):
    traces = tmp_path / "t"
    shutil.copytree(pristine[0], traces)
    manifest_path = next(traces.glob("runs/**/_manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "status": "running"}))
    r = call("moe_spec.analysis.query_cli", "SELECT count(*) AS n FROM trees", "--traces", traces,
             "--format", "csv")
    assert r.returncode == 0 and r.stdout.splitlines()[1] == "0"  # the running run is excluded
    manifest_path.write_text(json.dumps(manifest))
    assert call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
                "--no-progress").returncode == 0
    for config in traces.glob("replay_open/**/_config.json"):
        state = json.loads(config.read_text())
        state["blocks"][0]["status"] = "running"  # as if killed mid-sweep
        config.write_text(json.dumps(state))
    q = call("moe_spec.analysis.query_cli", "SELECT count(*) AS n FROM replay_open", "--traces", traces,
             "--format", "csv")
    assert q.returncode != 0 or q.stdout.splitlines()[1] == "0"


# --- the also-fix list ---------------------------------------------------------------------------
@pytest.mark.parametrize("module,args,words", [
    ("moe_spec.capture.cli", ["--max-new-tokens", "0"], ["--max-new-tokens 0", "at least 1"]),
    ("moe_spec.capture.cli", ["--limit", "-1"], ["--limit -1"]),
    ("moe_spec.capture.cli", ["--offset", "-1"], ["--offset -1"]),
    ("moe_spec.capture.cli", ["--temperature", "-0.5"], ["--temperature"]),
    ("moe_spec.replay.cli", ["--budget", "8:16:8:99"], ["cannot read --budget"]),
    ("moe_spec.replay.cli", ["--layers", "a,b"], ["cannot read --layers"]),
    ("moe_spec.replay.cli", ["--chunk-tree-layers", "0"], ["--chunk-tree-layers 0"]),
    ("moe_spec.replay.cli", ["--batch", "3"], ["--chunk-tree-layers"]),
    ("moe_spec.profiling.profile_target", ["--batches", "0"], ["must all be"]),
    ("moe_spec.profiling.profile_target", ["--batches", "x"], ["cannot read --batch-sizes"]),
    ("moe_spec.app.launch", ["--port", "99999"], ["not a port"]),
    ("moe_spec.training.cli:train_draft", ["--batch", "0"], ["--batch 0"]),
])
def test_bad_options_are_one_line(pristine, module, args, words):
    traces = pristine[0]
    extra = {"moe_spec.capture.cli": [*CAP[:4], "--out", traces.parent / "x"],
             "moe_spec.replay.cli": ["--traces", traces, "--no-progress"]}.get(module, [])
    one_line_error(call(module, *extra, *args, timeout=120), *words)


def test_unwritable_outputs_are_one_line(pristine, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    traces = pristine[0]
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "24",
                        "--out", blocker / "out", "--no-progress"), "cannot write")
    one_line_error(call("moe_spec.analysis.report", "--traces", traces, "--out", blocker / "r"),
                   "cannot write")
    one_line_error(call("moe_spec.analysis.query_cli", QUERY, "--traces", traces, "--out",
                        blocker / "q.csv", "--format", "csv"), "cannot write")


def test_a_traces_path_with_an_apostrophe_works(pristine, tmp_path):
    odd = tmp_path / "it's traces"
    shutil.copytree(pristine[0], odd)
    r = call("moe_spec.analysis.query_cli", QUERY, "--traces", odd, "--format", "csv")
    assert r.returncode == 0 and r.stdout == pristine[2]


@pytest.mark.parametrize("content", ["[]", "{}", '{"schema_version": 2}', "not json"])
def test_broken_manifests_are_one_line(pristine, tmp_path, content):
    traces = tmp_path / "t"
    shutil.copytree(pristine[0], traces)
    next(traces.glob("runs/**/_manifest.json")).write_text(content)
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--no-progress"), "_manifest.json")
    one_line_error(call("moe_spec.analysis.query_cli", QUERY, "--traces", traces), "_manifest.json")


def test_a_torn_result_config_is_one_line(pristine, tmp_path):
    traces = tmp_path / "t"
    shutil.copytree(pristine[0], traces)
    assert call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
                "--no-progress").returncode == 0
    next(traces.glob("replay_open/**/_config.json")).write_text('{"blocks": [')
    one_line_error(call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
                        "--no-progress"), "corrupt replay result config")


# --- the corruption property ---------------------------------------------------------------------
def corrupt(traces, kind: str, pick: int, rng: random.Random) -> str:
    """Damage one file of the traces; returns what was done (for the failure message)."""
    files = sorted(p for p in traces.rglob("*") if p.is_file() and (
        p.suffix == ".parquet" or p.name == "_manifest.json"))
    path = files[pick % len(files)]
    data = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(data[:rng.randrange(len(data))])
    elif kind == "flip":
        b = bytearray(data)
        for _ in range(8):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(b))
    elif kind == "delete":
        path.unlink()
    elif kind == "retype" and path.suffix == ".parquet":
        t = pq.read_table(path)
        names = [f.name for f in t.schema if f.name not in ("prompt_id",)]
        name = names[pick % len(names)]
        t = t.set_column(t.schema.get_field_index(name), name,
                         pa.array([str(v) for v in t[name].to_pylist()]))
        pq.write_table(t, path)
    return f"{kind} {path.relative_to(traces)}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["truncate", "flip", "delete", "retype"]),
       pick=st.integers(0, 10_000), seed=st.integers(0, 10_000))
@example(kind="delete", pick=3492, seed=0)  # the run's manifest: query answered 0 trees
def test_any_corruption_gives_the_exact_result_or_one_line(pristine, tmp_path_factory, kind,
                                                           pick, seed):
    traces_src, expected, query_out = pristine
    root = tmp_path_factory.mktemp("corrupt")
    traces = root / "traces"
    shutil.copytree(traces_src, traces)
    what = corrupt(traces, kind, pick, random.Random(seed))
    r = call("moe_spec.replay.cli", "--traces", traces, "--run", "r", "--ranking", "router", "--budget",
             "16", "--no-progress", "--out", root / "results")
    if r.returncode == 0:
        got = results_of(root / "results")
        assert got.equals(expected), what  # exit 0 means the exact result
        assert np.isfinite(got[["rse", "token_error"]].to_numpy()).all(), what
    else:
        one_line_error(r)
    q = call("moe_spec.analysis.query_cli", QUERY, "--traces", traces, "--format", "csv")
    if q.returncode == 0:
        assert q.stdout == query_out, what
    else:
        one_line_error(q)
    rep = call("moe_spec.analysis.report", "--traces", traces, "--out", root / "report")
    if rep.returncode == 0:
        html = next((root / "report").glob("*.html")).read_text()
        assert "NaN" not in html.split("<script")[0], what
    else:
        one_line_error(rep)

