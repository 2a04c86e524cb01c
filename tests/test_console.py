"""console/: what every command shares beyond tests/test_cli.py's promises: --threads on every
command that computes, quiet broken pipes, and command names (in examples and hints) that run
from where the user is."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import run_env

from moe_spec import console
from moe_spec.console import commands, pipes, threads

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.path.abspath(sys.executable)).parent
COMPUTING = {  # commands that compute -> module:function
    "capture": "moe_spec.capture.cli:main", "replay": "moe_spec.replay.cli:main",
    "report": "moe_spec.analysis.report:main",
    "evaluate": "moe_spec.analysis.evaluate_cli:main",
    "profile-target": "moe_spec.profiling.profile_target:main",
    "inspect-model": "moe_spec.profiling.inspect_model:main",
    "train-tiny": "moe_spec.training.cli:train_tiny",
    "train-draft": "moe_spec.training.cli:train_draft",
}


def entry(target: str):
    import importlib
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


# --- --threads --------------------------------------------------------------------------------
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


# --- broken pipes -----------------------------------------------------------------------------
def test_query_into_head_ends_quietly(one_prompt, tmp_path):
    script = (f"{BIN / 'query'} --traces {one_prompt} \"SELECT * FROM routing\" --format json "
              "| head -c 100 > /dev/null; echo \"status ${PIPESTATUS[0]}\"")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env=run_env(tmp_path))
    assert done.stderr == "", done.stderr
    assert done.stdout.strip() == f"status {pipes.EXIT_BROKEN_PIPE}"
    done = subprocess.run(["bash", "-c", f"{BIN / 'replay'} --help | head -1"],
                          capture_output=True, text=True, env=run_env(tmp_path))
    assert done.stdout.startswith("usage: replay") and done.stderr == ""


@pytest.mark.slow  # fresh processes: a closed pipe
@pytest.mark.parametrize("printer", ["print", "rich.console.Console().print"])
def test_plain_and_rich_output_into_head_exit_141(tmp_path, printer):
    module = printer.rsplit(".", 2)[0] if "." in printer else "sys"
    code = (f"import sys, {module}\nfrom moe_spec.console.pipes import quiet_broken_pipe\n"
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


# --- command names that run -------------------------------------------------------------------
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


@pytest.mark.slow  # fresh processes
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
