"""Scale-out on a local Ray cluster (num_cpus=2): capture and replay with 2 workers give the
single-process tables, resume works across worker counts, and concurrent writers are refused."""

import subprocess
import sys

import duckdb
import pyarrow.parquet as pq
import pytest

from moe_spec.capture import cli as capture_cli
from moe_spec.replay import cli as replay_cli

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # Ray, S3 servers; scripts/test.sh --fast leaves it out

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "10", "--no-progress",
       "--threads", "1"]
TIMINGS = {"draft_seconds", "verify_seconds", "wall_seconds"}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def tables(root, run, name):
    t = pq.read_table(root / name / "model=tiny-olmoe" / "bench=mbpp" / f"run={run}")
    keep = [c for c in t.column_names if c not in TIMINGS]
    sort = [c for c in ("prompt_index", "step", "layer", "node") if c in keep]
    return t.select(keep).sort_by([(c, "ascending") for c in sort])


def test_two_workers_write_the_single_process_tables_and_resume_across_counts(tmp_path):
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(tmp_path), "--run", "one"]) == 0
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(tmp_path), "--run", "two",
                             "--workers", "2"]) == 0
    for name in ("sequences", "trees", "nodes", "routing", "moe_io"):
        assert tables(tmp_path, "one", name).equals(tables(tmp_path, "two", name)), name
    # resume across worker counts: drop a prompt of the 2-worker run, finish it with 1 process
    for table in ("sequences", "trees", "nodes", "routing", "moe_io"):
        for p in (tmp_path / table).rglob("run=two/part-000002-*.parquet"):
            p.unlink()
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(tmp_path), "--run", "two"]) == 0
    for name in ("sequences", "trees", "routing"):
        assert tables(tmp_path, "one", name).equals(tables(tmp_path, "two", name)), name


def test_replay_with_two_workers_equals_single_process(tmp_path):
    traces = tmp_path / "t"  # results go beside it (--out inside a traces root is refused)
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(traces), "--run", "e"]) == 0
    args = ["--traces", str(traces), "--ranking", "router", "previous", "oracle", "--budget",
            "16,32", "--no-progress"]
    assert replay_cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    assert replay_cli.main([*args, "--out", str(tmp_path / "b"), "--workers", "2"]) == 0
    keys = "prompt_index, step, layer, ranking, coverage, budget"
    a, b = (duckdb.sql(f"SELECT * EXCLUDE (config, block) FROM read_parquet('{tmp_path / d}/"
                       f"replay_open/**/*.parquet', hive_partitioning=true) ORDER BY {keys}").pl()
            for d in ("a", "b"))
    assert a.height == b.height > 0
    assert a.drop("rse", "token_error").equals(b.drop("rse", "token_error"))
    assert (a["rse"] - b["rse"]).abs().max() < 1e-12
    closed = ["--traces", str(traces), "--mode", "closed", "--ranking", "router", "--budget",
              "16", "--coverage", "substitution", "--no-progress"]
    assert replay_cli.main([*closed, "--out", str(tmp_path / "c")]) == 0
    assert replay_cli.main([*closed, "--out", str(tmp_path / "d"), "--workers", "2"]) == 0
    c, d = (duckdb.sql(f"SELECT * EXCLUDE (config, block) FROM read_parquet('{tmp_path / x}/"
                       "replay_closed/**/*.parquet', hive_partitioning=true) ORDER BY "
                       "prompt_index, step").pl() for x in ("c", "d"))
    assert c.equals(d)


def test_a_second_capture_of_a_running_run_is_refused_in_one_line(tmp_path):
    from filelock import FileLock
    assert capture_cli.main([*CAP, "--limit", "1", "--out", str(tmp_path), "--run", "r"]) == 0
    lock = FileLock(str(next(tmp_path.glob("runs/**/run=r")) / ".lock"))
    with lock:  # as a capture writing this run holds it
        r = subprocess.run([sys.executable, "-m", "moe_spec.capture.cli", *CAP, "--limit", "2", "--out",
                            str(tmp_path), "--run", "r"], capture_output=True, text=True)
    assert r.returncode == 2 and "is being written by another capture" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert len(list(tmp_path.glob("sequences/**/run=r/part-*.parquet"))) == 1  # nothing lost


def test_a_failed_actor_is_reported_in_one_line():
    from moe_spec.cluster import actor_failure
    died = ray.exceptions.RayActorError(error_msg=(
        "The actor died because of an error raised in its creation task, ray::CaptureWorker\n"
        "Traceback (most recent call last):\n  File \"capture/distributed.py\", line 44\n"
        "botocore.exceptions.NoCredentialsError: Unable to locate credentials\n"))
    assert actor_failure(died) == "botocore.exceptions.NoCredentialsError: Unable to locate " \
                                  "credentials"
    task = ray.exceptions.RayTaskError("manifest", "Traceback ...\nOSError: x", OSError("no disk"))
    assert actor_failure(task) == "OSError: no disk"
