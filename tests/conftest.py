"""Shared fixtures. Tests run offline: no hub access, benchmarks from the shared folder."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from moe_spec.catalog import location  # noqa: E402
from moe_spec.moe import models  # noqa: E402

# the cores shared among pytest-xdist's workers (scripts/test.sh runs two): threads that spin
# against another worker's slow every test down
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))


# Session fixtures that capture or start a server: a test using one is end to end, marked
# ``slow`` here, so ``scripts/test.sh --fast`` (``-m "not slow"``) never builds them.
END_TO_END_FIXTURES = frozenset({"one_prompt", "replayed", "s3"})


# The files holding ``ray`` tests: pytest-xdist hands them to one worker as one unit, so they run
# in turn beside the other worker's files (two local Ray clusters on one machine can find each
# other: ``ray.init()`` joins the newest). Checked against the markers at every collection.
RAY_FILES = frozenset({"tests/test_benches.py", "tests/test_cluster.py", "tests/test_ray.py",
                       "tests/test_wrong_endpoints.py"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if END_TO_END_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    marked = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("ray")}
    if marked - RAY_FILES:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(marked - RAY_FILES)} to RAY_FILES "
                                "(they hold ray tests)")


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (scripts/test.sh), with every file of :data:`RAY_FILES` one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "ray" if file in RAY_FILES else file

    return RayFilesTogether(config, log)


@pytest.fixture(autouse=True)
def _no_legacy_reads(monkeypatch):
    """Every test starts without ``$MOESPEC_ALLOW_LEGACY`` and leaves none behind: an in-process
    ``query``/``report --allow-legacy`` sets it for its process (so that the SQL child reads
    what its parent may), which would let every later test's commands read unverified runs."""
    from moe_spec.catalog.runs import LEGACY_ENV
    monkeypatch.setenv(LEGACY_ENV, "0")  # records the value to restore (delenv of an unset
    monkeypatch.delenv(LEGACY_ENV)  # variable records nothing, and the test's setting would stay)


@pytest.fixture(scope="session", params=models.EMBEDDED)
def embedded(request) -> models.LoadedModel:
    """Each embedded tiny model, loaded through the registry in fp32 on the CPU."""
    return models.load(request.param, device="cpu", dtype="float32")


S3_BUCKET = "traces"  # the bucket the ``s3`` fixture creates
S3_ENV = dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
              AWS_DEFAULT_REGION="us-east-1", MOESPEC_LEASE_SECONDS="2")


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on a free port of 127.0.0.1, the AWS_* variables pointing at it (for
    this process and the subprocesses it starts), one bucket
    (``S3_BUCKET``); yields the s3fs filesystem. Skips where moto[server] is not installed."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is a dev dependency")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    location.use_storage_options(None)
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    fs.mkdir(S3_BUCKET)
    yield fs
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


def recommit(traces, run: str | None = None) -> None:
    """Commit the runs under ``traces`` again as they are now on disk (every part capture names,
    rows, bytes, content hash; a new commit digest): for tests that rewrite a captured file on
    purpose and want it read as if it had been captured so."""
    import json
    from pathlib import Path

    from moe_spec.catalog import commit, schema
    from moe_spec.catalog.runs import WHOLE_PART, commit_digest
    for path in Path(traces).glob(f"runs/model=*/bench=*/run={run or '*'}/{schema.MANIFEST}"):
        manifest = json.loads(path.read_text())
        if manifest.get("files") is None:
            continue
        parts = path.parent.parts[-3:]
        files = {}
        for table in manifest["files"]:
            folder = Path(traces) / table / Path(*parts)
            found = [p for p in folder.iterdir() if commit.prompt_of(p.name) is not None
                     or p.name == WHOLE_PART] if folder.is_dir() else []
            files[table] = commit.table_record(found)
        manifest["files"] = files
        manifest["commit_digest"] = commit_digest(manifest)
        path.write_text(json.dumps(manifest, indent=2, sort_keys=True))


@pytest.fixture
def recommitted():
    """:func:`recommit`, for tests that edit a captured file on purpose."""
    return recommit


@pytest.fixture(scope="session")
def one_prompt(tmp_path_factory):
    """One prompt of tiny-olmoe (run ``eval``), captured once for the session; read it, never
    change it (replay results go to another ``--out``)."""
    from moe_spec.capture import cli as capture_cli
    root = tmp_path_factory.mktemp("one_prompt") / "traces"
    assert capture_cli.main(["--limit", "1", "--max-new-tokens", "8", "--out", str(root),
                             "--run", "eval", "--no-progress", "--threads", "1"]) == 0
    return root


@pytest.fixture(scope="session")
def replayed(tmp_path_factory):
    """(traces, the CSV answer of ``helpers.QUERY``): two prompts (run ``r``) with router replay
    results beside them, computed once for the session; copy the traces before changing them
    (``helpers.copy_of``)."""
    from helpers import CAP, QUERY, call

    from moe_spec.capture import cli as capture_cli
    traces = tmp_path_factory.mktemp("replayed") / "traces"
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(traces), "--run", "r"]) == 0
    r = call("moe_spec.replay.cli", "--traces", traces, "--run", "r", "--ranking", "router", "--budget",
             "16", "--no-progress")
    assert r.returncode == 0, r.stderr
    q = call("moe_spec.analysis.query_cli", QUERY, "--traces", traces, "--format", "csv")
    assert q.returncode == 0
    return traces, q.stdout


@pytest.fixture
def no_model(monkeypatch):
    """Any model or draft loaded fails the test: refusals come before them."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    from moe_spec.eagle import loading
    from moe_spec.moe import models
    monkeypatch.setattr(models, "load", loaded)
    monkeypatch.setattr(loading, "load_with_draft", loaded)
