"""Where capture writes, checked before the model loads: an --out that is not a folder, a run
being written by another capture (its lock or lease held), and a malformed lease object, which
is named and taken over after its lifetime, never a crash."""

import json
import os

import pytest
from helpers import CAP_ONE as CAP
from helpers import one_line

from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import location

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out


@pytest.mark.parametrize("kind", ["file", "fifo", "device", "dangling", "under-a-file"])
def test_capture_refuses_an_out_that_is_not_a_folder_before_the_model_loads(kind, tmp_path,
                                                                            capsys, no_model):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("x")
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "device":
        out = "/dev/null"
    elif kind == "dangling":
        out.symlink_to(tmp_path / "nothing")
    else:
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "traces"
    code = capture_cli.main([*CAP, "--out", str(out)])
    one_line(capsys, code, "--out", "choose a writable --out")
    assert not (tmp_path / "nothing").exists()


def test_capture_refuses_a_run_being_written_before_the_model_loads(tmp_path, capsys,
                                                                    no_model):
    from moe_spec.catalog.writer import RunWriter
    holder = RunWriter(tmp_path / "t", "tiny-olmoe", "mbpp", "r")
    holder.lock()
    try:
        code = capture_cli.main([*CAP, "--out", str(tmp_path / "t"), "--run", "r"])
        one_line(capsys, code, "being written by another capture", ".lock is held")
    finally:
        holder.close()


def test_capture_refuses_a_run_whose_lease_is_held_before_the_model_loads(s3, capsys,
                                                                          no_model):
    from conftest import S3_BUCKET

    from moe_spec.catalog.writer import RunWriter
    remote = f"s3://{S3_BUCKET}/held-early"
    holder = RunWriter(location.root(remote), "tiny-olmoe", "mbpp", "r")
    holder.lock()
    try:
        code = capture_cli.main([*CAP, "--out", remote, "--run", "r"])
        one_line(capsys, code, "being written by another capture", ".lock is held by")
    finally:
        holder.close()


# --- malformed lease objects ----------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"[1,2]", b"5", b'{"expires": "soon"}', b"null", b"1e300",
                                  b'{"owner": "x", "expires": 1e300}', b"NaN",
                                  b'{"expires": true}', b"\xff\xfe not json"])
def test_a_malformed_lease_is_named_and_taken_over_after_its_lifetime(s3, body):
    from conftest import S3_BUCKET
    from filelock import Timeout
    path = location.root(f"s3://{S3_BUCKET}/malformed") / f"{abs(hash(body))}.lock"
    s3.pipe(location.fs_path(path), body)
    lease = location.Lease(path, seconds=4)
    with pytest.raises(Timeout):  # counts as held for a lifetime after it was written
        lease.acquire(timeout=0)
    said = lease.describe()
    assert len(said.splitlines()) == 1 and "malformed lease" in said and str(path) in said, said
    lease.acquire(timeout=60, poll_interval=0.2)  # then taken over, never a crash
    try:
        assert json.loads(s3.cat_file(location.fs_path(path)))["owner"] == lease.owner
    finally:
        lease.release()
    assert not s3.exists(location.fs_path(path))


def test_a_capture_refused_by_a_malformed_lease_says_so_in_one_line(s3, capsys, no_model,
                                                                    monkeypatch):
    from conftest import S3_BUCKET
    monkeypatch.setenv(location.LEASE_SECONDS_ENV, "120")  # held all through the test
    remote = f"s3://{S3_BUCKET}/malformed-run"
    lock = f"{S3_BUCKET}/malformed-run/runs/model=tiny-olmoe/bench=mbpp/run=r/.lock"
    s3.pipe(lock, b'{"owner": "someone", "expires": "soon"}')
    code = capture_cli.main([*CAP, "--out", remote, "--run", "r"])
    one_line(capsys, code, "being written by another capture", "malformed lease", "soon")
