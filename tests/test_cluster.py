"""A two-node Ray cluster on this machine (a head and a second raylet, each with one CPU slot,
a resource of its own and its own temp dir) running ``capture --workers 2`` and
``replay --workers 2`` through ``--ray-address``, with traces and results on an object store
(moto's S3 server on 127.0.0.1) and no folder the nodes share: the tables equal a single-process
run's (timings aside), and the actors ran on both nodes. The nodes start without the store's
AWS_* variables: the actors reach it only through the driver's ``--storage-options``.

One CPU slot per node and one per actor: two actors cannot both fit on one node, and the
driver's queue hands every idle actor a prompt, so both nodes work (checked below in Ray's
actor table)."""

import os
import shutil
import tempfile

import duckdb
import pytest
from conftest import S3_BUCKET

from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import location, run_dir, schema
from moe_spec.replay import cli as replay_cli

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # Ray, S3 servers; scripts/test.sh --fast leaves it out

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "3", "--max-new-tokens", "8",
       "--no-progress", "--threads", "1", "--run", "r"]
REPLAY = ["--ranking", "router", "oracle", "--budget", "8,16", "--no-progress", "--threads", "1"]
TIMINGS = {"draft_seconds", "verify_seconds", "wall_seconds"}
REMOTE = f"s3://{S3_BUCKET}/cluster"
STORE_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@pytest.fixture(scope="module")
def store_options(s3, tmp_path_factory) -> list[str]:
    """``--storage-options FILE.toml`` naming the store's endpoint and credentials."""
    path = tmp_path_factory.mktemp("store") / "s3.toml"
    path.write_text(f'endpoint_url = "{os.environ["AWS_ENDPOINT_URL"]}"\n'
                    f'key = "{os.environ["AWS_ACCESS_KEY_ID"]}"\n'
                    f'secret = "{os.environ["AWS_SECRET_ACCESS_KEY"]}"\n')
    return ["--storage-options", str(path)]


def on_store(main, argv: list[str]) -> int:
    """A CLI's exit status; the storage options it installed in this process removed after."""
    try:
        return main(argv)
    finally:
        location.use_storage_options(None)


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    """The address of a head node and a second raylet (its own CPU slot, a ``second`` resource
    and its own temp dir), started with the store's endpoint and credentials left out of their
    environment (which their workers inherit): as nodes started before anyone exported them.
    This process joins only through the CLIs' ``--ray-address``."""
    from ray.cluster_utils import Cluster
    with pytest.MonkeyPatch.context() as env:
        for name in STORE_ENV:
            env.delenv(name)
        c = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, resources={"head": 1}, include_dashboard=False))
        # a short temp dir: Ray's socket paths under it must stay within AF_UNIX's 107 bytes,
        # which pytest's own (under pytest-xdist: .../popen-gw1/...) can pass
        second = tempfile.mkdtemp(prefix="rn-")
        c.add_node(num_cpus=1, resources={"second": 1}, temp_dir=second)
        c.wait_for_nodes()
    yield c.address
    ray.shutdown()
    c.shutdown()
    shutil.rmtree(second, ignore_errors=True)


def nodes_of(actor_class: str) -> set[str]:
    """The node ids of every actor of ``actor_class`` this cluster has run (dead ones included),
    from the GCS actor table (the state API would need the dashboard)."""
    from ray._private import state
    return {a["Address"]["NodeID"] for a in state.actors().values()
            if a["ActorClassName"] == actor_class}


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def trace_table(root, table: str):
    t = location.read_table(run_dir(location.root(root), table, "tiny-olmoe", "mbpp", "r"))
    keep = [c for c in t.column_names if c not in TIMINGS]
    order = [c for c in ("prompt_index", "step", "layer", "node") if c in keep]
    return t.select(keep).sort_by([(c, "ascending") for c in order])


def replay_rows(root: str):
    """Every open-loop result under ``root`` (config and block ids aside), in a fixed order."""
    con = duckdb.connect()
    fs = location.duckdb_filesystem(location.root(root))
    if fs is not None:
        con.register_filesystem(fs)
    return con.sql(f"SELECT * EXCLUDE (config, block) FROM read_parquet('{root}/replay_open/**/"
                   "*.parquet', hive_partitioning=true) ORDER BY ranking, coverage, budget, "
                   "layer, prompt_index, step").pl()


@pytest.fixture(scope="module")
def captured(cluster, store_options, tmp_path_factory):
    """The same capture in one process into a local folder and on the two nodes onto S3."""
    local = str(tmp_path_factory.mktemp("one-process"))
    assert capture_cli.main([*CAP, "--out", local]) == 0
    assert on_store(capture_cli.main, [*CAP, "--out", REMOTE, *store_options, "--workers", "2",
                                       "--ray-address", cluster]) == 0
    return local


@pytest.mark.slow
def test_capture_on_two_nodes_onto_s3_writes_the_single_process_tables(captured, s3):
    for table in schema.TRACE_TABLES:
        assert trace_table(REMOTE, table).equals(trace_table(captured, table)), table
    assert len(alive_nodes()) == 2
    assert nodes_of("CaptureWorker") == alive_nodes()  # one actor on each node
    assert not [k for k in s3.find(f"{S3_BUCKET}/cluster") if k.endswith(".lock")]


@pytest.mark.slow
def test_replay_on_two_nodes_from_and_to_s3_equals_one_process(captured, cluster, store_options,
                                                               tmp_path):
    one = str(tmp_path / "replay")
    assert replay_cli.main(["--traces", captured, *REPLAY, "--out", one]) == 0
    remote_out = f"s3://{S3_BUCKET}/cluster-replay"
    assert on_store(replay_cli.main, ["--traces", REMOTE, *REPLAY, "--out", remote_out,
                                      *store_options, "--workers", "2", "--ray-address",
                                      cluster]) == 0
    a, b = replay_rows(one), replay_rows(remote_out)
    assert a.height == b.height > 0
    assert a.drop("rse", "token_error").equals(b.drop("rse", "token_error"))
    for column in ("rse", "token_error"):
        assert (a[column] - b[column]).abs().max() < 1e-12, column
    assert nodes_of("ReplayWorker") == alive_nodes()
