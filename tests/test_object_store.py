"""Traces on an object store (``s3://bucket/prefix``), end to end through the real CLIs against
moto's S3 server on 127.0.0.1: the same tables as on a local folder, the manifest as the commit
point, resume after a killed capture, one writer at a time (a lease object created with a
conditional put), and one-line errors for bad URIs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import S3_BUCKET as BUCKET  # the bucket of the s3 fixture

from moe_spec.analysis import evaluate_cli, query_cli
from moe_spec.analysis import report as report_cli
from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import location, schema
from moe_spec.replay import cli as replay_cli

pytestmark = pytest.mark.slow  # Ray, S3 servers; scripts/test.sh --fast leaves it out

pytest.importorskip("moto.server", reason="moto[server] is a dev dependency")

TIMINGS = {"draft_seconds", "verify_seconds", "wall_seconds"}
CAP = ["--limit", "3", "--max-new-tokens", "8", "--no-progress", "--threads", "1"]
REPLAY = ["--ranking", "router", "oracle", "--budget", "8,16", "--no-progress", "--threads", "1"]


def comparable(table):
    keep = [c for c in table.column_names if c not in TIMINGS]
    order = [c for c in ("prompt_index", "step", "layer", "node") if c in keep]
    return table.select(keep).sort_by([(c, "ascending") for c in order])


def run_table(root, table: str, run: str):
    """One run's rows of a trace table, read through the catalog's own reader."""
    from moe_spec.catalog import run_dir
    return comparable(location.read_table(run_dir(location.root(root), table, "tiny-olmoe",
                                                  "mbpp", run)))


def query(capsys, traces: str, sql: str) -> list[dict]:
    capsys.readouterr()
    assert query_cli.main(["--traces", traces, "--format", "json", "--role", "all", sql]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def both(s3, tmp_path_factory):
    """The same capture and replay into a local folder and onto the object store."""
    local = str(tmp_path_factory.mktemp("local"))
    remote = f"s3://{BUCKET}/e2e"
    for root in (local, remote):
        assert capture_cli.main([*CAP, "--out", root, "--run", "r1"]) == 0
        assert replay_cli.main(["--traces", root, *REPLAY]) == 0
    return local, remote


def test_capture_to_s3_writes_the_tables_a_local_capture_writes(both, s3):
    local, remote = both
    for table in schema.TRACE_TABLES:
        assert run_table(remote, table, "r1").equals(run_table(local, table, "r1")), table
    manifest = json.loads(s3.cat_file(f"{BUCKET}/e2e/runs/model=tiny-olmoe/bench=mbpp/run=r1/"
                                      f"{schema.MANIFEST}"))
    assert manifest["status"] == "complete" and manifest["prompts_done"] == 3
    assert not [k for k in s3.find(f"{BUCKET}/e2e") if k.endswith(".lock")]  # leases released


def test_replay_and_query_over_s3_views_equal_local(both, capsys):
    local, remote = both
    sql = ("SELECT * EXCLUDE (config, block, committed_at) FROM replay_open "
           "ORDER BY ranking, coverage, budget, layer, prompt_index, step")
    got, want = query(capsys, remote, sql), query(capsys, local, sql)
    assert got and got == want
    sql = "SELECT run, role, count(*) AS trees, avg(accepted_length) AS tau FROM trees GROUP BY ALL"
    assert query(capsys, remote, sql) == query(capsys, local, sql)


def test_report_and_evaluate_on_s3(both, s3, tmp_path, capsys):
    local, remote = both
    assert report_cli.main(["--traces", remote, "--out", str(tmp_path / "r"), "--threads",
                            "1"]) == 0
    assert (tmp_path / "r" / "tiny-olmoe_mbpp.html").stat().st_size > 10_000
    assert s3.find(f"{BUCKET}/e2e/summaries")  # routing summaries written beside the traces
    for root in (local, remote):
        assert evaluate_cli.main(["--traces", root, "--threads", "1"]) == 0
    sql = "SELECT * FROM quality ORDER BY prompt_index"
    assert query(capsys, remote, sql) == query(capsys, local, sql)
    sql = "SELECT * FROM summary_layers ORDER BY layer"
    assert report_cli.main(["--traces", local, "--out", str(tmp_path / "l"), "--threads",
                            "1"]) == 0
    assert query(capsys, remote, sql) == query(capsys, local, sql)


def test_the_app_starts_on_an_s3_root(both, monkeypatch):
    from streamlit.testing.v1 import AppTest
    app = os.path.join(os.path.dirname(capture_cli.__file__), "..", "app", "main.py")
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", both[1]])
    at = AppTest.from_file(app, default_timeout=180)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("runs under" in c.value and "s3://" in c.value for c in at.sidebar.caption)


def test_killed_capture_resumes_from_its_parts_in_a_second_process(both, s3):
    """SIGKILL after the first prompt's parts land: the manifest still says running, the dead
    writer's lease stays until it expires (MOESPEC_LEASE_SECONDS=2), then the same command
    resumes, reuses the parts and ends with the tables of an uninterrupted capture."""
    remote = f"s3://{BUCKET}/killed"
    args = [*CAP, "--out", remote, "--run", "r1"]
    proc = subprocess.Popen([sys.executable, "-m", "moe_spec.capture.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seqs = f"{BUCKET}/killed/sequences/model=tiny-olmoe/bench=mbpp/run=r1"
    runs = f"{BUCKET}/killed/runs/model=tiny-olmoe/bench=mbpp/run=r1"
    deadline = time.time() + 120
    while time.time() < deadline and not (s3.exists(seqs) and s3.ls(seqs, refresh=True)):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = json.loads(s3.cat_file(f"{runs}/{schema.MANIFEST}"))
    assert manifest["status"] == "running"  # never complete with parts missing
    assert s3.exists(f"{runs}/.lock")  # the dead writer's lease, left behind
    done_before = len(s3.ls(seqs, refresh=True))
    assert 1 <= done_before < 3
    r = subprocess.run([sys.executable, "-m", "moe_spec.capture.cli", *args], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"({done_before} resumed)" in r.stdout
    for table in schema.TRACE_TABLES:
        assert run_table(remote, table, "r1").equals(run_table(both[1], table, "r1")), table
    assert not s3.exists(f"{runs}/.lock")


def test_a_second_writer_of_a_run_is_refused_in_one_line(s3, capsys):
    """A live writer holds the run's lease (renewed while held): a capture of the same run is
    refused in one line; once the lease is released the same command runs."""
    from moe_spec.catalog.writer import RunWriter
    remote = f"s3://{BUCKET}/busy"
    holder = RunWriter(location.root(remote), "tiny-olmoe", "mbpp", "r1")
    holder.lock()
    try:
        time.sleep(2.5)  # past the lease's lifetime: renewal keeps it
        code = capture_cli.main([*CAP[:1], "1", *CAP[2:], "--out", remote, "--run", "r1"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "being written by another capture" in err and ".lock is held by" in err
    finally:
        holder.close()
    assert not s3.exists(f"{BUCKET}/busy/runs/model=tiny-olmoe/bench=mbpp/run=r1/.lock")


def test_lease_is_exclusive_and_an_expired_one_is_taken_over_once(s3):
    from filelock import Timeout
    path = location.root(f"s3://{BUCKET}/lease") / ".lock"
    a, b, c = (location.Lease(path, seconds=1) for _ in range(3))
    a.acquire(timeout=0)
    with pytest.raises(Timeout):
        b.acquire(timeout=0)
    a._stop.set()  # a dies: nobody renews its lease
    a._thread.join()
    time.sleep(1.2)
    b.acquire(timeout=0)  # expired: taken over with If-Match on its ETag
    with pytest.raises(Timeout):
        c.acquire(timeout=0)
    a._thread = None
    a.release()  # the dead writer's late release leaves b's lease alone
    assert json.loads(s3.cat_file(location.fs_path(path)))["owner"] == b.owner
    b.release()
    assert not s3.exists(location.fs_path(path))


@pytest.mark.parametrize("uri, message", [
    ("gs://bucket/x", "unknown storage scheme gs://"),
    ("s3://", "names no bucket"),
    ("s3://no-such-bucket/x", "bucket 'no-such-bucket' of s3://no-such-bucket/x does not exist"),
])
def test_bad_uris_are_one_line(s3, capsys, uri, message):
    for main, flag in ((query_cli.main, "--traces"), (capture_cli.main, "--out"),
                       (replay_cli.main, "--traces"), (evaluate_cli.main, "--traces"),
                       (report_cli.main, "--traces")):
        argv = [flag, uri] + (["SELECT 1"] if main is query_cli.main else [])
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def test_storage_options_file_sets_the_endpoint(s3, tmp_path, capsys, monkeypatch):
    """Endpoint and credentials from --storage-options alone (no AWS_ENDPOINT_URL)."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    options = tmp_path / "s3.toml"
    options.write_text(f'endpoint_url = "{endpoint}"\nkey = "testing"\nsecret = "testing"\n')
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3.pipe(f"{BUCKET}/opts/x.parquet", b"")  # the prefix exists
    try:
        assert query_cli.main(["--traces", f"s3://{BUCKET}/opts", "--storage-options",
                               str(options), "--schema"]) == 0
        assert "no tables" in capsys.readouterr().out
    finally:
        location.use_storage_options(None)
    bad = tmp_path / "bad.toml"
    bad.write_text("endpoint_url = [\n")
    assert query_cli.main(["--traces", f"s3://{BUCKET}/opts", "--storage-options", str(bad),
                           "SELECT 1"]) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    location.use_storage_options(None)


def test_local_roots_stay_plain_paths(tmp_path):
    from pathlib import Path
    assert type(location.root(str(tmp_path))) is type(Path(tmp_path))
    assert location.root(f"file://{tmp_path}") == tmp_path
    assert not location.is_remote(tmp_path)
