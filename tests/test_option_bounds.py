"""Hostile input, round 4 (issue 41; issue 42 item 16): numeric options that are not numbers
(``--lr nan``), sizes beyond the model, malformed lease objects, a ``--ray-address`` or an S3
endpoint that accepts connections but is something else, and refusals that came only after the
model had loaded.

Every case ends in one clear line naming the problem, exit code 2, before any model loads (the
loaders are replaced by ones that fail the test if called)."""

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from test_hardening import one_line_error, run  # noqa: I001 - tests/ module

from capture import cli as capture_cli
from catalog import location

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "1", "--max-new-tokens", "8",
       "--no-progress", "--threads", "1"]


def one_line(capsys, code, *words):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def exit_code(main, argv):
    """``main(argv)``'s exit status, whether returned or raised (argparse's ``error``)."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.fixture
def no_model(monkeypatch):
    """Any model, draft or training started fails the test: refusals come before them."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    from eagle import loading
    from moe import models
    monkeypatch.setattr(models, "load", loaded)
    monkeypatch.setattr(loading, "load_with_draft", loaded)


@pytest.fixture
def web_server(tmp_path):
    """A plain HTTP server (Python's static file server) on a free port of 127.0.0.1, serving
    ``tmp_path/www``: it accepts TCP and answers HTTP, but is neither Ray nor S3."""
    root = tmp_path / "www"
    (root / "pages").mkdir(parents=True)
    (root / "pages" / "index.html").write_text("<html>hello</html>")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # no line per request on stderr
            pass
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# --- 6. train-tiny / train-draft numeric options ------------------------------------------------
@pytest.fixture
def no_training(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("training started before the refusal")
    import training.draft
    import training.tiny_moe
    monkeypatch.setattr(training.tiny_moe, "train", started)
    monkeypatch.setattr(training.draft, "train", started)


@pytest.mark.parametrize("command", ["train_tiny", "train_draft"])
@pytest.mark.parametrize("args,words", [
    (["--lr", "nan"], ["--lr nan", "finite"]),
    (["--lr", "inf"], ["--lr inf", "finite"]),
    (["--lr=-inf"], ["--lr -inf"]),
    (["--lr", "1e9"], ["--lr 1000000000.0", "at most 10"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--seed", "99999999999999999999999"], ["--seed"]),
    (["--steps", "99999999999999999999"], ["--steps"]),
    (["--batch", "1000000"], ["--batch 1000000"]),
    (["--seq-len", "100000"], ["--seq-len 100000", "4096"]),
])
def test_training_numbers_are_checked_before_any_work(command, args, words, tmp_path, capsys,
                                                      no_training, no_model):
    from training import cli
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path / "out"), "--threads", "1", *args]
    one_line(capsys, exit_code(getattr(cli, command), argv), *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,words", [
    (["--new-tokens", "100000"], ["--new-tokens 100000", "4096"]),
    (["--draft-vocab", "5000"], ["--draft-vocab 5000", "4096"]),  # tiny-olmoe's vocabulary
    (["--ttt", "100000"], ["--ttt 100000"]),
    (["--intermediate", "10000000"], ["--intermediate"]),
])
def test_draft_sizes_are_bounded_by_the_target(args, words, tmp_path, capsys, no_training,
                                               no_model):
    from training import cli
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path / "out"), "--threads", "1", *args]
    one_line(capsys, exit_code(cli.train_draft, argv), *words)


# --- 7. malformed lease objects -----------------------------------------------------------------
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


# --- 10. profile-target / profile-batch sizes ---------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--prefix", "1000000000"], ["--prefix 1000000000", "max_position_embeddings 4096"]),
    (["--gammas", "1,100000"], ["--gammas 100000", "max_position_embeddings"]),
    (["--batches", "1,10000000"], ["--batches 10000000"]),
    (["--repeats", "100000000"], ["--repeats 100000000"]),
    (["--batches", "4096", "--prefix", "4000"], ["tokens in one forward"]),
])
def test_profile_target_sizes_are_bounded_before_the_model_loads(args, words, tmp_path, capsys,
                                                                 no_model):
    from analysis import moesd
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path), "--threads", "1", *args]
    one_line(capsys, exit_code(moesd.main, argv), *words)


@pytest.mark.parametrize("args,words", [
    (["--batch-sizes", "1,10000000"], ["--batch-sizes"]),
    (["--limit", "99999999999"], ["--limit 99999999999"]),
    (["--offset", "99999999999"], ["--offset 99999999999"]),
    (["--max-new-tokens", "100000"], ["--max-new-tokens 100000", "max_position_embeddings"]),
    (["--budget", "65"], ["--budget 65", "8..64"]),
    (["--budget", "4"], ["--budget 4", "8..64"]),  # substitution needs B >= k
    (["--budget", "99999999999"], ["--budget"]),
])
def test_profile_batch_sizes_are_bounded_before_the_model_loads(args, words, tmp_path, capsys,
                                                                no_model):
    from capture import profile_batch
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path), "--threads", "1", "--no-progress",
            *args]
    one_line(capsys, exit_code(profile_batch.main, argv), *words)


# --- 11. a --ray-address that accepts TCP but is not Ray ----------------------------------------
def test_capture_refuses_a_ray_address_that_is_not_ray(web_server, tmp_path):
    r = run("capture.cli", *CAP, "--out", tmp_path / "t", "--ray-address", web_server,
            timeout=90)  # it retried for ever
    one_line_error(r, web_server, "is not a Ray cluster", "--ray-address")


def test_capture_refuses_an_unreachable_ray_address_before_the_model_loads(tmp_path, capsys,
                                                                           no_model):
    code = capture_cli.main([*CAP, "--out", str(tmp_path / "t"), "--ray-address", "127.0.0.1:1"])
    one_line(capsys, code, "127.0.0.1:1", "--ray-address")


def test_joining_a_cluster_that_is_not_ray_answers_in_one_line(web_server):
    """What replay (and capture's workers) call to join: a handshake with a deadline."""
    pytest.importorskip("ray")
    code = ("import sys; from cluster import ClusterError, init_ray; from errors import fail\n"
            f"try:\n    init_ray(0, {web_server!r})\n"
            "except ClusterError as exc:\n    sys.exit(fail('replay', exc))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90, cwd=os.path.dirname(os.path.dirname(__file__)))
    one_line_error(done, web_server, "is not a Ray cluster")


def test_a_grpc_answer_without_rays_method_is_not_a_cluster():
    """The handshake reads HTTP/2 frames: a server that answers the call with trailers only (a
    gRPC server without Ray's method) is refused; a reply message is Ray's answer."""
    import socket

    import cluster

    def serve(frames):
        listener = socket.create_server(("127.0.0.1", 0))

        def answer():
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(frames)
                time.sleep(0.5)
        threading.Thread(target=answer, daemon=True).start()
        return listener

    settings = cluster._frame(cluster.SETTINGS, 0, 0, b"")
    trailers = cluster._frame(cluster.HEADERS, cluster.END_HEADERS | cluster.END_STREAM, 1,
                              b"\x88")
    reply = cluster._frame(cluster.DATA, 0, 1, b"\x00\x00\x00\x00\x02\x12\x00")
    for frames, expected in ((settings + trailers, "without Ray's method"),
                             (settings + reply, None)):
        listener = serve(frames)
        with listener:
            found = cluster.handshake("127.0.0.1", listener.getsockname()[1], False, 10)
        assert (found is None) if expected is None else expected in found, found


# --- 12. capture refuses before the model loads ------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--budget", "65"], ["--budget 65", "8..64"]),
    (["--budget", "4"], ["--budget 4", "8..64", "substitution"]),
    (["--budget", "0", "--coverage", "truncation"], ["--budget 0", "1..64"]),
    (["--budget", "16", "--calibration", "nothing-here"], ["--calibration", "nothing-here",
                                                            "not found"]),
])
def test_capture_checks_budget_and_calibration_before_the_model_loads(args, words, tmp_path,
                                                                     capsys, no_model):
    code = capture_cli.main([*CAP, "--out", str(tmp_path / "t"), *args])
    one_line(capsys, code, *words)


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
    from catalog.writer import RunWriter
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

    from catalog.writer import RunWriter
    remote = f"s3://{S3_BUCKET}/held-early"
    holder = RunWriter(location.root(remote), "tiny-olmoe", "mbpp", "r")
    holder.lock()
    try:
        code = capture_cli.main([*CAP, "--out", remote, "--run", "r"])
        one_line(capsys, code, "being written by another capture", ".lock is held by")
    finally:
        holder.close()


# --- 13b. an S3 endpoint that is a web server ---------------------------------------------------
@pytest.mark.parametrize("bucket", ["pages", "no-such-bucket"])  # 200 HTML / 404 HTML
def test_an_endpoint_that_does_not_speak_s3_is_named(web_server, bucket, monkeypatch, capsys,
                                                     no_model):
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()  # none kept from another test's endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{web_server}")
    for name, value in dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                            AWS_DEFAULT_REGION="us-east-1").items():
        monkeypatch.setenv(name, value)
    location.use_storage_options(None)
    monkeypatch.setattr(location, "_checked", set())
    code = capture_cli.main([*CAP, "--out", f"s3://{bucket}/traces"])
    s3fs.S3FileSystem.clear_instance_cache()
    err = one_line(capsys, code, "does not speak S3", web_server, "AWS_ENDPOINT_URL")
    assert "does not exist" not in err
