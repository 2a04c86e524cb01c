"""The ranking recipe of docs/architecture.md for a ranking with an input of its own: a copy of
``policy/`` with one new module under ``policy/rankings/`` and its one line in
``policy.index.RANKINGS`` declaring that it reads the tree tokens' MoE inputs has the ranking in
``replay``'s choices, its calibration carrying what that input asks for (the one calibration
step, :func:`policy.calibration.calibrate`: the surrogate's sums) and its batches carrying
``h_t``, and replays through the CLI. No caller names it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import CAP_ONE, overlay_env

ROOT = Path(__file__).resolve().parents[1]
TOY = '''"""inputs-norm: router mass weighted by each tree token's MoE-input norm (a recipe test's
ranking: it reads h_t, and refuses a calibration without what its input asks for)."""

from moe_spec.policy.rankings.base import Ranking, RankingError, by_mass, register
from moe_spec.policy.surrogate import MOMENTS


@register
class InputsNorm(Ranking):
    name = "inputs-norm"

    def fit(self, calibration=None):
        if calibration is None or MOMENTS not in calibration.fitted:
            raise RankingError("inputs-norm: its calibration carries no MoE-input sums")
        return super().fit(calibration)

    def order(self, batch, coverage, max_budget):
        if batch.hidden is None:
            raise RankingError("inputs-norm: the batch carries no MoE inputs h_t")
        norm = batch.hidden.float().norm(dim=-1) * batch.mask  # [T, M]
        return by_mass((batch.probs.float() * norm[..., None]).sum(1))
'''
LINE = '''    "inputs-norm": Entry("moe_spec.policy.rankings.inputs_norm", True, "router mass x MoE-input norm (a recipe test's ranking)", needs_calibration=True, inputs=("moe_inputs",)),
'''  # noqa: E501 - the index line as a user would add it, one line


def test_a_ranking_reading_the_moe_inputs_is_its_file_plus_its_index_line(one_prompt, tmp_path):
    from moe_spec.capture import cli as capture_cli
    traces = tmp_path / "traces"
    shutil.copytree(one_prompt, traces)
    assert capture_cli.main([*CAP_ONE, "--offset", "100", "--out", str(traces), "--run", "cal",
                             "--role", "calibration"]) == 0
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "policy", copy / "policy", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "policy" / "rankings" / "inputs_norm.py").write_text(TOY)
    index = copy / "policy" / "index.py"
    head = "RANKINGS: dict[str, Entry] = {\n"
    assert head in index.read_text()
    index.write_text(index.read_text().replace(head, head + LINE))
    out, result = tmp_path / "results", tmp_path / "replay.json"
    code = f"""
from moe_spec.policy import index
from moe_spec.replay import cli
assert index.__file__.startswith({str(copy)!r}), index.__file__
assert "inputs-norm" in cli.parser().format_help()
assert index.calibration_steps(["inputs-norm"]) == index.calibration_steps(["sketch"]) != []
print("CODE", cli.main(["--traces", {str(traces)!r}, "--out", {str(out)!r}, "--run", "eval",
                        "--calibration", "cal", "--ranking", "inputs-norm", "router",
                        "--budget", "8", "--coverage", "truncation", "--layers", "0,1",
                        "--no-progress", "--threads", "1", "--output", {str(result)!r}]))
"""
    done = subprocess.run([sys.executable, "-c", code], env=overlay_env(copy), cwd=copy,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "CODE 0" in done.stdout, done.stderr[-3000:]
    summary = json.loads(result.read_text())["summary"]
    assert {row["ranking"] for row in summary} == {"inputs-norm", "router"}
    toy = [row for row in summary if row["ranking"] == "inputs-norm"]
    assert toy and all(row["rse"] >= 0 for row in toy)
