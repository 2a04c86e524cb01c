"""Running model-written code: a sandboxed subprocess, never this process.

Every program runs in a fresh ``python -I -S`` (isolated: no user site, no environment, no
current directory on the path) inside a new empty temporary folder, in its own session, with

* limits: CPU seconds, address space, file size, open files and processes (``setrlimit``);
  running as root it first drops to the unprivileged ``nobody`` user, so the process limit
  holds and the file system is out of reach;
* no network: a new network namespace with no interfaces where the kernel allows it (as root),
  and in any case ``socket`` replaced by a stub before the program runs;
* a wall-clock timeout after which the whole process group is killed.

It returns a :class:`Result`; a program that hangs, crashes, forks without end or eats memory
gets ``passed=False`` and a reason, never a hang or harm to the machine.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

TIMEOUT = 10.0  # seconds of wall time
MEMORY = 1 << 30  # bytes of address space
PROCESSES = 16
FILE_SIZE = 10 << 20
CLONE_NEWNET = 0x40000000

PREAMBLE = """
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in the sandbox")
_s.socket = _s.create_connection = _s.socketpair = _no_network
del _s, _no_network
"""


@dataclass
class Result:
    passed: bool
    reason: str  # "passed", "failed", "timeout", "error: …"
    stdout: str = ""


def _drop_privileges() -> None:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


@functools.lru_cache(maxsize=1)
def interpreter() -> str | None:
    """A Python the sandbox user can run: this one, or as root the first interpreter the
    ``nobody`` user can execute (a virtual environment under /root cannot be), else None."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            ok = subprocess.run([candidate, "-I", "-S", "-c", "pass"], preexec_fn=_drop_privileges,
                                capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return candidate
    return None


def _limit(timeout: float):
    """Runs in the child before exec: session, namespace, user, limits."""
    def apply():
        os.setsid()
        if os.geteuid() == 0:
            try:  # no network interfaces at all (needs CAP_SYS_ADMIN)
                ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)
            except (OSError, AttributeError):
                pass
            _drop_privileges()
        cpu = int(timeout) + 1
        for what, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, MEMORY),
                            (resource.RLIMIT_FSIZE, FILE_SIZE), (resource.RLIMIT_NOFILE, 64),
                            (resource.RLIMIT_NPROC, PROCESSES), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value))
    return apply


def run_python(program: str, timeout: float = TIMEOUT) -> Result:
    """Run ``program`` (Python source) in the sandbox; passed = exit status 0."""
    python = interpreter()
    if python is None:
        return Result(False, "error: no Python interpreter the unprivileged sandbox user can run")
    with tempfile.TemporaryDirectory(prefix="moespec-sandbox-") as folder:
        os.chmod(folder, 0o777)
        path = os.path.join(folder, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(PREAMBLE + "\n" + program)
        os.chmod(path, 0o644)
        proc = subprocess.Popen([python, "-I", "-S", path], cwd=folder,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env={"PATH": "/usr/bin:/bin"},
                                preexec_fn=_limit(timeout))
        try:
            out, _ = proc.communicate(timeout=timeout)
            reason = "passed" if proc.returncode == 0 else (
                "killed (cpu, memory or process limit)" if proc.returncode < 0 else "failed")
            return Result(proc.returncode == 0, reason, out.decode("utf-8", "replace")[-2000:])
        except subprocess.TimeoutExpired:
            return Result(False, "timeout")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it started goes too
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
