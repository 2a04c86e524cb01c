"""Scale-out on Ray: starting or joining a cluster, and how many actors of which kind.

capture and replay both spread their work over Ray actors (one per GPU, or per CPU slot with one
torch thread each); this is the little they share. Ray is an optional extra
(``pip install -e .[ray]``): nothing imports it until ``--workers`` or ``--ray-address`` asks.
"""

from __future__ import annotations

import os
import socket
import sys

from errors import UserError


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
    """Refuse, in one line and within ``timeout`` seconds, a ``host:port`` (or
    ``ray://host:port``) address nothing listens on; ``auto`` and ``local`` are Ray's to find."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ClusterError(f"--ray-address {address!r} is not host:port, ray://host:port or "
                           "auto; check --ray-address")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError, OverflowError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ClusterError(f"cannot reach the Ray cluster at {address} within {timeout:.0f} s "
                           f"({why}); check --ray-address or `ray status`") from None


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
