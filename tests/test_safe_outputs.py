"""Writing outputs: query, replay and evaluate never replace a FIFO, a symbolic link or a folder,
``--out -`` is stdout, train-tiny refuses a linked --out before training, failed writes leave no
temporary file, and a failed capture write blames the disk only when the disk failed."""

import errno
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import QUERY, call, copy_of, exit_code, one_line, one_line_error, run

from moe_spec.capture.background import WriterFailed
from moe_spec.capture.run import write_errors
from moe_spec.tasks import benchmarks

BENCHMARKS = os.environ.get(benchmarks.ENV_VAR) or str(benchmarks.DEFAULT_DIR)


def test_query_never_replaces_a_fifo_or_a_symlink(replayed, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run("moe_spec.analysis.query_cli", QUERY, "--traces", replayed[0], "--format", "csv", "--out",
            fifo, timeout=60)
    one_line_error(r, "not a regular file")
    assert fifo.is_fifo()
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("precious")
    link = tmp_path / "out.csv"
    link.symlink_to(target)
    for fmt in ("csv", "parquet"):
        r = run("moe_spec.analysis.query_cli", QUERY, "--traces", replayed[0], "--format", fmt, "--out",
                link)
        one_line_error(r, "symbolic link")
        assert link.is_symlink() and target.read_text() == "precious"
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_query_out_dash_is_stdout(replayed, tmp_path):
    r = call("moe_spec.analysis.query_cli", QUERY, "--traces", replayed[0], "--format", "csv", "--out", "-")
    assert r.returncode == 0 and r.stdout.strip() == replayed[1].strip()
    assert not (replayed[0].parent / "-").exists() and not (tmp_path / "-").exists()


def test_replay_and_evaluate_outputs_refuse_links_and_folders(replayed, tmp_path):
    traces = copy_of(replayed[0], tmp_path)
    target = tmp_path / "precious.json"
    target.write_text("precious")
    link = tmp_path / "summary.json"
    link.symlink_to(target)
    r = call("moe_spec.replay.cli", "--traces", traces, "--ranking", "router", "--budget", "16",
             "--no-progress", "--output", link)
    one_line_error(r, "symbolic link")
    assert target.read_text() == "precious" and link.is_symlink()
    folder = tmp_path / "a-folder"
    folder.mkdir()
    r = call("moe_spec.analysis.evaluate_cli", "--traces", traces, "--benchmarks", BENCHMARKS, "--output",
             folder)
    one_line_error(r, "a folder")
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_train_tiny_refuses_a_symlink_out_before_training(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    start = time.monotonic()
    r = call("moe_spec.training.cli:train_tiny", "--model", "tiny-olmoe", "--out", tmp_path / "link",
             "--force", "--steps", "2000", timeout=120)
    one_line_error(r, "symbolic link")
    assert time.monotonic() - start < 60 and (tmp_path / "link").is_symlink()


def test_failed_writes_leave_no_temporary_files(tmp_path, monkeypatch):
    from moe_spec import console
    from moe_spec.catalog import atomic
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError):
        console.write_json(tmp_path / "summary.json", loop)  # not serialisable
    (tmp_path / "keep.txt").write_text("x")

    def half_written(table, where, **kwargs):  # where: the open temporary file
        where.write(b"PAR1 half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic.pq, "write_table", half_written)
    with pytest.raises(OSError):
        atomic.write_table(tmp_path / "t.parquet", pa.table({"a": [1]}))
    with pytest.raises(atomic.UnsafeTarget, match="symbolic link"):
        (tmp_path / "link").symlink_to(tmp_path / "keep.txt")
        atomic.write_bytes(tmp_path / "link", b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "link"]
    assert (tmp_path / "keep.txt").read_text() == "x"


def test_write_errors_blame_the_disk_only_for_oserror(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    for exc in (full, _failed(full)):
        message = str(write_errors(tmp_path)(exc))
        assert "No space left on device" in message and "free space" in message
    for exc in (_failed(ValueError("need at least one array to concatenate")),
                KeyError("step")):
        message = str(write_errors(tmp_path)(exc))
        assert "free space" not in message and "another --out" not in message
        assert type(exc.__cause__ or exc).__name__ in message
    assert "need at least one array" in str(write_errors(tmp_path)(
        _failed(ValueError("need at least one array to concatenate"))))


def _failed(cause: BaseException) -> WriterFailed:
    try:
        raise WriterFailed(str(cause)) from cause
    except WriterFailed as exc:
        return exc


# ---- outputs never delete what they did not write (issue 60) ----------------------------------
def _export(traces, fmt, dest, *more):
    from moe_spec.capture import export_routing
    return exit_code(export_routing.main, ["--format", fmt, "--run", "eval", "--traces",
                                           str(traces), str(dest), *more])


def _intact(traces) -> list[str]:
    """The traces' files (relative), to compare before and after."""
    return sorted(str(p.relative_to(traces)) for p in traces.rglob("*") if p.is_file())


@pytest.mark.parametrize("fmt,name", [("sglang", "out.jsonl"), ("vllm", "out.jsonl"),
                                      ("megatron", "mdir"), ("llamacpp", "cdir")])
def test_export_never_writes_through_a_planted_link(one_prompt, tmp_path, monkeypatch, fmt, name):
    """``ln -s victim .out.jsonl.tmp`` (or ``.mdir.tmp`` linked to a folder) overwrote the
    victim: every temporary name is now fresh (``mkstemp``/``mkdtemp``), never followed."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    victim_file = tmp_path / "victim.txt"
    victim_file.write_text("precious")
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    planted = [f".{name}.tmp", f".{name}.tmp.npz", f".{name}.old", f".{name}.new", f"{name}.tmp",
               f".{name}.partial"]
    for i, p in enumerate(planted):
        (work / p).symlink_to(victim_dir if i % 2 else victim_file)
    assert _export(one_prompt, fmt, name) == 0
    assert victim_file.read_text() == "precious" and not any(victim_dir.iterdir())
    assert all((work / p).is_symlink() for p in planted)  # not ours: never deleted either
    dest = work / name
    assert (dest.is_dir() if fmt in ("megatron", "llamacpp") else dest.is_file())
    assert sorted(p.name for p in work.iterdir()) == sorted([*planted, name])  # nothing left


def test_atomic_writes_never_delete_or_follow_a_file_at_the_old_temporary_name(tmp_path):
    from moe_spec import console
    from moe_spec.catalog import atomic
    mine = tmp_path / ".summary.json.tmp"
    mine.write_text("the user's own file")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / ".t.parquet.tmp").symlink_to(victim)
    console.write_json(tmp_path / "summary.json", {"a": 1})
    atomic.write_table(tmp_path / "t.parquet", pa.table({"a": [1]}))
    assert mine.read_text() == "the user's own file" and victim.read_text() == "precious"
    assert (tmp_path / ".t.parquet.tmp").is_symlink()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}
    assert oct((tmp_path / "summary.json").stat().st_mode & 0o077) != "0o0"  # not left 0600


def _holder(tmp_path, one_prompt):
    """A folder holding a copy of a traces root, with the export marker planted in it."""
    from moe_spec.capture import export_routing
    holder = tmp_path / "holder"
    holder.mkdir()
    traces = copy_of(one_prompt, holder)
    (holder / export_routing.MARKER).write_text("{}")
    return holder, traces


@pytest.mark.parametrize("where", ["traces", "traces-inside", ".", "..", "holder", "foreign"])
def test_export_force_never_replaces_what_it_did_not_write(one_prompt, tmp_path, monkeypatch,
                                                           capsys, where):
    """``--force`` with DEST the traces root, ``.`` or ``..`` deleted it (the run being
    exported included) before writing anything; a foreign non-empty folder was deleted too."""
    traces = copy_of(one_prompt, tmp_path)
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "keep.txt").write_text("mine")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    monkeypatch.chdir(work / "sub" if where == ".." else work)
    holder, held = _holder(tmp_path, one_prompt)
    dest = {"traces": traces, "traces-inside": traces / "runs", ".": Path("."), "..": Path(".."),
            "holder": holder, "foreign": foreign}[where]
    before = _intact(tmp_path)
    capsys.readouterr()
    code = _export(traces, "megatron", dest, "--force")
    one_line(capsys, code, "DEST")
    assert _intact(tmp_path) == before


def test_export_force_replaces_its_own_output(one_prompt, tmp_path, capsys):
    dest = tmp_path / "mdir"
    assert _export(one_prompt, "megatron", dest) == 0
    (dest / "stale.txt").write_text("from the last export")
    capsys.readouterr()
    one_line(capsys, _export(one_prompt, "megatron", dest), "pass --force")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    err = one_line(capsys, _export(one_prompt, "megatron", foreign), "did not write")
    assert "pass --force" not in err  # it would not help
    assert _export(one_prompt, "megatron", dest, "--force") == 0
    assert not (dest / "stale.txt").exists() and (dest / "router_trace_rank0.jsonl").is_file()
    out = tmp_path / "out.jsonl"
    out.write_text("my notes, not JSON lines\n")
    capsys.readouterr()
    one_line(capsys, _export(one_prompt, "sglang", out, "--force"), "not a file this command wrote")
    assert out.read_text() == "my notes, not JSON lines\n"
    out.unlink()
    assert _export(one_prompt, "sglang", out) == 0
    assert _export(one_prompt, "sglang", out, "--force") == 0


@pytest.mark.parametrize("fmt,name", [("sglang", "out.jsonl"), ("megatron", "mdir")])
def test_export_output_must_differ_from_dest(one_prompt, tmp_path, capsys, fmt, name):
    dest = tmp_path / name
    capsys.readouterr()
    one_line(capsys, _export(one_prompt, fmt, dest, "--output", str(dest)), "--output", "DEST")
    assert not dest.exists()
    one_line(capsys, _export(one_prompt, fmt, dest, "--output",
                             str(one_prompt / "runs" / "s.json")), "inside the traces folder")
    assert not dest.exists() and not (one_prompt / "runs" / "s.json").exists()


def test_report_and_replay_refuse_outputs_inside_the_traces(one_prompt, tmp_path, capsys):
    from moe_spec.analysis import report
    from moe_spec.replay import cli as replay_cli
    traces = copy_of(one_prompt, tmp_path)
    before = _intact(traces)
    capsys.readouterr()
    one_line(capsys, exit_code(report.main, ["--traces", str(traces), "--out",
                                             str(traces / "reports")]),
             "--out", "inside the traces folder")
    for argv in (["--out", str(traces / "runs" / "results")],
                 ["--output", str(traces / "summary.json")]):
        one_line(capsys, exit_code(replay_cli.main, ["--traces", str(traces), "--ranking",
                                                     "router", "--no-progress", *argv]),
                 "inside the traces folder")
    assert _intact(traces) == before
