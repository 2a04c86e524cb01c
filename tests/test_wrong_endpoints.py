"""A --ray-address or an S3 endpoint that is unreachable, or accepts connections but is something
else (a web server, a gRPC server without Ray's method): one line naming it, exit code 2, fast
and before the model loads."""

import functools
import http.server
import os
import subprocess
import sys
import threading
import time

import pytest
from helpers import CAP_ONE as CAP
from helpers import copy_of, one_line, one_line_error, run

from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import location

pytestmark = pytest.mark.ray  # joins (or fails to join) Ray clusters: run beside no other


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


# --- Ray ------------------------------------------------------------------------------------------
def test_an_unreachable_ray_address_fails_fast(replayed, tmp_path):
    pytest.importorskip("ray")
    start = time.monotonic()
    r = run("moe_spec.capture.cli", *CAP, "--out", tmp_path / "x", "--ray-address",
            "127.0.0.1:1", timeout=120)
    one_line_error(r, "127.0.0.1:1", "--ray-address")
    r = run("moe_spec.replay.cli", "--traces", copy_of(replayed[0], tmp_path), "--ranking", "router",
            "--budget",
            "8", "--no-progress", "--ray-address", "127.0.0.1:1", timeout=120)
    one_line_error(r, "127.0.0.1:1", "--ray-address")
    assert time.monotonic() - start < 110


@pytest.mark.slow  # a fresh process and Ray
def test_capture_refuses_a_ray_address_that_is_not_ray(web_server, tmp_path):
    r = run("moe_spec.capture.cli", *CAP, "--out", tmp_path / "t", "--ray-address", web_server,
            timeout=90)  # it retried for ever
    one_line_error(r, web_server, "is not a Ray cluster", "--ray-address")


def test_capture_refuses_an_unreachable_ray_address_before_the_model_loads(tmp_path, capsys,
                                                                           no_model):
    code = capture_cli.main([*CAP, "--out", str(tmp_path / "t"), "--ray-address", "127.0.0.1:1"])
    one_line(capsys, code, "127.0.0.1:1", "--ray-address")


@pytest.mark.slow  # a fresh process and Ray
def test_joining_a_cluster_that_is_not_ray_answers_in_one_line(web_server):
    """What replay (and capture's workers) call to join: a handshake with a deadline."""
    pytest.importorskip("ray")
    code = ("import sys; from moe_spec.cluster import ClusterError, init_ray\n"
            "from moe_spec.errors import fail\n"
            f"try:\n    init_ray(0, {web_server!r})\n"
            "except ClusterError as exc:\n    sys.exit(fail('replay', exc))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90, cwd=os.path.dirname(os.path.dirname(__file__)))
    one_line_error(done, web_server, "is not a Ray cluster")


def test_a_grpc_answer_without_rays_method_is_not_a_cluster():
    """The handshake reads HTTP/2 frames: a server that answers the call with trailers only (a
    gRPC server without Ray's method) is refused; a reply message is Ray's answer."""
    import socket

    from moe_spec import cluster

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


# --- S3 -------------------------------------------------------------------------------------------
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
