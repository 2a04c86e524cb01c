"""A model whose routing is near-uniform is named as such (issue 28): inspect-model and the
dashboard's overview warn, from the model's quality record."""

import json
import subprocess
import sys

import pytest
from streamlit.testing.v1 import AppTest

from moe import models


def record(topk_mass: float, entropy: float, n: int = 64, k: int = 8) -> dict:
    return {"routing": {"uniform_topk_mass": k / n,
                        "mean": {"topk_mass": topk_mass, "entropy_ratio": entropy}}}


def test_the_rule_and_the_embedded_models():
    assert models.near_uniform_routing(record(2.5 * 8 / 64, 0.9)) is None  # at both bounds
    assert "near-uniform" in models.near_uniform_routing(record(2.49 * 8 / 64, 0.5))
    assert "entropy / log N 0.95" in models.near_uniform_routing(record(0.9, 0.95))
    judged = {name: models.near_uniform_routing(models.quality_record(
        models.EMBEDDED_DIR / name)) for name in models.EMBEDDED}
    assert [n for n, line in judged.items() if line] == ["tiny-deepseek-v3"]  # 1.76x, 0.97
    assert models.quality_record("/nonexistent/folder") is None


@pytest.mark.parametrize("model, warns", [("tiny-deepseek-v3", True), ("tiny-olmoe", False)])
def test_inspect_model_says_it(model, warns):
    done = subprocess.run([sys.executable, "-m", "moe.inspect_model", "--model", model],
                          capture_output=True, text=True)
    assert done.returncode == 0 and ("warning: routing is near-uniform" in done.stdout) == warns
    done = subprocess.run([sys.executable, "-m", "moe.inspect_model", "--model", model, "--json"],
                          capture_output=True, text=True)
    assert (json.loads(done.stdout)["routing_warning"] is not None) == warns


def test_the_overview_warns_for_the_near_uniform_model_only(tmp_path, monkeypatch):
    from capture import cli as capture_cli
    for model in ("tiny-deepseek-v3", "tiny-olmoe"):
        assert capture_cli.main(["--model", model, "--limit", "1", "--max-new-tokens", "2",
                                 "--out", str(tmp_path), "--no-progress"]) == 0
    monkeypatch.setattr(sys, "argv", ["main.py", "--traces", str(tmp_path)])
    at = AppTest.from_file("../app/main.py", default_timeout=120)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    warnings = [w.value for w in at.warning]
    assert len(warnings) == 1 and warnings[0].startswith("tiny-deepseek-v3: routing is near")
