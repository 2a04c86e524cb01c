"""Scale-out on Ray: starting or joining a cluster, and how many actors of which kind.

capture and replay both spread their work over Ray actors (one per GPU, or per CPU slot with one
torch thread each); this is the little they share. Ray is an optional extra
(``pip install -e .[ray]``): nothing imports it until ``--workers`` or ``--ray-address`` asks.
"""

from __future__ import annotations


class ClusterError(RuntimeError):
    """Ray missing or unreachable; the message is one line for the user."""


def init_ray(workers: int, ray_address: str | None):
    """Connect to ``ray_address``, or start a local cluster with ``workers`` CPU slots (reuses
    one already started in this process). Returns the ``ray`` module."""
    try:
        import ray
    except ImportError:
        raise ClusterError("--workers / --ray-address need Ray: pip install -e .[ray]") from None
    if not ray.is_initialized():
        try:
            if ray_address:
                ray.init(address=ray_address, log_to_driver=False)
            else:
                ray.init(num_cpus=max(1, workers), include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ClusterError(f"cannot start or join the Ray cluster ({first}); check "
                               "--ray-address or `ray status`") from None
    return ray


def worker_options(device: str) -> dict:
    """One GPU per actor on CUDA, else one CPU slot."""
    return {"num_gpus": 1} if str(device).startswith("cuda") else {"num_cpus": 1}


def count_workers(ray, workers: int, device: str) -> int:
    """``workers``, or as many actors as the cluster has GPUs (CUDA) or CPU slots."""
    if workers:
        return workers
    resources = ray.cluster_resources()
    return max(1, int(resources.get("GPU" if str(device).startswith("cuda") else "CPU", 1)))
