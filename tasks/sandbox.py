"""Running model-written code: a throw-away Linux sandbox, never this process.

Each program gets its own user, mount, PID, network, IPC, UTS and cgroup namespaces
(``unshare`` from util-linux, with no new packages; running as root the harness first drops to
the unprivileged ``nobody`` user, so the sandbox's root is ``nobody`` outside it). Inside, a small
init (PID 1 of the new PID namespace) builds a new root file system and then starts the program:

* **files**: a read-only view of ``/usr`` (with the ``/bin``, ``/lib*`` links), the Python
  installation and ``/etc/ld.so.cache`` only; a fresh ``/proc`` of the new PID namespace; ``/dev``
  with ``null``, ``zero``, ``full``, ``random``, ``urandom``; and three private tmpfs mounts of
  ``WRITABLE`` bytes each: the working folder ``/sandbox``, ``/tmp`` and ``/dev/shm``. Everything
  else (``/work``, ``/home``, ``/root``, ``/etc``, ``/var``, the host's ``/tmp``) is absent, and
  every file the program writes vanishes with the namespace;
* **processes**: only the sandbox's own (PID 1 is its init); when the program ends, or at the
  wall-clock limit, its init dies and the kernel kills every process in the namespace, whether it
  called ``setsid`` or not; nested user namespaces are refused;
* **no privileges**: the program runs with no capabilities at all (empty bounding set,
  ``no_new_privs``), so it cannot remount, mount or ``ptrace`` its init;
* **limits**: CPU seconds, 1 GiB of address space per process, file size, open files, processes
  (counted per sandbox, so leftovers of one program cannot starve the next), no core files;
* **no network**: the network namespace has only its loopback, and that is down.

Two ways to run a program, neither resting on the exit status:

* :func:`run_calls` (what MBPP and HumanEval scoring uses): the program (setup and code, never the
  tests) runs, then the runner evaluates each *call* the harness sent (an expression of the
  program's functions with test inputs as plain data, e.g. ``f(_v0)``) and writes their values,
  strictly encoded, as one document ``<nonce> <JSON list>`` on an inherited file descriptor
  (fd 4; stdout is never read for it). Only exact built-in types are encoded: None, bool, int,
  float, complex, str, bytes, list, tuple, set, frozenset, dict (``Counter``, ``OrderedDict`` and
  ``defaultdict`` as the dict they hold), checked with ``type(v) is ...``, so an object with its
  own ``__eq__`` (a subclass included) is refused and the run fails. This process accepts exactly
  one well-formed document with one value per call, rebuilds the values itself from JSON (no code
  of the program runs here) and returns them; :mod:`tasks.scoring` evaluates every assert here
  with them and decides. The expected values never enter the sandbox. Guaranteed: a pass means
  every call's value, as plain data, made every assert true when evaluated in this process. A
  program that tampers with its interpreter (frame walking to the nonce, ``/proc/self/mem``,
  tracing hooks, replacing the runner's encoder) can still choose what values come back, but
  that is all it can do: the same as returning them, so it passes only with values that satisfy
  the tests (e.g. answers hard-coded from the asserts an MBPP prompt shows). The calls are
  only calls of the task's functions (named by its reference or prompt, never by the program)
  on plain arguments, whichever side of the comparison they are on (HumanEval/33 compares
  ``candidate`` with ``sort_third``, the same function); ``abs``, ``sorted`` and the like run
  in the scorer, a call's optional ``convert`` (``list`` of an iterator) is the runner's own
  built-in, and the prompt's helpers (/32's ``poly``) run in a sandbox of the prompt alone.
* :func:`run_python` (the escape tests): the harness makes a random nonce, the init hands it to
  a small runner through a pipe the runner reads and closes at once, the runner executes the
  program (setup, code and tests in one module) and only if that returns normally writes
  ``<nonce> passed`` on the inherited fd before ``os._exit``. ``os._exit(0)``, ``sys.exit(0)``,
  an exception in an ``atexit`` hook or a printed fake verdict therefore score as failures. Not
  guaranteed: this verdict is written inside the sandbox, so a program that reads the nonce from
  the runner's frame or its own memory, or rewrites its own tests (objects equal to everything),
  can fake it; nothing is scored with it.

Without ``unshare``, user namespaces, or a Python the sandbox user can run, :func:`run_python`
raises :class:`SandboxUnavailable` (one line naming the fix) instead of running untrusted code.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from moe_spec.errors import UserError

TIMEOUT = 10.0  # seconds of wall time
MEMORY = 1 << 30  # bytes of address space per process
PROCESSES = 16  # per sandbox, its init included
FILE_SIZE = 10 << 20  # bytes per file
WRITABLE = 16 << 20  # bytes of each private tmpfs: /sandbox, /tmp, /dev/shm
OPEN_FILES = 64
SANDBOX_UID = 65534  # nobody: who the sandbox is outside it when the harness runs as root
OUTPUT = 2000  # characters of output kept
RESULTS = 4 << 20  # bytes of the calls' values (run_calls) accepted; more is a failure
SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
LEGACY_REMOUNT = False  # tests: remount each bind read-only one by one, as without mount_setattr


class SandboxUnavailable(UserError, OSError):
    """The sandbox cannot be built here; untrusted code is not run at all."""


@dataclass
class Result:
    passed: bool  # run_calls: every call returned plain data (values holds them), nothing more
    reason: str  # "passed" ("returned" for run_calls), "failed", "timeout",
    # "killed (cpu, memory or process limit)"
    stdout: str = ""
    values: list | None = None  # run_calls: each call's value, decoded in this process


# ---- plain data across the sandbox's boundary --------------------------------------------------
# JSON with tags: None, bool, int, str and list as themselves; every other plain type as a
# one-key object ({"float": repr}, {"tuple": [...]}, {"set": [...]}, {"frozenset": [...]},
# {"dict": [[key, value], ...]}, {"complex": [repr, repr]}, {"bytes": hex}). Only exact built-in
# types are encoded (``type(v) is int``, never isinstance), so a subclass or any object with its
# own ``__eq__`` is refused; decoding builds fresh built-in values and refuses everything else.
PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)
DEPTH = 100  # levels of nesting accepted


def encode(value, depth: int = 0):
    """``value`` as tagged JSON data; TypeError (ValueError: nested too deep) if it is not
    plain built-in data."""
    t = type(value)
    if depth > DEPTH:
        raise ValueError(f"nested more than {DEPTH} deep")
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        return {"float": repr(value)}
    if t is list:
        return [encode(x, depth + 1) for x in value]
    if t is tuple or t is set or t is frozenset:
        return {t.__name__: [encode(x, depth + 1) for x in value]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in value.items()]}
    if t is complex:
        return {"complex": [repr(value.real), repr(value.imag)]}
    if t is bytes:
        return {"bytes": value.hex()}
    raise TypeError(f"{t.__qualname__} is not plain data")


def _float(text) -> float:
    if type(text) is not str or len(text) > 64:
        raise ValueError("a float is not spelled as one")
    return float(text)


def decode(data, depth: int = 0):
    """The value that :func:`encode` made ``data`` of (as parsed by ``json.loads``); ValueError
    for anything else. Only built-in constructors run on the data."""
    t = type(data)
    if depth > DEPTH + 1:
        raise ValueError(f"nested more than {DEPTH} deep")
    if data is None or t is bool or t is int or t is str:
        return data
    if t is list:
        return [decode(x, depth + 1) for x in data]
    if t is not dict or len(data) != 1:
        raise ValueError(f"not a tagged value: {type(data).__name__}")
    (tag, x), = data.items()
    if tag == "float":
        return _float(x)
    if tag == "complex" and type(x) is list and len(x) == 2:
        return complex(_float(x[0]), _float(x[1]))
    if tag == "bytes" and type(x) is str:
        return bytes.fromhex(x)
    if type(x) is not list:
        raise ValueError(f"bad {tag!r} value")
    if tag == "dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in x):
            raise ValueError("a dict's items are not pairs")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in x}
    kinds = {"tuple": tuple, "set": set, "frozenset": frozenset}
    if tag not in kinds:
        raise ValueError(f"unknown tag {tag!r}")
    return kinds[tag](decode(v, depth + 1) for v in x)


def _reject_constant(name: str):
    raise ValueError(f"{name} outside a float tag")


def parse_values(document: bytes, nonce: str, count: int) -> list:
    """The calls' values from what the runner wrote: exactly ``<nonce> <JSON list>\n``, one
    document, ``count`` entries, each decoded by :func:`decode`; ValueError for anything else."""
    head = nonce.encode() + b" "
    if not document.startswith(head) or not document.endswith(b"\n") or \
            document.count(b"\n") != 1 or len(document) > RESULTS:
        raise ValueError("not one results document from the runner")
    data = json.loads(document[len(head):-1].decode("utf-8"), parse_constant=_reject_constant)
    if type(data) is not list or len(data) != count:
        raise ValueError(f"not a list of {count} values")
    return [decode(v) for v in data]


def _sandbox_user() -> dict:
    """Popen arguments that drop to ``nobody`` when the harness runs as root."""
    if os.geteuid() != 0:
        return {}
    return dict(user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[])


_PROBE = ("import os, sys; print(os.path.realpath(sys.executable)); print(sys.base_prefix); "
          "print(sys.base_exec_prefix)")


@functools.lru_cache(maxsize=1)
def _python() -> tuple[str, str, str] | None:
    """(executable, prefix, exec prefix) of the first Python the sandbox user can run: this one,
    else the system's (a virtual environment under /root is out of ``nobody``'s reach)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run([os.path.realpath(candidate), "-I", "-S", "-c", _PROBE],
                                  capture_output=True, timeout=30, cwd="/",
                                  env={"PATH": SYSTEM_PATH}, **_sandbox_user())
        except (OSError, subprocess.SubprocessError):
            continue
        lines = done.stdout.decode(errors="replace").splitlines()
        if done.returncode == 0 and len(lines) == 3:
            return lines[0], lines[1], lines[2]
    return None


def interpreter() -> str | None:
    """The Python that runs sandboxed programs (None: there is none the sandbox user can run)."""
    found = _python()
    return found[0] if found else None


@functools.lru_cache(maxsize=1)
def layout() -> dict:
    """What the sandbox's root holds: read-only binds of host paths and top-level links."""
    found = _python()
    if found is None:
        raise SandboxUnavailable(
            "code sandbox unavailable: no Python the unprivileged sandbox user can run "
            "(install python3: apt-get install python3)")
    python, prefix, exec_prefix = found
    binds, links = ["/usr"], []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            binds.append(top)
    for path in (prefix, exec_prefix, os.path.dirname(python)):
        path = os.path.realpath(path)
        if path != "/" and not any(path == b or path.startswith(b + "/") for b in binds):
            binds.append(path)
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    return dict(python=python, binds=binds, links=links)


def unshare() -> str:
    """The ``unshare`` program (util-linux), or :class:`SandboxUnavailable`."""
    found = shutil.which("unshare", path=SYSTEM_PATH)
    if found is None:
        raise SandboxUnavailable("code sandbox unavailable: `unshare` not found "
                                 "(install util-linux: apt-get install util-linux)")
    return found


# PID 1 of the sandbox: runs as root of the new user namespace (``nobody`` or the harness's user
# outside), builds the root file system, starts the runner without privileges, waits for it and
# exits, which kills everything left in the namespace. Reports on the status pipe: ``ready``,
# then ``exit N`` (N: the runner's exit status, 128 + signal if killed), or ``error …``.
INIT = r'''
import ctypes, fcntl, json, os, signal, stat, sys
c = json.loads(sys.argv[1])
def high(fd):  # out of the way of the runner's fds 0-4
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved
STATUS, VERDICT = high(c["status"]), high(c["verdict"])
def say(line):
    os.write(STATUS, (line + "\n").encode())
signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores signals it has no handler for
def _expire(*_):
    say("exit timeout")
    os._exit(124)
signal.signal(signal.SIGALRM, _expire)
signal.alarm(c["wall"])  # the sandbox dies at its limit even if the harness is gone
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
def mount(src, dst, fs, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(dst), enc(fs), flags, enc(data)), f"mount {dst}")
class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]
def read_only(dst):
    """dst and every mount below it read-only, nosuid, nodev."""
    if not c["legacy_remount"]:
        attr = MountAttr(1 | 2 | 4, 0, 0, 0)  # MOUNT_ATTR_RDONLY | NOSUID | NODEV
        ok = libc.syscall(ctypes.c_long(442), ctypes.c_int(-100), dst.encode(),  # mount_setattr
                          ctypes.c_uint(0x8000), ctypes.byref(attr), ctypes.c_size_t(32))
        if ok == 0:
            return
        if ctypes.get_errno() != 38:  # ENOSYS: a kernel before 5.12
            check(ok, f"mount_setattr {dst}")
    with open("/proc/self/mountinfo") as f:
        points = [l.split()[4].encode().decode("unicode_escape") for l in f]
    for point in points:
        if point == dst or point.startswith(dst + "/"):
            st = os.statvfs(point)
            keep = 0
            for bit, flag in ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, 1024),
                              (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21)):
                if st.f_flag & bit:
                    keep |= flag
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)
try:
    data = sys.stdin.buffer.read()
    nonce, calls, program = data.split(b"\n", 2)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # host paths, opened before the new root hides them (it is mounted on /tmp)
    sources = {p: os.open(p, os.O_PATH) for p in c["binds"]}
    devices = {d: os.open("/dev/" + d, os.O_PATH) for d in ("null", "zero", "full", "random",
                                                             "urandom")}
    R = "/tmp"
    mount("tmpfs", R, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    def bind(fd, dst):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
    os.makedirs(R + "/dev")
    mount("tmpfs", R + "/dev", "tmpfs", MS_NOSUID, "size=64k,nr_inodes=64,mode=0755")
    for name, fd in devices.items():
        bind(fd, f"{R}/dev/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{R}/dev/{name}")
    for path, mode in (("/dev/shm", "1777"), ("/tmp", "1777"), ("/sandbox", "0755")):
        os.makedirs(R + path, exist_ok=True)
        mount("tmpfs", R + path, "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={c['writable']},nr_inodes=4096,mode={mode}")
    for path, fd in sources.items():
        bind(fd, R + path)
        read_only(R + path)
    for path, target in c["links"]:
        os.symlink(target, R + path)
    os.makedirs(R + "/proc", exist_ok=True)
    mount("proc", R + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    with open(R + "/sandbox/program.py", "wb") as f:
        f.write(program)
    if calls:  # the runner reads and deletes it before the program starts
        with open(R + "/sandbox/calls.json", "wb") as f:
            f.write(calls)
    for fd in (*sources.values(), *devices.values()):
        os.close(fd)
    os.chdir(R)
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"no pivot_root number for {os.uname().machine}")
    check(libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "detach the host root")  # MNT_DETACH
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")  # no nested user namespace (it would give the program capabilities back)
    nonce_r, nonce_w = map(high, os.pipe())
    os.close(0)
except Exception as exc:
    say(f"error {exc}")
    os._exit(125)
say("ready")
pid = os.fork()
if pid == 0:
    try:
        null = high(os.open("/dev/null", os.O_RDONLY))
        for src, dst in ((null, 0), (nonce_r, 3), (VERDICT, 4)):
            os.dup2(src, dst)  # inheritable copies: what the runner gets
        os.chdir("/sandbox")
        import resource
        for what, value in ((resource.RLIMIT_CPU, c["cpu"]), (resource.RLIMIT_AS, c["memory"]),
                            (resource.RLIMIT_FSIZE, c["file_size"]),
                            (resource.RLIMIT_NOFILE, c["open_files"]),
                            (resource.RLIMIT_NPROC, c["processes"]), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value))
        cap = 0
        while libc.prctl(24, cap, 0, 0, 0) == 0:  # PR_CAPBSET_DROP, until EINVAL
            cap += 1
        libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
        check(libc.prctl(28, 0xC3, 0, 0, 0), "securebits")  # NOROOT, NO_CAP_AMBIENT_RAISE, locked
        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        caps = (ctypes.c_uint32 * 6)()
        check(libc.capset(ctypes.byref(Header(0x20080522, 0)), caps), "capset")
        check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Cap") and int(line.split()[1], 16):
                    raise OSError(f"capabilities left: {line.strip()}")
        os.closerange(5, STATUS)
        os.closerange(STATUS + 1, 1 << 16)
        os.execve(c["python"], [c["python"], "-I", "-S", "-c", c["runner"],
                                *(["calls"] if calls else [])],
                  {"PATH": "/usr/bin:/bin"})  # STATUS is close-on-exec
    except BaseException as exc:
        say(f"error starting the program: {exc}")
    os._exit(125)
os.close(nonce_r)
os.close(VERDICT)
os.write(nonce_w, nonce + b"\n")
os.close(nonce_w)
while True:
    done, status = os.wait()  # orphans are reaped here too
    if done == pid:
        break
code = os.waitstatus_to_exitcode(status)
say(f"exit {code if code >= 0 else 128 - code}")
os._exit(0)
'''

# The program's interpreter: reads the nonce (and closes its pipe), runs program.py as __main__.
# Plain mode: writes ``<nonce> passed`` only if that returned normally. Calls mode (argument
# ``calls``): reads and deletes calls.json first, then evaluates each call's expression in the
# program's namespace and writes ``<nonce> <JSON list of the values>`` (strictly encoded: plain
# built-in values only) — data that this process checks, never a verdict. Never runs atexit hooks.
RUNNER = r'''
import os, sys
def _runner():
    nonce = os.read(3, 256).strip()
    os.close(3)
    write, leave = os.write, os._exit
    calls = None
    if sys.argv[1:] == ["calls"]:
        with open("calls.json", "rb") as f:
            calls = f.read()
        os.unlink("calls.json")
    import collections, json, traceback, types
    loads, dumps, kind, rep, chars = json.loads, json.dumps, type, repr, str
    MAPPINGS = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)
    NoneType, items, fromhex = kind(None), dict.items, bytes.fromhex
    CONVERT = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "dict": dict,
               "sorted": sorted, "str": str, "int": int, "float": float, "bool": bool,
               "len": len}  # taken before the program runs: it cannot redefine them
    def encode(v, depth=0):  # exact built-in types only: a subclass is not plain data
        t = kind(v)
        if depth > 100:
            raise ValueError("nested more than 100 deep")
        if t is NoneType or t is bool or t is int or t is chars:
            return v
        if t is float:
            return {"float": float.__repr__(v)}
        if t is list:
            return [encode(x, depth + 1) for x in v]
        if t is tuple or t is set or t is frozenset:
            return {t.__name__: [encode(x, depth + 1) for x in v]}
        if any(t is m for m in MAPPINGS):  # compared as the dict they hold
            return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in items(v)]}
        if t is complex:
            return {"complex": [float.__repr__(v.real), float.__repr__(v.imag)]}
        if t is bytes:
            return {"bytes": bytes.hex(v)}
        raise TypeError(f"{rep(t)[:200]} is not plain data (None, bool, int, float, complex, "
                        "str, bytes, list, tuple, set, frozenset, dict; Counter, OrderedDict "
                        "and defaultdict as dict)")
    def decode(v):  # the environment of a call: plain data this process' parent encoded
        if kind(v) is list:
            return [decode(x) for x in v]
        if kind(v) is not dict:
            return v
        (tag, x), = v.items()
        if tag == "float":
            return float(x)
        if tag == "complex":
            return complex(float(x[0]), float(x[1]))
        if tag == "bytes":
            return fromhex(x)
        if tag == "dict":
            return {decode(k): decode(y) for k, y in x}
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(y) for y in x)
    def flush():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
    def fail(exc, skip):
        try:
            tb = exc.__traceback__
            for _ in range(skip):
                tb = tb.tb_next if tb is not None else None
            traceback.print_exception(kind(exc), exc, tb)
        except BaseException:
            pass
        flush()
        leave(1)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = "program.py", __builtins__
    sys.modules["__main__"], sys.argv = main, ["program.py"]
    try:
        with open("program.py", encoding="utf-8") as f:
            code = compile(f.read(), "program.py", "exec")
        exec(code, main.__dict__)
    except BaseException as exc:
        fail(exc, 1)
    if calls is None:
        flush()
        write(4, nonce + b" passed\n")
        leave(0)
    values = []
    try:
        for number, call in enumerate(loads(calls), 1):
            space = dict(main.__dict__)
            space.update({name: decode(v) for name, v in call["env"].items()})
            value = eval(compile(call["expr"], f"<test {number}>", "eval"), space)
            if call.get("convert"):
                value = CONVERT[call["convert"]](value)
            try:
                values.append(None if call["discard"] else encode(value))
            except (TypeError, ValueError, RecursionError) as exc:
                raise TypeError(f"test {number}: {call['expr'][:200]} returned a value that "
                                f"is not plain data: {exc}") from None
        document = nonce + b" " + dumps(values).encode() + b"\n"
    except BaseException as exc:
        fail(exc, 1)
    flush()
    while document:
        document = document[write(4, document):]
    leave(0)
_runner()
'''


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's init and wait for ``unshare``: the kernel kills the whole PID
    namespace and lets the init go only once every process in it is gone, so nothing is left
    when this returns."""
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        children = []
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=10 if children else 0.5)
    except subprocess.TimeoutExpired:  # no children list: unshare --kill-child takes the init
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def run_python(program: str, timeout: float = TIMEOUT) -> Result:
    """Run ``program`` (Python source: code and its tests) in the sandbox; passed = the runner's
    nonce verdict arrived (the program ran to its end), never the exit status alone. Code in the
    program can fake that verdict (see the module docstring): scoring uses :func:`run_calls`."""
    return _run(program, timeout, None)


CONVERSIONS = (None, "list", "tuple", "set", "frozenset", "dict", "sorted", "str", "int", "float",
               "bool", "len")  # what a call's ``convert`` may name (the runner's own built-ins)


def run_calls(program: str, calls: list[dict], timeout: float = TIMEOUT) -> Result:
    """Run ``program`` (setup and code, no tests) in the sandbox, then evaluate each call there:
    ``{"expr": source, "env": {name: plain value}, "discard": bool, "convert": name}``, the
    expression in the program's namespace with ``env`` added, its value passed through the
    runner's own built-in ``convert`` (optional, :data:`CONVERSIONS`: ``list`` of an iterator).
    passed = every call returned plain data; ``values`` holds them (None for discarded ones),
    decoded here from the one document the runner wrote.
    What they must equal is never sent into the sandbox: the caller compares."""
    for call in calls:
        if not {"expr", "env", "discard"} <= set(call) <= {"expr", "env", "discard", "convert"} \
                or type(call["expr"]) is not str or call.get("convert") not in CONVERSIONS:
            raise ValueError(f"bad call {call!r:.200}")
    return _run(program, timeout, calls)


def _run(program: str, timeout: float, calls: list[dict] | None) -> Result:
    """Run ``program`` in a fresh sandbox: start it, feed it, collect its pipes until the
    deadline, then read the verdict (:func:`_verdict`)."""
    header = b"" if calls is None else json.dumps(
        [{**c, "env": {k: encode(v) for k, v in c["env"].items()}} for c in calls]).encode()
    where = layout()
    command = unshare()
    nonce = secrets.token_hex(16)
    status_r, status_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    proc = _start(where, command, timeout, status_w, verdict_w, (status_r, verdict_r))
    deadline = time.monotonic() + timeout
    out = proc.stdout.fileno()
    got = {out: bytearray(), status_r: bytearray(), verdict_r: bytearray()}
    try:
        _feed(proc, nonce.encode() + b"\n" + header + b"\n"
              + program.encode("utf-8", "surrogatepass"))
        timed_out = _collect(got, out, verdict_r, deadline)
    finally:
        _kill(proc)
        proc.stdout.close()
        os.close(status_r)
        os.close(verdict_r)
    return _verdict(got[out].decode("utf-8", "replace")[-OUTPUT:],
                    got[status_r].decode("utf-8", "replace").splitlines(),
                    bytes(got[verdict_r]), proc.returncode, timed_out, calls, nonce)


def _start(where: dict, command: str, timeout: float, status_w: int, verdict_w: int,
           readers: tuple[int, int]) -> subprocess.Popen:
    """The sandboxed runner (new user, mount, pid, net, ipc, uts and cgroup namespaces, limits
    from :data:`MEMORY` etc.), given the write ends of the status and verdict pipes (closed here
    in this process); the read ``readers`` are closed too if it cannot start."""
    config = dict(where, status=status_w, verdict=verdict_w, runner=RUNNER,
                  cpu=int(timeout) + 1, wall=int(timeout) + 2, memory=MEMORY,
                  file_size=FILE_SIZE, open_files=OPEN_FILES, processes=PROCESSES,
                  writable=WRITABLE, legacy_remount=LEGACY_REMOUNT)
    try:
        return subprocess.Popen(
            [command, "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts",
             "--cgroup", "--fork", "--kill-child", "--",
             where["python"], "-I", "-S", "-c", INIT, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/",
            env={"PATH": SYSTEM_PATH}, pass_fds=(status_w, verdict_w), start_new_session=True,
            **_sandbox_user())
    except OSError as exc:
        for fd in readers:
            os.close(fd)
        raise SandboxUnavailable(f"code sandbox unavailable: {exc}") from exc
    finally:
        os.close(status_w)
        os.close(verdict_w)


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    """Write the runner's input and close its stdin (a runner that did not start: the status
    pipe says why)."""
    try:
        proc.stdin.write(data)
    except OSError:
        pass
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass


def _collect(got: dict[int, bytearray], out: int, verdict_r: int, deadline: float) -> bool:
    """Read every pipe of ``got`` until all close or the deadline passes (then True), keeping
    the output's tail and bounded heads of the status and verdict pipes."""
    with selectors.DefaultSelector() as sel:
        for fd in got:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = got[key.fd]
                buf += chunk
                if key.fd == out:
                    del buf[:-4 * OUTPUT]  # keep the tail only, whatever it prints
                else:
                    del buf[RESULTS + 1 if key.fd == verdict_r else 4096:]
    return False


def _verdict(output: str, status: list[str], verdict: bytes, returncode, timed_out: bool,
             calls: list[dict] | None, nonce: str) -> Result:
    """The run's :class:`Result` from what its pipes said; a sandbox that never became ready
    raises :class:`SandboxUnavailable` (unless the run timed out first)."""
    errors = [s[6:] for s in status if s.startswith("error ")]
    if errors or "ready" not in status:
        if timed_out and not errors:
            return Result(False, "timeout", output)
        if errors:
            raise SandboxUnavailable(f"code sandbox unavailable: {errors[0]}")
        why = (output.strip().splitlines() or [f"exit status {returncode}"])[-1]
        raise SandboxUnavailable(f"code sandbox unavailable: {why} (needs unprivileged user "
                                 "namespaces: sysctl kernel.unprivileged_userns_clone=1 and "
                                 "user.max_user_namespaces > 0)")
    exit_line = next((s for s in status if s.startswith("exit ")), "")
    if calls is None and verdict == f"{nonce} passed\n".encode():
        return Result(True, "passed", output)
    if calls is not None and verdict and not timed_out and exit_line == "exit 0":
        try:
            values = parse_values(verdict, nonce, len(calls))
        except (ValueError, TypeError, RecursionError) as exc:  # TypeError: an unhashable key
            why = f"ValueError: the sandbox's results are not well-formed ({exc})"[:300]
            return Result(False, "failed", (output + "\n" + why)[-OUTPUT:])
        return Result(True, "returned", output, values)
    if timed_out or exit_line == "exit timeout":
        return Result(False, "timeout", output)
    code = exit_line[5:]
    if code.isdigit() and int(code) > 128:
        return Result(False, "killed (cpu, memory or process limit)", output)
    return Result(False, "failed", output)
