"""Writing outputs: query, replay and evaluate never replace a FIFO, a symbolic link or a folder,
``--out -`` is stdout, train-tiny refuses a linked --out before training, failed writes leave no
temporary file, and a failed capture write blames the disk only when the disk failed."""

import errno
import os
import time

import pyarrow as pa
import pytest
from helpers import QUERY, call, copy_of, one_line_error, run

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

    def half_written(table, where, **kwargs):
        open(where, "wb").write(b"PAR1 half")
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
