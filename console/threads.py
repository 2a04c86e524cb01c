"""``--threads N``: how many CPU threads a command computes with, in one place.

    threads.add_argument(parser)          # the flag, checked at parse time
    n = threads.apply(args.threads)       # before the heavy work: OMP/MKL/… and torch

The default is the number of CPUs this process may use (its affinity mask, and a cgroup CPU
quota where one is set), or ``$OMP_NUM_THREADS`` when that is lower; it never exceeds them. A
larger ``--threads`` is clamped to them with a one-line note (more threads than CPUs only
contend). Ray workers get their share: :func:`share`.

Standard library only: the parser must not import torch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

# thread pools that read their size from the environment when they start (set before import)
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
            "VECLIB_MAXIMUM_THREADS", "POLARS_MAX_THREADS", "RAYON_NUM_THREADS")
ENV_APPLIED = "MOESPEC_THREADS"  # what apply() chose, for code that starts its own pools

_applied: int | None = None


def available() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def default() -> int:
    """``$OMP_NUM_THREADS`` if set and lower, else :func:`available`."""
    n = available()
    try:
        env = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return n
    return min(n, env) if env >= 1 else n


def add_argument(parser: argparse.ArgumentParser, group=None, what: str = "torch") -> None:
    """``--threads N`` on ``parser`` (or its argument ``group``): a value below 1 is a one-line
    error, one above the CPUs available is clamped with a note on stderr."""
    def count(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{n} must be at least 1")
        cap = available()
        if n > cap:
            print(f"{parser.prog}: note: --threads {n} is more than the {cap} CPUs this process "
                  f"may use; using {cap}", file=sys.stderr)
            return cap
        return n
    (group or parser).add_argument(
        "--threads", type=count, default=None, metavar="N",
        help=f"CPU threads for {what} (default: the {available()} CPUs this process may use, or "
             "$OMP_NUM_THREADS if lower)")


def resolve(n: int | None) -> int:
    """``n`` clamped to 1..available(), or the default for None."""
    return default() if n is None else max(1, min(int(n), available()))


def apply(n: int | None, *, torch: bool = True) -> int:
    """Use ``n`` threads (None: the default) from here on and return it: the environment of
    every native pool that has not started yet (and of child processes), and torch's intra-op
    pool (``torch`` imported here if asked, after the environment is set)."""
    global _applied
    n = resolve(n)
    for var in ENV_VARS:
        os.environ[var] = str(n)
    os.environ[ENV_APPLIED] = str(n)
    if torch or "torch" in sys.modules:
        import torch as _torch
        _torch.set_num_threads(n)
    _applied = n
    return n


def current() -> int:
    """The thread count applied in this process (or the default if none was)."""
    if _applied is not None:
        return _applied
    try:
        return resolve(int(os.environ[ENV_APPLIED]))
    except (KeyError, ValueError):
        return default()


def share(workers: int, total: int | None = None) -> int:
    """Threads per worker when ``workers`` share ``total`` (default: :func:`current`)."""
    return max(1, (current() if total is None else total) // max(1, workers))
