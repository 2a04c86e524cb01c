"""Traces at real shapes: the storage policy, bf16 end to end, the background writer, and one
capture → replay at OLMoE-1B-7B width."""

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from moe_spec.capture import cli as capture_cli
from moe_spec.capture.run import CaptureSettings, capture_run
from moe_spec.capture.settings import CaptureError
from moe_spec.capture.storage import StorageError, StoragePolicy
from moe_spec.catalog import Catalog, reader
from moe_spec.moe import shapes
from moe_spec.replay import cli as replay_cli

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "12", "--no-progress"]


def manifest(root):
    return json.loads(next(root.glob("runs/**/_manifest.json")).read_text())


def test_default_policy_keeps_an_olmoe_shaped_tree_under_the_budget():
    olmoe = shapes.REAL_SHAPES["olmoe"].config
    resolved = StoragePolicy().resolve(list(range(16)), olmoe["hidden_size"], 63)
    assert resolved["layers"] == [0, 4, 8, 12] and resolved["dtype"] == "bfloat16"
    hidden_bytes = len(resolved["layers"]) * 63 * olmoe["hidden_size"] * 2
    assert hidden_bytes <= 1500 * 1024
    assert StoragePolicy().resolve(list(range(8)), 128, 63)["layers"] == list(range(8))  # tiny
    assert StoragePolicy(layers="every:3").resolve(list(range(8)), 128, 63)["layers"] == [0, 3, 6]
    assert StoragePolicy(layers="1,5").resolve(list(range(8)), 128, 63)["layers"] == [1, 5]


@pytest.mark.parametrize("kwargs,message", [
    (dict(layers="every:0"), "N must be"), (dict(layers="a,b"), "use all, auto"),
    (dict(passes="fraction:2"), "in (0, 1]"), (dict(passes="sometimes"), "use all, every:N"),
    (dict(dtype="int8"), "storage dtype"), (dict(output="maybe"), "store or recompute")])
def test_bad_policies_are_one_line(kwargs, message):
    with pytest.raises(StorageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StoragePolicy(**kwargs).resolve(list(range(8)), 128, 63)


def test_seeded_fraction_of_passes_is_deterministic_and_about_right():
    policy = StoragePolicy(passes="fraction:0.25", seed=3)
    kept = [policy.keeps_pass(p, s) for p in range(40) for s in range(50)]
    assert kept == [policy.keeps_pass(p, s) for p in range(40) for s in range(50)]
    assert 0.2 < np.mean(kept) < 0.3
    assert kept != [StoragePolicy(passes="fraction:0.25", seed=4).keeps_pass(p, s)
                    for p in range(40) for s in range(50)]


@pytest.mark.slow  # captures
def test_partial_storage_is_recorded_complete_where_it_must_be_and_replay_says_so(tmp_path,
                                                                                 capsys):
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(tmp_path), "--run", "p",
                             "--store-layers", "every:3", "--store-passes", "every:2"]) == 0
    m = manifest(tmp_path)
    assert m["storage"]["layers"] == [0, 3, 6] and m["storage"]["passes"] == "every:2"
    routing = pq.read_table(tmp_path / "routing")
    io = pq.read_table(tmp_path / "moe_io", columns=["step", "layer", "output", "output_norm"])
    trees = pq.read_table(tmp_path / "trees").num_rows
    assert routing.num_rows == trees * 63 * 8  # routing is always complete
    assert set(io["layer"].to_pylist()) == {0, 3, 6}
    assert set(io["step"].to_pylist()) <= set(range(0, 100, 2))
    assert io["output"].null_count == io.num_rows and io["output_norm"].null_count == 0
    capsys.readouterr()
    assert replay_cli.main(["--traces", str(tmp_path), "--ranking", "router", "--budget", "16",
                            "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "keeps MoE tensors for MoE layers 0,3,6 of 8 and passes every:2" in err
    res = pq.read_table(tmp_path / "replay_open")
    assert set(res["layer"].to_pylist()) == {0, 3, 6}
    assert set(res["step"].to_pylist()) == set(io["step"].to_pylist())


@pytest.mark.slow  # captures
def test_bf16_end_to_end_is_lossless_and_exact_at_full_budget(tmp_path):
    """A bf16 model captured in bf16: the stored inputs decode to exactly the model's bf16
    values, replay recomputes in fp32 and passes its check, and B = N reproduces the gold."""
    assert capture_cli.main([*CAP, "--limit", "1", "--out", str(tmp_path), "--run", "b",
                             "--dtype", "bfloat16", "--store-output", "store"]) == 0
    run = Catalog(tmp_path).runs()[0]
    assert run.manifest["dtype"] == "torch.bfloat16" and run.manifest["storage"]["dtype"] == \
        "bfloat16"
    assert pq.read_schema(next((tmp_path / "moe_io").rglob("*.parquet"))).field("hidden").type \
        .value_type == "uint16"
    for tl in reader.tree_layers([run]):
        h = torch.from_numpy(tl.hidden)
        assert torch.equal(h.to(torch.bfloat16).float(), h)  # bf16 values, bit for bit
    assert replay_cli.main(["--traces", str(tmp_path), "--ranking", "router", "oracle",
                            "--budget", "64,16", "--no-progress"]) == 0
    res = pq.read_table(tmp_path / "replay_open").to_pandas()
    assert res[res.budget == 64].rse.max() < 1e-12
    assert res[res.budget == 16].rse.min() > 0


@pytest.mark.slow  # captures
def test_a_corrupt_recomputed_run_is_caught_by_the_stored_norms(tmp_path):
    assert capture_cli.main([*CAP, "--limit", "1", "--out", str(tmp_path), "--run", "c"]) == 0
    part = next((tmp_path / "moe_io").rglob("*.parquet"))
    table = pq.read_table(part)
    norms = table["output_norm"].to_numpy() * 3  # the stored norms no longer fit the inputs
    import pyarrow as pa
    pq.write_table(table.set_column(table.schema.get_field_index("output_norm"), "output_norm",
                                    pa.array(norms.astype(np.float32))), part)
    from conftest import recommit
    recommit(tmp_path)  # as if captured so: the norms themselves are checked
    r = subprocess.run([sys.executable, "-m", "moe_spec.replay.cli", "--traces", str(tmp_path),
                        "--ranking", "router", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 2 and "wrong --model or corrupt trace" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_failing_writer_stops_the_capture_and_leaves_only_complete_prompts(tmp_path,
                                                                            monkeypatch):
    from moe_spec.catalog import writer as writer_module
    original = writer_module.RunWriter.write_part

    def failing(self, table, prompt_index, chunk, rows):
        if prompt_index == 1 and table == "nodes":
            raise OSError(28, "No space left on device")
        return original(self, table, prompt_index, chunk, rows)

    monkeypatch.setattr(writer_module.RunWriter, "write_part", failing)
    settings = CaptureSettings(limit=3, max_new_tokens=8)
    with pytest.raises(CaptureError, match="No space left on device.*rerun to resume"):
        capture_run(settings, tmp_path, "w", progress=False)
    assert manifest(tmp_path)["status"] == "running"
    seq = sorted(p.name for p in (tmp_path / "sequences").rglob("*.parquet"))
    assert seq == ["part-000000-0000.parquet"]  # prompt 1 never marked complete
    monkeypatch.setattr(writer_module.RunWriter, "write_part", original)
    summary = capture_run(settings, tmp_path, "w", progress=False)
    assert summary.prompts == 3 and summary.prompts_resumed == 1
    assert manifest(tmp_path)["status"] == "complete"


@pytest.mark.slow
def test_capture_and_replay_at_olmoe_width(tmp_path):
    """One decoder layer of OLMoE-1B-7B's real width (2048 hidden, 64 experts × 1024, top-8),
    random weights and a random EAGLE-3 head: capture, then open-loop replay checks the gold."""
    from moe_spec.training.real_width import real_width_pair
    model_dir, draft_dir = real_width_pair("olmoe", tmp_path / "fixture", layers=1)
    assert capture_cli.main(["--model", str(model_dir), "--draft", str(draft_dir), "--limit",
                             "1", "--max-new-tokens", "4", "--no-progress", "--out",
                             str(tmp_path / "t"), "--run", "w"]) == 0
    m = manifest(tmp_path / "t")
    assert m["hidden_size"] == 2048 and m["num_experts"] == 64 and m["top_k"] == 8
    trees = pq.read_table(tmp_path / "t" / "trees").num_rows
    per_layer = {t: sum(p.stat().st_size for p in (tmp_path / "t" / t).rglob("*.parquet"))
                 / trees for t in ("routing", "moe_io")}
    # the default policy on the real 16-layer OLMoE: routing of 16 layers, tensors of 4
    assert 16 * per_layer["routing"] + 4 * per_layer["moe_io"] <= 2 * 10**6
    assert replay_cli.main(["--traces", str(tmp_path / "t"), "--ranking", "router", "oracle",
                            "--budget", "8,64", "--no-progress"]) == 0
    res = pq.read_table(tmp_path / "t" / "replay_open").to_pandas()
    assert res[res.budget == 64].rse.max() < 1e-10 and res[res.budget == 8].rse.min() > 0


@pytest.mark.slow  # a fresh process
def test_gpu_check_skips_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: scripts/gpu-check.sh runs for real there")
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check.sh"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gpu-check: skipped: no CUDA device" in r.stdout
