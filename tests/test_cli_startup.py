"""What a command does before it imports torch and transformers: every refusal comes first, and
a replay whose results are all stored answers without loading the model (a missing cell still
loads it and computes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_env

pytestmark = pytest.mark.slow  # fresh processes; scripts/test.sh --fast leaves it out

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.path.abspath(sys.executable)).parent


def _probe(tmp_path, body: str) -> subprocess.CompletedProcess:
    code = "\n".join(["import sys", body,
                      "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]",
                      "print('HEAVY', heavy)"])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=run_env(tmp_path), cwd=ROOT)


@pytest.mark.parametrize("call, message", [
    ("moe_spec.replay.cli:main|['--traces', T, '--run', 'nonexistent']", "no complete evaluation runs"),
    ("moe_spec.replay.cli:main|['--traces', T, '--budget', '999']", "out of range"),
    ("moe_spec.replay.cli:main|['--traces', T, '--mode', 'closed', '--ranking', 'oracle']",
     "closed loop takes runtime rankings only"),
    ("moe_spec.capture.cli:main|['--model', 'olmoe', '--out', T]", "cannot be reached (offline)"),
    ("moe_spec.capture.cli:main|['--run', 'a/b', '--out', T]", "--run 'a/b' is not allowed"),
    ("moe_spec.profiling.profile_target:main|['--model', 'olmoe']", "cannot be reached (offline)"),
    ("moe_spec.profiling.inspect_model:main|['--model', 'olmoe']", "cannot be reached (offline)"),
    ("moe_spec.training.cli:train_draft|['--model', 'olmoe']", "cannot be reached (offline)"),
    ("moe_spec.analysis.evaluate_cli:main|['--traces', T + '/missing']", "no complete runs"),
])
def test_refusals_come_before_torch_and_transformers(one_prompt, tmp_path, call, message):
    target, args = call.split("|")
    module, func = target.split(":")
    body = (f"T = {str(one_prompt)!r}\nfrom {module} import {func}\n"
            f"code = {func}({args})\nprint('CODE', code)")
    done = _probe(tmp_path, body)
    assert "CODE 2" in done.stdout and "HEAVY []" in done.stdout, (done.stdout, done.stderr)
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], done.stderr


def test_fully_reused_replay_answers_without_the_model_or_torch(one_prompt, tmp_path):
    args = ["--traces", str(one_prompt), "--ranking", "router", "oracle", "--budget", "16,24",
            "--no-progress", "--out", str(tmp_path / "results")]
    first = subprocess.run([str(BIN / "replay"), *args, "--output", str(tmp_path / "a.json")],
                           capture_output=True, text=True, env=run_env(tmp_path))
    assert first.returncode == 0, first.stderr
    argv = [*args, "--output", str(tmp_path / "b.json")]
    body = f"from moe_spec.replay.cli import main\ncode = main({argv!r})\nprint('CODE', code)"
    done = _probe(tmp_path, body)
    assert "CODE 0" in done.stdout and "HEAVY []" in done.stdout, (done.stdout, done.stderr)
    assert "reused stored results for run eval (model not loaded)" in done.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["model_loaded"] and not b["model_loaded"] and b["reused"] == ["eval"]
    assert a["summary"] == b["summary"] and len(b["summary"]) == 8  # 2 rankings × 2 × 2


def test_a_missing_cell_still_loads_the_model_and_computes(one_prompt, tmp_path):
    from moe_spec.replay import cli as replay_cli

    def replay(budgets: str, output: str) -> dict:
        assert replay_cli.main(["--traces", str(one_prompt), "--ranking", "router", "--budget",
                                budgets, "--coverage", "truncation", "--no-progress", "--out",
                                str(tmp_path / "results"), "--output",
                                str(tmp_path / output)]) == 0
        return json.loads((tmp_path / output).read_text())

    assert replay("8", "a.json")["model_loaded"]
    b = replay("8,16", "b.json")  # 16 is missing: computed (8 is reused inside)
    assert b["model_loaded"] and {r["budget"] for r in b["summary"]} == {8, 16}
    assert not replay("16", "c.json")["model_loaded"]
