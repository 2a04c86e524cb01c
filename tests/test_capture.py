"""capture end to end through the real CLI: tables, fidelity, determinism, resume, budgets."""

import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import polars as pl
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from helpers import call

from moe_spec.capture import cli
from moe_spec.catalog import schema
from moe_spec.moe import models
from moe_spec.moe.adapter import MoEAdapter

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

TIMINGS = {"draft_seconds", "verify_seconds", "wall_seconds"}
BASE = ["--limit", "2", "--max-new-tokens", "12", "--no-progress"]


def run_cli(*args):
    return call("moe_spec.capture.cli", *args)


def table(root, name):
    return pq.read_table(root / name, partitioning="hive")


def comparable(root, name):
    t = table(root, name)
    keep = [c for c in t.column_names if c not in TIMINGS]
    sort = [c for c in ("prompt_index", "step", "layer", "node") if c in keep]
    return t.select(keep).sort_by([(c, "ascending") for c in sort])


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    assert cli.main([*BASE, "--out", str(root), "--run", "r1"]) == 0
    return root


def test_every_table_reads_with_plain_duckdb_pyarrow_polars(captured):
    counts = {}
    for name in (*schema.TRACE_TABLES, "runs"):
        q = f"SELECT count(*), any_value(model), any_value(bench), any_value(run) FROM " \
            f"read_parquet('{captured}/{name}/**/*.parquet', hive_partitioning=true)"
        n, model, bench, run = duckdb.execute(q).fetchall()[0]
        assert (model, bench, run) == ("tiny-olmoe", "mbpp", "r1")
        assert ds.dataset(captured / name, format="parquet", partitioning="hive").count_rows() == n
        lf = pl.scan_parquet(f"{captured}/{name}/**/*.parquet", hive_partitioning=True)
        assert lf.select(pl.len()).collect().item() == n
        counts[name] = n
    trees = counts["trees"]
    assert counts["sequences"] == 2 and counts["runs"] == 1
    assert counts["nodes"] == trees * 63
    assert counts["routing"] == counts["moe_io"] == trees * 63 * 8
    manifest = json.loads(next(captured.glob("runs/**/_manifest.json")).read_text())
    assert manifest["status"] == "complete" and manifest["schema_version"] == schema.SCHEMA_VERSION


def test_recorded_gold_output_is_what_the_model_computed(tmp_path):
    """Exact storage (float32, outputs stored): inputs, outputs and routing are the model's."""
    captured = tmp_path
    assert cli.main([*BASE[:1], "1", *BASE[2:], "--out", str(captured), "--run", "x",
                     "--hidden-dtype", "float32", "--store-output", "store"]) == 0
    loaded = models.load("tiny-olmoe", device="cpu", dtype="float32")
    adapter = MoEAdapter(loaded.model)
    io = table(captured, "moe_io").filter(ds.field("step") == 1).to_pydict()
    routing = table(captured, "routing").filter(ds.field("step") == 1).to_pydict()
    for layer in adapter:
        rows = [i for i, (p, l_) in enumerate(zip(io["prompt_index"], io["layer"]))
                if p == 0 and l_ == layer.index]
        h = torch.tensor([io["hidden"][i] for i in rows])
        gold = torch.tensor([io["output"][i] for i in rows])
        with torch.no_grad():
            torch.testing.assert_close(layer.forward(h), gold, rtol=1e-4, atol=1e-5)
            rrows = [i for i, (p, l_) in enumerate(zip(routing["prompt_index"], routing["layer"]))
                     if p == 0 and l_ == layer.index]
            probs = torch.tensor([routing["router_probs"][i] for i in rrows])
            torch.testing.assert_close(layer.router_scores(h), probs, rtol=1e-4, atol=1e-6)
            ids = torch.tensor([routing["topk_ids"][i] for i in rrows])
            assert torch.equal(ids, probs.topk(layer.top_k).indices)


def test_accepted_nodes_spell_the_output(captured):
    """Roots and accepted drafts of consecutive trees, in order, are the generated tokens (each
    tree's root is the previous tree's bonus token; only the last bonus is in no tree)."""
    nodes = table(captured, "nodes").to_pylist()
    trees = table(captured, "trees").to_pylist()
    for seq in table(captured, "sequences").to_pylist():
        out, spelled = seq["output_token_ids"], []
        for t in sorted((t for t in trees if t["prompt_index"] == seq["prompt_index"]),
                        key=lambda t: t["step"]):
            acc = sorted((n for n in nodes if n["prompt_index"] == seq["prompt_index"]
                          and n["step"] == t["step"] and n["accepted"]), key=lambda n: n["depth"])
            assert acc[0]["node"] == 0 and len(acc) == t["accepted_length"]
            spelled += [n["token_id"] for n in acc]
        assert out[:len(spelled)] == spelled[:len(out)] and len(out) <= len(spelled) + 1


def test_same_command_same_tables_and_chunking_changes_nothing(captured, tmp_path):
    from moe_spec.capture.run import CaptureSettings, capture_run
    settings = CaptureSettings(limit=2, max_new_tokens=12, chunk_steps=2)
    capture_run(settings, tmp_path, "r1", progress=False)
    for name in schema.TRACE_TABLES:
        assert comparable(tmp_path, name).equals(comparable(captured, name)), name
    assert len(list((tmp_path / "routing").rglob("part-000000-*.parquet"))) > 1


def test_sigkill_then_rerun_resumes_and_equals_uninterrupted(captured, tmp_path):
    args = [*BASE[:1], "3", *BASE[2:], "--out", str(tmp_path), "--run", "r1"]
    proc = subprocess.Popen([sys.executable, "-m", "moe_spec.capture.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seq_dir = tmp_path / "sequences" / "model=tiny-olmoe" / "bench=mbpp" / "run=r1"
    deadline = time.time() + 300
    while time.time() < deadline and not list(seq_dir.glob("part-*.parquet")):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = json.loads(next(tmp_path.glob("runs/**/_manifest.json")).read_text())
    assert manifest["status"] == "running"
    done_before = len(list(seq_dir.glob("part-*.parquet")))
    assert 1 <= done_before < 3
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert f"({done_before} resumed)" in r.stdout
    full = tmp_path / "full"  # uninterrupted, in the same kind of process (same threads)
    assert run_cli(*args[:-4], "--out", str(full), "--run", "r1").returncode == 0
    for name in schema.TRACE_TABLES:
        assert comparable(tmp_path, name).equals(comparable(full, name)), name
    assert not list(tmp_path.rglob("*.tmp"))


def test_budget_of_all_experts_equals_plain_eagle(captured, tmp_path):
    assert cli.main([*BASE, "--out", str(tmp_path), "--run", "b", "--budget", "64"]) == 0
    plain = table(captured, "sequences").sort_by("prompt_index")
    budgeted = table(tmp_path, "sequences").sort_by("prompt_index")
    assert plain["output_token_ids"].equals(budgeted["output_token_ids"])
    assert plain["mean_accepted_length"].equals(budgeted["mean_accepted_length"])


@pytest.mark.parametrize("coverage", ["substitution", "truncation"])
def test_budget_caps_the_experts_loaded(tmp_path, coverage):
    assert cli.main([*BASE, "--out", str(tmp_path), "--run", "b", "--budget", "16",
                     "--coverage", coverage]) == 0
    trees = table(tmp_path, "trees").to_pylist()
    assert all(max(t["experts_loaded"]) <= 16 and t["budget"] == 16 for t in trees)
    assert any(max(t["unique_experts"]) > 16 for t in trees)
    routing = table(tmp_path, "routing").filter(ds.field("step") == 0).to_pylist()
    for row in routing:
        used = [i for i, w in zip(row["applied_ids"], row["applied_weights"]) if w > 0]
        if coverage == "truncation":
            assert set(used) <= set(row["topk_ids"])
        else:
            assert len(used) == 8


@pytest.mark.parametrize("args,message", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--bench", "mmlu"], "--bench 'mmlu' is not a benchmark"),
    (["--budget", "65"], "out of range"),
    (["--budget", "4", "--coverage", "substitution"], "out of range"),
    (["--budget", "0", "--coverage", "truncation"], "out of range"),
    (["--draft", "data/drafts/tiny-mixtral"], "trained for a mixtral"),
    (["--draft", "data/drafts/nothing"], "does not exist"),
    (["--budget", "16", "--ranking", "coact"], "needs --calibration"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, args, message):
    r = run_cli(*BASE, "--out", str(tmp_path), *args)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_existing_run_with_other_settings_is_refused(captured):
    r = run_cli("--limit", "2", "--max-new-tokens", "13", "--no-progress", "--out",
                str(captured), "--run", "r1")
    assert r.returncode == 2 and "different settings (max_new_tokens)" in r.stderr


def test_unwritable_output_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_cli(*BASE, "--out", str(blocker / "traces"))
    assert r.returncode == 2 and "choose a writable --out" in r.stderr


def test_online_static_and_coact_rankings_use_disjoint_calibration(captured, tmp_path):
    assert cli.main([*BASE[:1], "1", *BASE[2:], "--offset", "100", "--out", str(captured),
                     "--run", "cal", "--role", "calibration"]) == 0
    for ranking in ("static", "coact", "coact-online"):
        assert cli.main([*BASE, "--out", str(captured), "--run", f"online-{ranking}",
                         "--budget", "16", "--ranking", ranking, "--calibration", "cal"]) == 0
        trees = pq.read_table(captured / "trees" / "model=tiny-olmoe" / "bench=mbpp" /
                              f"run=online-{ranking}").to_pylist()
        assert all(max(t["experts_loaded"]) <= 16 and t["ranking"] == ranking for t in trees)
    r = run_cli(*BASE, "--out", str(captured), "--run", "bad", "--budget", "16", "--ranking",
                "static", "--calibration", "r1", "--allow-evaluation-calibration")
    assert r.returncode == 2 and "overlap (2 prompts" in r.stderr


def test_a_complete_run_captured_again_is_answered_from_disk_untouched(captured, monkeypatch):
    manifest = next((captured / "runs").rglob("_manifest.json"))
    before = manifest.stat().st_mtime_ns
    from moe_spec.capture import run as capture_run

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded for a run with nothing to capture")
    monkeypatch.setattr(capture_run.Target, "load", no_model)
    assert cli.main([*BASE, "--out", str(captured), "--run", "r1"]) == 0
    assert manifest.stat().st_mtime_ns == before


def test_a_resumed_run_removes_the_temporary_files_a_killed_writer_left(tmp_path):
    """A kill between an atomic write's temporary file and its rename leaves the temporary file;
    the next writer of the run (holding its lock) removes it, beside the manifest too."""
    from moe_spec.capture.run import CaptureSettings, capture_run
    from moe_spec.catalog.runs import read_manifest, write_manifest
    settings = CaptureSettings(limit=1, max_new_tokens=4)
    capture_run(settings, tmp_path, "r1", progress=False)
    manifest_path = next(tmp_path.glob("runs/**/_manifest.json"))
    write_manifest(tmp_path, {**read_manifest(manifest_path), "status": "running"})
    left = [manifest_path.parent / "._manifest.json.k1ll3d.tmp",
            next(tmp_path.glob("sequences/**/part-*.parquet")).parent / ".part-x.parquet.k1.tmp"]
    for p in left:
        p.write_bytes(b"half")
    capture_run(settings, tmp_path, "r1", progress=False)
    assert not list(tmp_path.rglob("*.tmp"))
    assert read_manifest(manifest_path)["status"] == "complete"
