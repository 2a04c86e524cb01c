"""The replay-mode recipe of docs/architecture.md: a mode is a ``ReplayMode`` subclass in
``replay/modes.py`` (plus its engine, here open loop's): a copy of ``replay/`` with one new mode
appended to that file has it in ``--mode``'s choices and help, in the plan's unit keys, and
replays through the CLI to results that say which mode made them."""

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
from helpers import overlay_env

ROOT = Path(__file__).resolve().parents[1]
FIRST_LAYER = '''

class FirstLayer(OpenLoop):
    """Open loop on each run's first scored MoE layer only (the recipe test's mode)."""

    name = "first-layer"

    def scored_layers(self, run, layers, notes):
        return super().scored_layers(run, layers, notes)[:1]


MODES[FirstLayer.name] = FirstLayer()
'''


def test_adding_a_replay_mode_is_one_file(one_prompt, tmp_path):
    import shutil
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "replay", copy / "replay", ignore=shutil.ignore_patterns("__pycache__"))
    modes = copy / "replay" / "modes.py"
    modes.write_text(modes.read_text() + FIRST_LAYER)
    out, result = tmp_path / "results", tmp_path / "replay.json"
    code = f"""
from moe_spec.replay import cli, modes
assert modes.__file__.startswith({str(copy)!r}), modes.__file__
assert "first-layer" in cli.parser().format_help()
print("CODE", cli.main(["--traces", {str(one_prompt)!r}, "--out", {str(out)!r}, "--mode",
                        "first-layer", "--ranking", "router", "--budget", "16", "--no-progress",
                        "--threads", "1", "--output", {str(result)!r}]))
"""
    done = subprocess.run([sys.executable, "-c", code], env=overlay_env(copy), cwd=copy,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "CODE 0" in done.stdout, done.stderr[-3000:]
    payload = json.loads(result.read_text())
    assert {v["mode"] for v in payload["variants"]} == {"first-layer"}
    rows = pl.read_parquet(next(out.rglob("config=*")) / "**" / "*.parquet")
    assert rows.height > 0 and rows["layer"].n_unique() == 1
