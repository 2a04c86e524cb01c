"""Smoke runs of the round-3 benches on tiny inputs, so the README's figures cannot rot: each
script runs end to end through the same code as the full run and writes its result file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run(*args, timeout=900):
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_oracle_bound_bench_counts_no_cell_below_the_oracle(tmp_path):
    out = run("bench/oracle_bound.py", "--traces", str(tmp_path), "--models", "tiny-mixtral",
              "--eval-prompts", "1", "--cal-prompts", "2", "--max-new-tokens", "6")
    found = json.loads((tmp_path / "oracle_bound.json").read_text())["tiny-mixtral"]
    assert found["exact"]["cells"] > 0 and found["exact"]["max_abs_diff"] <= 1e-12
    assert sum(r["below"] for r in found["rows"]) == 0 and "total cells below" in out


@pytest.mark.slow
def test_batch_regime_bench_measures_every_batch_size(tmp_path):
    out = run("bench/batch_regime.py", "--models", "tiny-olmoe", "--batch-sizes", "1", "2",
              "--prompts", "2", "--cal-prompts", "1", "--new-tokens", "6", "--out",
              str(tmp_path / "b.json"))
    rows = json.loads((tmp_path / "b.json").read_text())["tiny-olmoe"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert all(r["eagle_tokens_per_s"] > 0 and r["unique_experts"] > 0 for r in rows)
    assert rows[1]["unique_experts"] >= rows[0]["unique_experts"]  # a union only grows
    assert "MoESD pass-time fit" in out
