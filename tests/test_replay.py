"""replay end to end through the real CLI on captured tiny-olmoe trees."""

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest
from helpers import call
from hypothesis import given
from hypothesis import strategies as st

from moe_spec.capture import cli as capture_cli
from moe_spec.replay import cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "10", "--no-progress"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(root), "--run", "eval"]) == 0
    assert capture_cli.main([*CAP, "--limit", "3", "--offset", "100", "--out", str(root),
                             "--run", "cal", "--role", "calibration"]) == 0
    return root


def run_cli(*args):
    return call("moe_spec.replay.cli", *args)


def results(root, table):
    return duckdb.sql(f"SELECT * FROM read_parquet('{root}/{table}/**/*.parquet', "
                      "hive_partitioning=true)").pl()


def test_full_budget_is_exact_for_every_ranking_and_results_are_reused(traces, tmp_path, capsys):
    args = ["--traces", str(traces), "--run", "eval", "--calibration", "cal", "--ranking",
            "static", "router", "oracle", "coact", "learned", "--budget", "64", "--no-progress",
            "--out", str(tmp_path)]
    assert cli.main(args) == 0
    df = results(tmp_path, "replay_open")
    assert set(df["ranking"]) == {"static", "router", "oracle", "coact", "learned"}
    assert len(list(tmp_path.glob("replay_open/**/config=*/learned.skops"))) == 2  # one per coverage
    assert df["rse"].max() < 1e-10 and df["mass_excluded"].max() == 0
    assert set(df["model"]) == {"tiny-olmoe"} and set(df["run"]) == {"eval"}
    capsys.readouterr()
    assert cli.main(args) == 0
    assert "reused" in capsys.readouterr().err


def test_sweep_orders_oracle_below_router_and_covers_the_grid(traces, tmp_path):
    assert cli.main(["--traces", str(traces), "--run", "eval", "--ranking", "router", "oracle",
                     "--budget", "sweep", "--coverage", "truncation", "--layers", "0,7",
                     "--no-progress", "--out", str(tmp_path)]) == 0
    df = results(tmp_path, "replay_open")
    assert set(df["coverage"]) == {"truncation"}
    assert sorted(set(df["budget"])) == list(range(8, 57, 8))
    assert set(df["layer"]) == {0, 7}
    mean = df.group_by("ranking").agg(pl.col("rse").mean())
    rse = dict(zip(mean["ranking"], mean["rse"]))
    assert rse["oracle"] <= rse["router"]


def test_closed_loop_with_all_experts_reproduces_captured_acceptance(traces, tmp_path):
    assert cli.main(["--traces", str(traces), "--run", "eval", "--mode", "closed", "--ranking",
                     "router", "coact-online", "--calibration", "cal", "--budget", "64,16",
                     "--coverage", "substitution", "--no-progress", "--out", str(tmp_path)]) == 0
    df = results(tmp_path, "replay_closed")
    assert set(df["ranking"]) == {"router", "coact-online"}
    full = df.filter(df["budget"] == 64)
    assert (full["accepted_length"] == full["captured_accepted_length"]).all()
    assert full["path_unchanged"].all() and full["top1_agreement"].min() == 1.0
    assert full["mean_kl"].abs().max() < 1e-6
    cut = df.filter(df["budget"] == 16)
    assert cut["experts_loaded"].list.max().max() <= 16


@pytest.mark.parametrize("args,message", [
    (["--calibration", "eval", "--ranking", "static", "--run", "eval"], "no complete evaluation"),
    (["--ranking", "coact"], "needs --calibration"),
    (["--budget", "65"], "out of range"),
    (["--budget", "x"], "cannot read --budget"),
    (["--model", "tiny-mixtral"], "no complete evaluation runs match"),
    (["--layers", "9"], "no MoE block"),
])
def test_bad_input_is_one_line(traces, args, message):
    r = run_cli("--traces", str(traces), "--no-progress", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_overlapping_calibration_is_refused(traces, tmp_path):
    assert capture_cli.main([*CAP, "--limit", "1", "--offset", "1", "--out", str(traces),
                             "--run", "overlap"]) == 0
    r = run_cli("--traces", str(traces), "--run", "eval", "--calibration", "overlap",
                "--ranking", "static", "--no-progress", "--allow-evaluation-calibration")
    assert r.returncode == 2 and "overlap" in r.stderr


def test_missing_traces_and_corrupt_parts_are_one_line(traces, tmp_path):
    r = run_cli("--traces", str(tmp_path / "none"))
    assert r.returncode == 2 and "no captured runs" in r.stderr
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(traces, copy, ignore=shutil.ignore_patterns("replay_*"))
    part = next((copy / "routing").rglob("run=eval/part-000000-*.parquet"))
    part.write_bytes(part.read_bytes()[:100])
    r = run_cli("--traces", str(copy), "--run", "eval", "--no-progress")
    assert r.returncode == 2 and part.name in r.stderr and "commit record" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert pq.ParquetFile(next((copy / "trees").rglob("*.parquet"))).metadata.num_rows > 0


def test_replay_streams_chunks_and_equals_an_unchunked_capture(traces, tmp_path):
    """A run written one pass per part (several parts per prompt) replays to the same rows,
    batch sizes included: the engine's batching and streaming change no result."""
    from moe_spec.capture.run import CaptureSettings, capture_run
    chunked = tmp_path / "chunked"
    capture_run(CaptureSettings(limit=2, max_new_tokens=10, chunk_steps=1), chunked, "eval",
                progress=False)
    assert len(list((chunked / "routing").rglob("part-000000-*.parquet"))) > 1
    for root, extra in ((chunked, []), (traces, ["--out", str(tmp_path / "plain")])):
        assert cli.main(["--traces", str(root), "--run", "eval", "--ranking", "router", "oracle",
                         "--budget", "16,32", "--no-progress", *extra]) == 0
    a = results(chunked, "replay_open").drop("config", "block")
    b = results(tmp_path / "plain", "replay_open").drop("config", "block")
    keys = ["prompt_index", "step", "layer", "ranking", "coverage", "budget"]
    assert a.sort(keys).equals(b.sort(keys))
    small = tmp_path / "small"  # and batches of 3 tree-layers give the same rows too
    assert cli.main(["--traces", str(chunked), "--run", "eval", "--ranking", "router", "oracle",
                     "--budget", "16,32", "--no-progress", "--chunk-tree-layers", "3", "--out",
                     str(small)]) == 0
    c = results(small, "replay_open").drop("config", "block")
    assert c.sort(keys).select(keys).equals(a.sort(keys).select(keys))
    for col in ("rse", "token_error"):
        diff = (c.sort(keys)[col] - a.sort(keys)[col]).abs().max()
        assert diff < 1e-12, col


@given(st.lists(st.integers(0, 10_000), unique=True, max_size=200), st.integers(1, 16))
def test_distributed_prompt_chunks_cover_every_prompt_once_in_order(prompts, actors):
    from moe_spec.replay.distributed import prompt_chunks
    chunks = prompt_chunks(prompts, actors)
    assert [p for c in chunks for p in c] == prompts
    assert all(chunks)
    if len(prompts) >= 4 * actors:  # enough calls for every actor to balance the tail
        assert len(chunks) >= 4 * actors


def test_a_replay_plans_checks_and_resolves_its_calibration_once(traces, tmp_path, monkeypatch):
    """One command, one plan: the plan made from the manifests before the model loads is the
    one executed; the request is parsed and checked once and the calibration runs resolved
    once (were: plan twice, check_request and parse_budgets twice, calibration three times)."""
    from moe_spec.catalog import Catalog
    from moe_spec.replay import plan as plan_module
    from moe_spec.replay import run as run_module
    calls = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    plan, parse_budgets = counted("plan", plan_module.plan), \
        counted("parse_budgets", plan_module.parse_budgets)
    for module in (plan_module, run_module):  # (replay.run re-exports them)
        monkeypatch.setattr(module, "plan", plan)
        monkeypatch.setattr(module, "parse_budgets", parse_budgets)
    monkeypatch.setattr(cli, "check_request", counted("check_request", cli.check_request))
    monkeypatch.setattr(Catalog, "calibration_runs",
                        counted("calibration_runs", Catalog.calibration_runs))
    assert cli.main(["--traces", str(traces), "--run", "eval", "--calibration", "cal",
                     "--ranking", "router", "coact", "--budget", "16", "--layers", "0",
                     "--coverage", "truncation", "--no-progress", "--threads", "1",
                     "--out", str(tmp_path)]) == 0
    assert set(results(tmp_path, "replay_open")["ranking"]) == {"router", "coact"}
    assert calls == {"plan": 1, "parse_budgets": 1, "check_request": 1, "calibration_runs": 1}
