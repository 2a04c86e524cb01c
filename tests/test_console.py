"""Command lines, round 3: --threads on every command that computes, refusals before the heavy
imports, a fully reused replay answered without the model, replay's pivot summary, quiet
broken pipes, command names that run, and why a generated program failed."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import polars as pl
import pytest
import torch

import console
from console import commands, pipes, threads
from tasks.scoring import Score

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.path.abspath(sys.executable)).parent
COMPUTING = {  # commands that compute -> module:function
    "capture": "capture.cli:main", "replay": "replay.cli:main", "report": "analysis.report:main",
    "evaluate": "analysis.evaluate_cli:main", "profile-target": "analysis.moesd:main",
    "inspect-model": "moe.inspect_model:main", "train-tiny": "training.cli:train_tiny",
    "train-draft": "training.cli:train_draft",
}


def entry(target: str):
    import importlib
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def run_env(tmp_path: Path) -> dict:
    """A subprocess environment: offline, one thread, its own cache folder."""
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                XDG_CACHE_HOME=str(tmp_path / "cache"), TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """One prompt of tiny-olmoe, captured once for this module."""
    from capture import cli as capture_cli
    root = tmp_path_factory.mktemp("round3") / "traces"
    assert capture_cli.main(["--limit", "1", "--max-new-tokens", "8", "--out", str(root),
                             "--run", "eval", "--no-progress", "--threads", "1"]) == 0
    return root


# --- 1. --threads ------------------------------------------------------------------------------
def test_commands_are_pyprojects_scripts():
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(commands.COMMANDS) == set(table)
    assert set(COMPUTING) <= set(table) and all(table[k] == v for k, v in COMPUTING.items())


@pytest.mark.parametrize("name", sorted(COMPUTING))
def test_every_computing_command_takes_threads(name, capsys):
    with pytest.raises(SystemExit) as stop:
        entry(COMPUTING[name])(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads N" in text and f"the {threads.available()} CPUs" in text
    assert "examples:" in text


@pytest.mark.parametrize("name", sorted(COMPUTING))
@pytest.mark.parametrize("value, message", [("0", "0 must be at least 1"),
                                            ("-1", "-1 must be at least 1"),
                                            ("many", "'many' is not a whole number")])
def test_threads_below_one_is_a_one_line_error(name, value, message, capsys):
    with pytest.raises(SystemExit) as stop:
        entry(COMPUTING[name])(["--threads", value])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"argument --threads: {message}" in err, err


def test_threads_above_the_cpus_is_clamped_with_a_note(capsys):
    p = console.ArgumentParser(prog="tool")
    threads.add_argument(p)
    cap = threads.available()
    assert p.parse_args(["--threads", str(cap + 7)]).threads == cap
    err = capsys.readouterr().err.strip()
    assert err == f"tool: note: --threads {cap + 7} is more than the {cap} CPUs this process " \
                  f"may use; using {cap}"
    assert p.parse_args([]).threads is None


def test_default_never_exceeds_the_cpus_and_honours_omp(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert 1 <= threads.default() == threads.available() <= cpus
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.default() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cpus + 10))
    assert threads.default() == threads.available()
    assert threads.resolve(10_000) == threads.available() and threads.resolve(0) == 1


def test_apply_sets_torch_and_the_environment(monkeypatch):
    before = torch.get_num_threads()
    for var in (*threads.ENV_VARS, threads.ENV_APPLIED):
        monkeypatch.setenv(var, "x")
    try:
        assert threads.apply(1) == 1
        assert torch.get_num_threads() == 1
        assert all(os.environ[v] == "1" for v in threads.ENV_VARS) and threads.current() == 1
        n = threads.available()
        assert threads.apply(n + 5) == n and torch.get_num_threads() == n
        assert threads.share(4, total=8) == 2 and threads.share(16, total=8) == 1
        assert threads.share(2) == max(1, n // 2)
    finally:
        torch.set_num_threads(before)
        threads._applied = None


def test_ray_workers_get_their_share():
    """capture and replay hand each actor this process's --threads divided among them."""
    for path in ("capture/distributed.py", "replay/run.py"):
        text = (ROOT / path).read_text()
        assert "console.threads.share(n)" in text, path


# --- 2. refusals before heavy imports, reuse without the model ----------------------------------
def _probe(tmp_path, body: str) -> subprocess.CompletedProcess:
    code = "\n".join(["import sys", body,
                      "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]",
                      "print('HEAVY', heavy)"])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=run_env(tmp_path), cwd=ROOT)


@pytest.mark.parametrize("call, message", [
    ("replay.cli:main|['--traces', T, '--run', 'nonexistent']", "no complete evaluation runs"),
    ("replay.cli:main|['--traces', T, '--budget', '999']", "out of range"),
    ("replay.cli:main|['--traces', T, '--mode', 'closed', '--ranking', 'oracle']",
     "closed loop takes runtime rankings only"),
    ("capture.cli:main|['--model', 'olmoe', '--out', T]", "cannot be reached (offline)"),
    ("capture.cli:main|['--run', 'a/b', '--out', T]", "--run 'a/b' is not allowed"),
    ("analysis.moesd:main|['--model', 'olmoe']", "cannot be reached (offline)"),
    ("moe.inspect_model:main|['--model', 'olmoe']", "cannot be reached (offline)"),
    ("training.cli:train_draft|['--model', 'olmoe']", "cannot be reached (offline)"),
    ("analysis.evaluate_cli:main|['--traces', T + '/missing']", "no complete runs"),
])
def test_refusals_come_before_torch_and_transformers(traces, tmp_path, call, message):
    target, args = call.split("|")
    module, func = target.split(":")
    body = (f"T = {str(traces)!r}\nfrom {module} import {func}\n"
            f"code = {func}({args})\nprint('CODE', code)")
    done = _probe(tmp_path, body)
    assert "CODE 2" in done.stdout and "HEAVY []" in done.stdout, (done.stdout, done.stderr)
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], done.stderr


def test_fully_reused_replay_answers_without_the_model_or_torch(traces, tmp_path):
    args = ["--traces", str(traces), "--ranking", "router", "oracle", "--budget", "16,24",
            "--no-progress", "--out", str(tmp_path / "results")]
    first = subprocess.run([str(BIN / "replay"), *args, "--output", str(tmp_path / "a.json")],
                           capture_output=True, text=True, env=run_env(tmp_path))
    assert first.returncode == 0, first.stderr
    argv = [*args, "--output", str(tmp_path / "b.json")]
    body = f"from replay.cli import main\ncode = main({argv!r})\nprint('CODE', code)"
    done = _probe(tmp_path, body)
    assert "CODE 0" in done.stdout and "HEAVY []" in done.stdout, (done.stdout, done.stderr)
    assert "reused stored results for run eval (model not loaded)" in done.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["model_loaded"] and not b["model_loaded"] and b["reused"] == ["eval"]
    assert a["summary"] == b["summary"] and len(b["summary"]) == 8  # 2 rankings × 2 × 2


def test_a_missing_cell_still_loads_the_model_and_computes(traces, tmp_path):
    from replay import cli as replay_cli

    def replay(budgets: str, output: str) -> dict:
        assert replay_cli.main(["--traces", str(traces), "--ranking", "router", "--budget",
                                budgets, "--coverage", "truncation", "--no-progress", "--out",
                                str(tmp_path / "results"), "--output",
                                str(tmp_path / output)]) == 0
        return json.loads((tmp_path / output).read_text())

    assert replay("8", "a.json")["model_loaded"]
    b = replay("8,16", "b.json")  # 16 is missing: computed (8 is reused inside)
    assert b["model_loaded"] and {r["budget"] for r in b["summary"]} == {8, 16}
    assert not replay("16", "c.json")["model_loaded"]


# --- 3. replay's summary ------------------------------------------------------------------------
class _Run:
    def __init__(self, name):
        self.name, self.model, self.bench = name, "tiny-olmoe", "mbpp"


def test_summary_is_a_pivot_per_coverage_with_the_gap_closed():
    from replay.cli import summary_lines
    rows = []
    for cov in ("truncation", "substitution"):
        for b, (router, oracle, coact) in {8: (0.4, 0.2, 0.3), 16: (0.2, 0.1, 0.1)}.items():
            rows += [dict(ranking=r, coverage=cov, budget=b, rse=v, tree_layers=16)
                     for r, v in (("router", router), ("oracle", oracle), ("coact", coact))]
    lines = summary_lines(pl.DataFrame(rows), "open", [_Run("eval")],
                          ["router", "oracle", "coact"], ["truncation", "substitution"])
    assert lines[0] == ("tiny-olmoe / mbpp / run eval: open-loop replay, mean RSE (lower is "
                        "better); 16 tree-layers per cell")
    assert lines[1] == "coverage truncation:" and "coverage substitution:" in lines
    head, b8, b16, gap = (line.split() for line in lines[2:6])
    assert head == ["budget", "router", "oracle", "coact", "gap", "closed", "at", "B"]
    assert b8 == ["8", "0.4000", "0.2000", "0.3000", "50%"]
    assert b16 == ["16", "0.2000", "0.1000", "0.1000", "100%"]
    assert gap == ["gap", "closed,", "all", "B", "0%", "100%", "67%"]  # (0.6 − 0.4) / (0.6 − 0.3)
    assert len(lines) == 1 + 2 * 5 + 3  # and a footnote saying how each gap closed is made
    assert lines[-3].startswith("gap closed at B: (router − X) / (router − oracle)")
    assert lines[-2].startswith("gap closed, all B: Σ_B (router − X) / Σ_B (router − oracle)")
    assert "not a per-budget value" in lines[-1]


def test_summary_without_the_pair_has_no_gap_and_closed_loop_says_tau():
    from replay.cli import summary_lines
    frame = pl.DataFrame([dict(ranking="router", coverage="substitution", budget=b,
                               accepted_length=t, captured_accepted_length=3.0, trees=5)
                          for b, t in ((16, 2.5), (32, 2.9))])
    lines = summary_lines(frame, "closed", [_Run("a"), _Run("b")], ["router"], ["truncation",
                                                                                "substitution"])
    assert "run {a, b}" in lines[0] and "accepted length" in lines[0]
    assert "captured τ 3.000" in lines[0] and not any("gap" in line for line in lines)
    assert [line.split() for line in lines[2:]] == [["budget", "router"], ["16", "2.500"],
                                                    ["32", "2.900"]]


def test_replay_prints_the_pivot_and_writes_every_row(traces, tmp_path, capsys):
    from replay import cli as replay_cli
    args = ["--traces", str(traces), "--ranking", "router", "oracle", "--budget", "16,24",
            "--no-progress", "--out", str(tmp_path / "results")]
    for suffix in ("csv", "parquet", "json"):
        assert replay_cli.main([*args, "--output", str(tmp_path / f"s.{suffix}")]) == 0
    out = capsys.readouterr().out
    assert "tiny-olmoe / mbpp / run eval: open-loop replay, mean RSE" in out
    assert "coverage truncation:" in out and "coverage substitution:" in out
    assert "SELECT * FROM replay_open" in out
    csv = pl.read_csv(tmp_path / "s.csv")
    assert csv.height == 8 and {"rse", "token_error", "mass_excluded"} <= set(csv.columns)
    parquet = pl.read_parquet(tmp_path / "s.parquet")
    assert parquet.columns == csv.columns and parquet.height == 8
    assert len(json.loads((tmp_path / "s.json").read_text())["summary"]) == 8


# --- 4. broken pipes ----------------------------------------------------------------------------
def test_query_into_head_ends_quietly(traces, tmp_path):
    script = (f"{BIN / 'query'} --traces {traces} \"SELECT * FROM routing\" --format json "
              "| head -c 100 > /dev/null; echo \"status ${PIPESTATUS[0]}\"")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env=run_env(tmp_path))
    assert done.stderr == "", done.stderr
    assert done.stdout.strip() == f"status {pipes.EXIT_BROKEN_PIPE}"
    done = subprocess.run(["bash", "-c", f"{BIN / 'replay'} --help | head -1"],
                          capture_output=True, text=True, env=run_env(tmp_path))
    assert done.stdout.startswith("usage: replay") and done.stderr == ""


@pytest.mark.parametrize("printer", ["print", "rich.console.Console().print"])
def test_plain_and_rich_output_into_head_exit_141(tmp_path, printer):
    module = printer.rsplit(".", 2)[0] if "." in printer else "sys"
    code = (f"import sys, {module}\nfrom console.pipes import quiet_broken_pipe\n"
            "@quiet_broken_pipe\ndef main():\n    for i in range(200_000):\n"
            f"        {printer}('line', i)\n    return 0\nsys.exit(main())")
    script = f"{sys.executable} -c \"{code}\" | head -1 > /dev/null; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=run_env(tmp_path))
    assert done.stdout.strip() == "141" and done.stderr == "", done.stderr


def test_the_guard_turns_a_broken_pipe_into_141(monkeypatch):
    monkeypatch.setattr(pipes, "_silence_stdout", lambda: None)  # (pytest owns stdout here)

    @pipes.quiet_broken_pipe
    def main(argv=None):
        raise BrokenPipeError(32, "Broken pipe")

    assert main() == 141
    assert pipes.quiet_broken_pipe(lambda: 3)() == 3


# --- 5. why a program failed -------------------------------------------------------------------
def test_failed_programs_keep_the_exception_class_and_message():
    from analysis import quality
    trace = ('Traceback (most recent call last):\n  File "program.py", line 3, in <module>\n'
             "NameError: name 'remove_Occ' is not defined\n")
    assert quality.answer_of(Score("pass@1", 0.0, "failed", trace)) == \
        "failed: NameError: name 'remove_Occ' is not defined"
    assert quality.answer_of(Score("pass@1", 0.0, "failed", "AssertionError\n")) == \
        "failed: AssertionError"
    long = "ValueError: " + "x" * 1000
    assert len(quality.answer_of(Score("pass@1", 0.0, "failed", long))) == \
        len("failed: ") + quality.REASON_CHARS
    assert quality.answer_of(Score("pass@1", 0.0, "failed", "some output\n")) == "failed"
    assert quality.answer_of(Score("pass@1", 0.0, "timeout", "")) == "timeout"
    assert quality.answer_of(Score("pass@1", 1.0, "passed", "ok\n")) == "passed"
    assert quality.answer_of(Score("accuracy", 0.0, "42", "")) == "42"
    import pyarrow as pa
    table = pa.table({"answer": ["failed: NameError: name 'x'", "failed: NameError: y",
                                 "timeout", "passed", "17", "failed"],
                      "score": [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]})
    assert quality.failures(table) == [("NameError", 2), ("failed", 1), ("timeout", 1)]


# --- 6. command names that run ------------------------------------------------------------------
def test_commands_are_named_so_that_they_run(monkeypatch, tmp_path, capsys):
    commands.command.cache_clear()
    try:
        monkeypatch.setenv("PATH", "/usr/bin:/bin")
        monkeypatch.chdir(ROOT)
        exe = BIN / "replay"
        want = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else str(exe)
        assert commands.command("replay") == want
        assert commands.commandline("replay --budget 24") == f"{want} --budget 24"
        assert commands.commandline("python bench/x.py") == "python bench/x.py"
        commands.command.cache_clear()
        monkeypatch.chdir(tmp_path)
        assert commands.command("replay") == str(exe)
        commands.command.cache_clear()
        monkeypatch.setenv("PATH", f"{BIN}:/usr/bin:/bin")
        assert commands.command("replay") == "replay"
        assert commands.command("not-a-command") == "not-a-command"
        commands.command.cache_clear()
        monkeypatch.setenv("PATH", "/usr/bin:/bin")
        p = console.ArgumentParser(prog="replay", examples="replay --budget 24")
        assert f"  {exe} --budget 24" in p.format_help()
        with pytest.raises(SystemExit):
            p.error("bad")
        assert capsys.readouterr().err == f"replay: error: bad (see {exe} --help)\n"
    finally:
        commands.command.cache_clear()


def test_help_and_error_hints_use_the_working_path(tmp_path):
    env = dict(run_env(tmp_path), PATH="/usr/bin:/bin")
    done = subprocess.run([str(BIN / "capture"), "--help"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert f"  {BIN / 'capture'} --model tiny-olmoe" in done.stdout
    done = subprocess.run([str(BIN / "query"), "--traces", str(tmp_path / "none"), "SELECT 1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert f"run `{BIN / 'capture'}` first" in done.stderr
    done = subprocess.run([str(BIN / "replay"), "--threads", "0"], capture_output=True,
                          text=True, env=env, cwd=tmp_path)
    assert done.stderr.strip().endswith(f"(see {BIN / 'replay'} --help)")
