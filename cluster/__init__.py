"""Scale-out on Ray: starting or joining a cluster, and how many actors of which kind.

capture and replay both spread their work over Ray actors (one per GPU, or per CPU slot with one
torch thread each); this is the little they share, and the :class:`Executor` protocol both
drivers execute their plan with. Ray is an optional extra (``pip install -e .[ray]``): nothing
imports it until ``--workers`` or ``--ray-address`` asks.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Protocol

from moe_spec.errors import UserError


class Executor(Protocol):
    """Where a command's work runs once its plan is made: this process, or Ray actors
    (``--workers``/``--ray-address``). Capture's executors decode prompts
    (:class:`capture.run.Executor`: ``load`` the targets, ``capture`` prompts), replay's compute
    result blocks (:class:`replay.run.Executor`: ``compute`` a run's tasks); both name themselves
    for progress bars and release what they started with ``close`` (idempotent)."""

    label: str  # how a progress bar names it ("" for this process)

    def close(self) -> None:
        """Release what the executor started (actors, models); safe to call twice."""


class ClusterError(UserError, RuntimeError):
    """Ray missing or unreachable; the message is one line for the user."""


def init_ray(workers: int, ray_address: str | None):
    """Connect to ``ray_address``, or start a local cluster with ``workers`` CPU slots (reuses
    one already started in this process). Returns the ``ray`` module."""
    try:
        import ray
    except ImportError:
        raise ClusterError("--workers / --ray-address need Ray: pip install -e .[ray]") from None
    if not ray.is_initialized():
        if ray_address:
            check_reachable(ray_address)  # Ray itself retries an unreachable address forever
        try:
            if ray_address:
                ray.init(address=ray_address, log_to_driver=False)
            else:  # never more CPU slots than the machine has
                ray.init(num_cpus=max(1, min(workers, os.cpu_count() or 1)),
                         include_dashboard=False, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ClusterError(f"cannot start or join the Ray cluster ({first}); check "
                               "--ray-address or `ray status`") from None
    return ray


CONNECT_TIMEOUT_S = 10.0


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse, in one line and within about ``timeout`` seconds, a ``host:port`` (or
    ``ray://host:port``) address that is not a Ray cluster: nothing listens there, or what
    listens does not answer Ray's handshake (:func:`handshake`: an HTTP server, another
    service). ``auto`` and ``local`` are Ray's to find. Ray itself retries such an address for
    ever."""
    if address in ("auto", "local"):
        return
    client = address.lower().startswith("ray://")
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise ClusterError(f"--ray-address {address!r} is not host:port, ray://host:port or "
                           "auto; check --ray-address")
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError, OverflowError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ClusterError(f"cannot reach the Ray cluster at {address} within {timeout:.0f} s "
                           f"({why}); check --ray-address or `ray status`") from None
    problem = handshake(host, int(port), client, timeout)
    if problem:
        kind = "a Ray Client server (ray://host:10001)" if client else \
            "a Ray cluster's GCS (host:6379, or ray://host:10001 for Ray Client)"
        raise ClusterError(f"{address} accepts connections but is not {kind}: {problem}; "
                           "check --ray-address or `ray status`")


# One gRPC call, spoken over a plain socket (Ray ships no Python gRPC): HTTP/2's client preface,
# an empty SETTINGS frame, then the call as a HEADERS frame (HPACK literals, no Huffman) and a
# DATA frame holding the gRPC-framed request message.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
GCS_PROBE = ("/ray.rpc.NodeInfoGcsService/GetClusterId", b"")  # GetClusterIdRequest {}
CLIENT_PROBE = ("/ray.rpc.RayletDriver/ClusterInfo", b"\x08\x06")  # ClusterInfoRequest{PING}


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") \
        + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name (both strings < 127 bytes)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _grpc_call(path: str, message: bytes, authority: str) -> bytes:
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
        ("content-type", "application/grpc"), ("te", "trailers")))
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    return (H2_PREFACE + _frame(SETTINGS, 0, 0, b"") + _frame(HEADERS, END_HEADERS, 1, headers)
            + _frame(DATA, END_STREAM, 1, body))


def handshake(host: str, port: int, client: bool, timeout: float) -> str | None:
    """One Ray RPC with a deadline, over a plain socket: the GCS's ``GetClusterId`` (a
    ``host:port`` address), or a Ray Client server's ``ClusterInfo(PING)`` (``ray://``). None
    when the answer is a reply message (only Ray serves these methods); else why not, in a few
    words (an HTTP/1 server, a gRPC server without the method, silence)."""
    import time
    path, message = CLIENT_PROBE if client else GCS_PROBE
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_grpc_call(path, message, f"{host}:{port}"))
            buffer, first = b"", True
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"no Ray answer within {timeout:.0f} s"
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    return "it closed the connection without a Ray answer"
                buffer += chunk
                if first and len(buffer) >= 9 and buffer[3] != SETTINGS:
                    said = buffer[:40].decode("ascii", "replace").splitlines()[0]
                    return f"not gRPC: it answered {said!r}" if said.isprintable() else \
                        "not gRPC: it answered something else"
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags = buffer[3], buffer[4]
                    stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                    buffer, first = buffer[9 + length:], False
                    if kind == SETTINGS and not flags & ACK:
                        sock.sendall(_frame(SETTINGS, ACK, 0, b""))
                    elif kind == DATA and stream == 1 and length >= 5:
                        return None  # a reply message: the method exists, Ray answered
                    elif kind == HEADERS and stream == 1 and flags & END_STREAM:
                        return "a gRPC server without Ray's method"
                    elif kind in (RST_STREAM, GOAWAY):
                        return "it refused the call"
    except socket.timeout:
        return f"no Ray answer within {timeout:.0f} s"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def cap_workers(workers: int, items: int, device: str, *, local: bool = True) -> int:
    """``workers`` capped at the ``items`` there are to spread (prompts) and, on a local CPU
    cluster, at this machine's CPUs; a note on stderr says so."""
    if workers <= 0:
        return workers
    limit, why = max(1, items), f"{items} prompt(s)"
    cpus = os.cpu_count() or 1
    if local and not str(device).startswith("cuda") and cpus < limit:
        limit, why = cpus, f"{cpus} CPU(s)"
    if workers > limit:
        print(f"note: --workers {workers} capped at {limit} ({why} to work on)", file=sys.stderr)
        return limit
    return workers


def worker_options(device: str) -> dict:
    """One GPU per actor on CUDA, else one CPU slot."""
    return {"num_gpus": 1} if str(device).startswith("cuda") else {"num_cpus": 1}


def count_workers(ray, workers: int, device: str, items: int | None = None) -> int:
    """``workers``, or as many actors as the cluster has GPUs (CUDA) or CPU slots; never more
    than ``items`` (the prompts to spread) where given."""
    if not workers:
        resources = ray.cluster_resources()
        workers = max(1, int(resources.get("GPU" if str(device).startswith("cuda") else "CPU",
                                           1)))
    return workers if items is None else max(1, min(workers, items))


def actor_failure(exc: BaseException) -> str:
    """One line saying why a Ray actor or its task failed: the user's exception itself where Ray
    kept it (``RayTaskError.cause``), else the last line of Ray's report (an actor that died in
    ``__init__`` carries its creation task's traceback, whose last line is the exception)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
