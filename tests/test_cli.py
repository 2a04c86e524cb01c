"""What every command line promises: instant --help with examples, --config files whose keys
mirror the flags, --output summaries, one-line errors."""

import json
import subprocess
import sys

import pytest

from moe_spec.capture import cli as capture_cli
from moe_spec.policy import coverage, index, rankings
from moe_spec.replay import cli as replay_cli

SCRIPTS = {  # console script -> module:function (pyproject's [project.scripts])
    "capture": "moe_spec.capture.cli:main", "replay": "moe_spec.replay.cli:main",
    "query": "moe_spec.analysis.query_cli:main",
    "report": "moe_spec.analysis.report:main", "evaluate": "moe_spec.analysis.evaluate_cli:main",
    "profile-target": "moe_spec.profiling.profile_target:main",
    "profile-batch": "moe_spec.profiling.profile_batch:main",
    "workbench-app": "moe_spec.app.launch:main",
    "inspect-model": "moe_spec.profiling.inspect_model:main",
    "train-tiny": "moe_spec.training.cli:train_tiny",
    "train-draft": "moe_spec.training.cli:train_draft",
    "import-routing": "moe_spec.capture.import_routing:main",
    "export-routing": "moe_spec.capture.export_routing:main",
}


def test_scripts_table_is_pyprojects():
    import tomllib
    from pathlib import Path
    table = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert table["project"]["scripts"] == SCRIPTS


@pytest.mark.slow  # a fresh process
def test_help_imports_neither_torch_nor_transformers():
    """--help must appear at once: no command imports torch or transformers to print it."""
    probe = "\n".join([
        "import contextlib, importlib, io, sys",
        f"scripts = {SCRIPTS!r}",
        "for name, target in scripts.items():",
        "    module, func = target.split(':')",
        "    out = io.StringIO()",
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):",
        "        getattr(importlib.import_module(module), func)(['--help'])",
        "    heavy = [m for m in ('torch', 'transformers') if m in sys.modules]",
        "    assert not heavy, (name, heavy)",
        "    assert 'usage:' in out.getvalue(), name",
        "    if name not in ('workbench-app',):",
        "        assert 'examples:' in out.getvalue(), name",
    ])
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_defaults_are_shown_once():
    text = capture_cli.parser().format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: router)") == 1


def test_policy_index_matches_the_registries():
    assert sorted(index.RANKINGS) == sorted(rankings.REGISTRY)
    for name, entry in index.RANKINGS.items():
        assert rankings.get(name).runtime == entry.runtime, name
    assert list(index.COVERAGES) == list(coverage.COVERAGES)


@pytest.mark.parametrize("body, message", [
    ("limit = 2\nbogus = 3\n", "unknown key 'bogus'"),
    ("limit = [\n", "is not valid TOML"),
    ("ranking = \"oracle\"\n", "invalid choice: 'oracle'"),
    ("no_progress = 1\n", "takes true or false"),
])
def test_config_errors_are_one_line(tmp_path, capsys, body, message):
    cfg = tmp_path / "run.toml"
    cfg.write_text(body)
    with pytest.raises(SystemExit) as stop:
        capture_cli.main(["--config", str(cfg)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_config_keys_mirror_flags_and_flags_win(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('limit = 5\nmax-new-tokens = 9\nno_progress = true\nbench = "gsm8k"\n'
                   'calibration = ["a", "b"]\n')
    args = capture_cli.parser().parse_args(["--config", str(cfg), "--limit", "2"])
    assert (args.limit, args.max_new_tokens, args.no_progress, args.bench) == (2, 9, True, "gsm8k")
    assert args.calibration == ["a", "b"]


@pytest.mark.slow  # captures and replays
def test_capture_and_replay_write_json_summaries_from_a_config(tmp_path):
    traces = tmp_path / "t"
    cfg = tmp_path / "capture.toml"
    cfg.write_text(f'limit = 1\nmax_new_tokens = 8\nno_progress = true\nout = "{traces}"\n'
                   'run = "eval"\n')
    assert capture_cli.main(["--config", str(cfg), "--output", str(tmp_path / "c.json")]) == 0
    cap = json.loads((tmp_path / "c.json").read_text())
    assert cap["tool"] == "capture" and cap["run"] == "eval" and cap["prompts"] == 1
    assert cap["settings"]["max_new_tokens"] == 8 and cap["trees"] >= 1
    assert replay_cli.main(["--traces", str(traces), "--ranking", "router", "--budget", "16,32",
                            "--coverage", "truncation", "--no-progress",
                            "--output", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["budgets"] == [16, 32] and rep["runs"] == ["eval"]
    assert {row["budget"] for row in rep["summary"]} == {16, 32}
    assert all(0 <= row["rse"] for row in rep["summary"])


def test_chat_template_wraps_the_prompt_and_base_models_are_refused(tmp_path, capsys):
    from moe_spec.capture.run import prompt_ids
    from moe_spec.capture.settings import CaptureError
    from moe_spec.moe import models
    tok = models.load("tiny-olmoe", device="cpu").tokenizer
    plain = prompt_ids(tok, "def f(x):")
    with pytest.raises(CaptureError, match="no chat template"):
        prompt_ids(tok, "def f(x):", chat_template=True)
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    wrapped = prompt_ids(tok, "def f(x):", chat_template=True)
    assert len(wrapped) > len(plain)
    assert tok.decode(wrapped).endswith("<|assistant|>")
    assert capture_cli.main(["--limit", "1", "--max-new-tokens", "4", "--chat-template",
                             "--out", str(tmp_path), "--no-progress"]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.parquet"))  # refused before anything was written
