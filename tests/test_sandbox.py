"""The code sandbox against hostile programs: each README claim about ``tasks/sandbox.py`` has a
case here. Escape programs assert that their escape worked (or fake a pass), so the verdict they
must get is "failed" (or "timeout"); property programs assert what the sandbox guarantees from the
inside and must pass. Host-side checks (files left behind, surviving processes) follow each run."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moe_spec.tasks import benchmarks, sandbox, scoring
from moe_spec.tasks.sandbox import SandboxUnavailable, run_python

README = Path(__file__).resolve().parent.parent / "README.md"
RIGHT = "def f(x):\n    return x + 1\n"
WRONG = "def f(x):\n    return x\n"
TESTS = "assert f(1) == 2\nassert f(41) == 42\n"


def marker() -> str:
    return f"moespec-sandbox-test-{uuid.uuid4().hex}"


def survivors(mark: str) -> list[str]:
    """Host processes whose command line contains ``mark`` (what ``pgrep -f`` finds, without
    needing procps)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue  # gone meanwhile
        if mark.encode() in cmdline and entry.name != str(os.getpid()):
            found.append(entry.name + " " + cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def sleeper(mark: str, setsid: bool = True) -> str:
    """Program text starting a child that sleeps forever with ``mark`` in its argv."""
    return (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(10**6)', {mark!r}], start_new_session={setsid}, "
            f"stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n")


# (name, program, verdict): escapes that must not score a pass
ESCAPES = [
    ("os._exit(0) before the tests", WRONG + "import os\nos._exit(0)\n" + TESTS, "failed"),
    ("sys.exit(0) before the tests", WRONG + "import sys\nsys.exit(0)\n" + TESTS, "failed"),
    ("raise SystemExit(0) before the tests", WRONG + "raise SystemExit(0)\n" + TESTS, "failed"),
    ("SystemExit(0) raised in an atexit hook",
     "import atexit\ndef hook():\n    raise SystemExit(0)\natexit.register(hook)\n" + WRONG + TESTS,
     "failed"),
    ("os._exit(0) in an atexit hook",
     "import atexit, os\natexit.register(lambda: os._exit(0))\n" + WRONG + TESTS, "failed"),
    ("a printed fake verdict",
     WRONG + "print('0' * 32 + ' passed')\nprint('passed')\n" + TESTS, "failed"),
    ("a fake verdict written to every file descriptor",
     WRONG + "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'0' * 32 + "
     "b' passed\\n')\n    except OSError:\n        pass\nos._exit(0)\n", "failed"),
    ("the nonce pipe read again", "import os\nassert os.read(3, 256)\n", "failed"),
    ("reading the project's README", f"open({str(README)!r}).read()\n", "failed"),
    ("reading /etc/passwd", "open('/etc/passwd').read()\n", "failed"),
    ("listing /work", "import os\nos.listdir('/work')\n", "failed"),
    ("listing /home", "import os\nos.listdir('/home')\n", "failed"),
    ("listing /root", "import os\nos.listdir('/root')\n", "failed"),
    ("listing /var", "import os\nos.listdir('/var')\n", "failed"),
    ("writing into /usr", "open('/usr/lib/moespec-sandbox-evil', 'w').write('x')\n", "failed"),
    ("writing into /", "open('/evil', 'w').write('x')\n", "failed"),
    ("remounting /usr read-write",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "assert libc.mount(None, b'/usr', None, 32 | 4096, None) == 0\n", "failed"),
    ("a nested user namespace (capabilities back)",
     "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0\n", "failed"),
    ("allowing nested user namespaces again",
     "open('/proc/sys/user/max_user_namespaces', 'w').write('10')\n", "failed"),
    ("tracing the sandbox's init",
     "import ctypes\nassert ctypes.CDLL(None).ptrace(16, 1, None, None) == 0\n", "failed"),
    ("reading the init's memory", "open('/proc/1/mem', 'rb')\n", "failed"),
    ("a network connection",
     "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n", "failed"),
    ("8 GiB of memory", "x = bytearray(8 << 30)\n", "failed"),
    ("a 20 MiB file", "open('big', 'wb').write(b'x' * (20 << 20))\n", "failed"),
    ("an infinite loop", "while True:\n    pass\n", "timeout"),
    ("a sleep past the limit", "import time\ntime.sleep(100)\n", "timeout"),
    ("a fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
     "        pass\n", "timeout"),
]


@pytest.mark.parametrize("name,program,verdict", ESCAPES, ids=[e[0] for e in ESCAPES])
def test_escapes_never_pass(name, program, verdict):
    start = time.monotonic()
    result = run_python(program, timeout=3)
    assert not result.passed and result.reason == verdict, (result, name)
    assert time.monotonic() - start < 10


def test_correct_and_wrong_programs():
    assert run_python(RIGHT + TESTS) == sandbox.Result(True, "passed", "")
    assert run_python(WRONG + TESTS).reason == "failed"
    right = run_python(RIGHT + "print('hello')\n" + TESTS)
    assert right.passed and right.stdout == "hello\n"  # output is flushed before the verdict
    wrong = run_python(WRONG + TESTS)
    assert "AssertionError" in wrong.stdout and 'File "program.py", line 3' in wrong.stdout


def test_signals_to_the_sandboxs_init_are_ignored():
    kill = "import os, signal\nfor s in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):\n" \
        "    os.kill(1, s)\n"
    assert run_python(kill + RIGHT + TESTS).passed


def test_atexit_hooks_never_run_and_cannot_change_a_pass():
    hook = "import atexit, os\natexit.register(lambda: os._exit(1))\n"
    assert run_python(hook + RIGHT + TESTS).passed


def test_output_is_bounded():
    result = run_python("while True:\n    print('x' * 100000)\n", timeout=2)
    assert result.reason == "timeout" and len(result.stdout) <= sandbox.OUTPUT


def test_the_sandbox_sees_only_its_own_root():
    where = sandbox.layout()
    top = {p.split("/")[1] for p in where["binds"]} | {p.split("/")[1] for p, _ in where["links"]}
    top |= {"dev", "proc", "sandbox", "tmp"}
    program = f"""
        import os
        assert sorted(os.listdir('/')) == {sorted(top)!r}, os.listdir('/')
        assert os.listdir('/etc') == ['ld.so.cache'] or {'/etc/ld.so.cache' not in where['binds']}
        assert sorted(os.listdir('/dev')) == ['fd', 'full', 'null', 'random', 'shm', 'stderr',
                                              'stdin', 'stdout', 'urandom', 'zero']
        assert os.getcwd() == '/sandbox' and os.listdir('.') == ['program.py']
        assert os.listdir('/tmp') == [] and os.listdir('/dev/shm') == []
    """
    result = run_python(textwrap.dedent(program))
    assert result.passed, result.stdout


def test_files_written_in_tmp_and_shm_are_gone_after_the_run():
    name = marker()
    program = f"""
        for folder in ('/tmp', '/dev/shm', '/sandbox'):
            with open(f'{{folder}}/{name}', 'w') as f:
                f.write('x' * 1000)
            assert open(f'{{folder}}/{name}').read() == 'x' * 1000
    """
    result = run_python(textwrap.dedent(program))
    assert result.passed, result.stdout
    for folder in ("/tmp", "/dev/shm", "/sandbox"):
        assert not os.path.exists(f"{folder}/{name}")


@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm", "/sandbox"])
def test_each_private_tmpfs_is_capped(folder):
    program = f"""
        import errno
        written = 0
        try:
            for i in range(64):
                with open('{folder}/f%d' % i, 'wb') as f:
                    f.write(b'x' * (4 << 20))
                written += 4 << 20
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        else:
            raise AssertionError('256 MiB written')
        assert written <= {sandbox.WRITABLE}, written
    """
    result = run_python(textwrap.dedent(program))
    assert result.passed, result.stdout


def test_proc_shows_only_the_sandbox():
    me, python = os.getpid(), sandbox.layout()["python"].encode()
    program = f"""
        import os
        pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        assert pids == [1, 2], pids  # its init and itself
        init = open('/proc/1/cmdline', 'rb').read().split(b'\\0')
        assert init[:4] == [{python!r}, b'-I', b'-S', b'-c'], init[:4]
        assert not os.path.exists('/proc/{me}')
    """
    result = run_python(textwrap.dedent(program))
    assert result.passed, result.stdout


def test_no_capabilities_and_no_new_privileges():
    program = """
        status = dict(line.split(':', 1) for line in open('/proc/self/status'))
        for key in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb'):
            assert int(status[key], 16) == 0, (key, status[key])
        assert status['NoNewPrivs'].strip() == '1'
    """
    assert run_python(textwrap.dedent(program)).passed


def test_the_documented_numbers():
    assert (sandbox.TIMEOUT, sandbox.MEMORY, sandbox.FILE_SIZE, sandbox.OPEN_FILES,
            sandbox.PROCESSES, sandbox.WRITABLE, sandbox.OUTPUT) == \
        (10, 1 << 30, 10 << 20, 64, 16, 16 << 20, 2000)


def test_every_namespace_is_new():
    kinds = ["user", "mnt", "pid", "net", "ipc", "uts", "cgroup"]
    host = [os.readlink(f"/proc/self/ns/{k}") for k in kinds]
    result = run_python(f"import json, os\nprint(json.dumps([os.readlink('/proc/self/ns/' + k) "
                        f"for k in {kinds!r}]))\n")
    assert result.passed
    inside = json.loads(result.stdout)
    assert len(inside) == len(kinds) and all(a != b for a, b in zip(host, inside)), (host, inside)


def test_the_sandbox_is_nobody_outside_when_the_harness_is_root():
    outside = 65534 if os.geteuid() == 0 else os.geteuid()
    program = f"assert open('/proc/self/uid_map').read().split() == ['0', '{outside}', '1']\n"
    assert run_python(program).passed


def test_limits_are_set():
    program = f"""
        import resource as r
        want = {{r.RLIMIT_CPU: 4, r.RLIMIT_AS: {sandbox.MEMORY}, r.RLIMIT_FSIZE: {sandbox.FILE_SIZE},
                r.RLIMIT_NOFILE: {sandbox.OPEN_FILES}, r.RLIMIT_NPROC: {sandbox.PROCESSES},
                r.RLIMIT_CORE: 0}}
        for what, value in want.items():
            assert r.getrlimit(what) == (value, value), (what, r.getrlimit(what))
    """
    result = run_python(textwrap.dedent(program), timeout=3)
    assert result.passed, result.stdout


def test_no_network_interfaces():
    program = "import socket\nassert [n for _, n in socket.if_nameindex()] == ['lo']\n"
    assert run_python(program).passed  # only the loopback, and it is down:
    assert not run_python("import socket\nsocket.create_connection(('127.0.0.1', 22), 1)\n").passed


def test_a_setsid_child_is_gone_after_the_run():
    mark = marker()
    result = run_python(sleeper(mark) + RIGHT + TESTS)
    assert result.passed, result.stdout
    assert survivors(mark) == []


def test_a_setsid_child_is_gone_after_the_time_limit():
    mark = marker()
    result = run_python(sleeper(mark) + "while True:\n    pass\n", timeout=2)
    assert result.reason == "timeout"
    assert survivors(mark) == []


def test_twenty_setsid_children_do_not_break_a_later_program():
    mark = marker()
    program = ("import subprocess, sys\nstarted = 0\nfor i in range(20):\n    try:\n"
               + textwrap.indent(sleeper(mark), "        ") + "        started += 1\n"
               "    except OSError:\n        pass\nprint(started)\n")
    first = run_python(program)
    assert first.passed and 0 < int(first.stdout) < 20, first.stdout  # the process limit held
    assert survivors(mark) == []
    later = marker()
    ten = "for i in range(10):\n" + textwrap.indent(sleeper(later, setsid=False), "    ")
    result = run_python(ten + RIGHT + TESTS)  # the next program has its whole process budget
    assert result.passed, result.stdout
    assert survivors(later) == []


@pytest.mark.slow  # kills a harness process
def test_the_sandbox_dies_at_its_limit_even_if_the_harness_is_killed(tmp_path):
    mark = marker()
    script = tmp_path / "harness.py"
    script.write_text(f"from moe_spec.tasks.sandbox import run_python\n"
                      f"run_python({sleeper(mark) + 'import time; time.sleep(100)'!r}, timeout=2)\n")
    harness = subprocess.Popen([sys.executable, str(script)], cwd=README.parent,
                               env={**os.environ, "PYTHONPATH": str(README.parent)})
    deadline = time.monotonic() + 20
    while not survivors(mark):
        assert time.monotonic() < deadline and harness.poll() is None
        time.sleep(0.1)
    harness.kill()
    harness.wait()
    time.sleep(5)  # wall limit 2 s + 2 s grace in the sandbox's init
    assert survivors(mark) == []


def test_read_only_mounts_without_mount_setattr(monkeypatch):
    """Kernels before 5.12: every bind is remounted read-only one by one."""
    monkeypatch.setattr(sandbox, "LEGACY_REMOUNT", True)
    program = ("import errno\ntry:\n    open('/usr/lib/evil', 'w')\nexcept OSError as exc:\n"
               "    assert exc.errno == errno.EROFS, exc\nelse:\n    raise AssertionError\n")
    assert run_python(program).passed
    assert not run_python(RIGHT + "import os\nos._exit(0)\n" + TESTS).passed


def test_known_limits_kernel_wide_proc_files_memory_per_process_no_seccomp():
    """Documented as not guaranteed: system-wide /proc files are readable, the address-space
    cap is per process (two processes hold more than 1 GiB together), no seccomp filter."""
    program = textwrap.dedent("""
        import os
        assert open('/proc/cpuinfo').read() and open('/proc/sys/kernel/ostype').read()
        assert '/usr' in open('/proc/self/mountinfo').read()
        ready, release = os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:
            block = bytearray(700 << 20)
            os.write(ready[1], b'x')
            os.read(release[0], 1)  # hold it while the parent holds its own
            os._exit(0)
        assert os.read(ready[0], 1) == b'x'
        block = bytearray(700 << 20)
        os.write(release[1], b'x')
        assert os.waitpid(pid, 0)[1] == 0
        status = dict(line.split(':', 1) for line in open('/proc/self/status'))
        assert status['Seccomp'].strip() == '0'
    """)
    result = run_python(program)
    assert result.passed, result.stdout


def test_known_limit_run_pythons_bare_verdict_can_be_faked_but_scoring_cannot():
    """Documented as not guaranteed: run_python's "ran to the end" verdict is written inside the
    sandbox, so a program that reads the runner's frame fakes it. Scoring never uses it: MBPP
    gets only the calls' values back and decides here (tests/test_forged_verdicts.py)."""
    cheat = ("import os, sys\nnonce = sys._getframe(1).f_locals['nonce']\n"
             "os.write(4, nonce + b' passed\\n')\nos._exit(0)\n")
    assert run_python(WRONG + cheat + TESTS).passed
    p = benchmarks.load("mbpp", limit=1)[0]
    assert scoring.mbpp(p, cheat).value == 0.0


# ---- refusing to run without a sandbox --------------------------------------------------------

def test_no_unshare_refuses_to_run(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "SYSTEM_PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="install util-linux"):
        run_python(RIGHT + TESTS)


def test_no_user_namespaces_refuses_to_run(monkeypatch):
    with tempfile.TemporaryDirectory() as folder:  # one the sandbox user can reach
        os.chmod(folder, 0o755)
        fake = Path(folder) / "unshare"
        fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\n"
                        "exit 1\n")
        fake.chmod(0o755)
        monkeypatch.setattr(sandbox, "unshare", lambda: str(fake))
        with pytest.raises(SandboxUnavailable, match="Operation not permitted.*user namespaces"):
            run_python(RIGHT + TESTS)


def test_no_python_for_the_sandbox_user_refuses_to_run(monkeypatch):
    monkeypatch.setattr(sandbox, "_python", lambda: None)
    sandbox.layout.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="install python3"):
            run_python(RIGHT + TESTS)
    finally:
        monkeypatch.undo()
        sandbox.layout.cache_clear()


# ---- end to end: scorers and the evaluate command ---------------------------------------------

def test_scorers_give_zero_to_an_early_exit():
    p = benchmarks.load("mbpp", limit=1)[0]
    assert scoring.mbpp(p, p.reference).value == 1.0
    assert scoring.mbpp(p, "import os\nos._exit(0)\n").value == 0.0
    assert scoring.mbpp(p, "import sys\nsys.exit(0)\n").value == 0.0
    h = benchmarks.load("humaneval", limit=1)[0]
    assert scoring.humaneval(h, h.reference).value == 1.0
    assert scoring.humaneval(h, "    import os\n    os._exit(0)\n").value == 0.0
    assert scoring.humaneval(h, "    pass\nimport os\nos._exit(0)\n").value == 0.0


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """A captured MBPP run of two prompts whose outputs are replaced: the reference solution for
    the first, ``os._exit(0)`` for the second."""
    from transformers import AutoTokenizer

    from moe_spec.capture import cli as capture_cli
    traces = tmp_path_factory.mktemp("sandbox") / "traces"
    assert capture_cli.main(["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "2",
                             "--max-new-tokens", "4", "--no-progress", "--out", str(traces),
                             "--run", "hostile"]) == 0
    manifest = json.loads(next(traces.glob("runs/**/_manifest.json")).read_text())
    tokenizer = AutoTokenizer.from_pretrained(manifest["model_location"])
    prompts = {p.prompt_id: p for p in benchmarks.load("mbpp", limit=2)}
    first = benchmarks.load("mbpp", limit=1)[0].prompt_id
    for part in traces.glob("sequences/**/*.parquet"):
        table = pq.read_table(part)
        rows = table.to_pylist()
        for row in rows:
            text = prompts[row["prompt_id"]].reference if row["prompt_id"] == first else \
                "import os\nos._exit(0)\n"
            row["output_token_ids"] = tokenizer.encode(text, add_special_tokens=False)
        pq.write_table(type(table).from_pylist(rows, schema=table.schema), part)
    from conftest import recommit
    recommit(traces)  # the edited outputs are the run's, as if captured so
    return traces


@pytest.mark.slow  # captures
def test_evaluate_scores_an_early_exit_zero(hostile_run, tmp_path):
    from moe_spec.analysis import evaluate_cli
    out = tmp_path / "q.json"
    assert evaluate_cli.main(["--traces", str(hostile_run), "--output", str(out)]) == 0
    summary = json.loads(out.read_text())["hostile"]
    assert summary["metric"] == "pass@1" and summary["mean"] == 0.5  # 1 (reference) and 0
    rows = pq.read_table(next(hostile_run.glob("quality/**/*.parquet"))).to_pylist()
    scores = sorted((r["score"], r["answer"].split(":")[0]) for r in rows)
    assert scores == [(0.0, "failed"), (1.0, "passed")], rows


@pytest.mark.slow  # captures
def test_evaluate_without_a_sandbox_is_one_line(hostile_run, monkeypatch, capsys):
    from moe_spec.analysis import evaluate_cli
    monkeypatch.setattr(sandbox, "SYSTEM_PATH", "/nonexistent")
    assert evaluate_cli.main(["--traces", str(hostile_run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "code sandbox unavailable" in err[0] and "util-linux" in err[0], err



# ---- completions that redefine what the test computes with (issue 60) -------------------------
# The program's sandbox evaluates only the task's calls; everything else of an assert is
# evaluated by the scorer, so a completion's own ``abs`` (or ``sorted``, ``math.isclose``, a
# prompt helper) never takes part. Each case: (assert in check(candidate), reference body, a
# completion that returns a wrong value and redefines what the assert uses).
REDEFINED = {
    "abs": ("assert abs(candidate(1.5) - 3.0) < 1e-6", "return x * 2",
            "return -1.0\ndef abs(x):\n    return 0\n"),
    "builtins.abs": ("assert abs(candidate(1.5) - 3.0) < 1e-6", "return x * 2",
                     "return -1.0\nimport builtins\nbuiltins.abs = lambda x: 0\n"),
    "sorted": ("assert sorted(candidate([3, 1])) == [1, 3]", "return list(x)",
               "return [9]\ndef sorted(x):\n    return [1, 3]\n"),
    "set": ("assert set(candidate([1, 2])) == {1, 2}", "return list(x)",
            "return [9]\ndef set(x):\n    return {1, 2}\n"),
    "len": ("assert len(candidate([1, 2])) == 2", "return list(x)",
            "return []\ndef len(x):\n    return 2\n"),
    "round": ("assert round(candidate(0.333), 2) == 0.67", "return x * 2",
              "return 5.0\ndef round(x, n):\n    return 0.67\n"),
    "isinstance": ("assert isinstance(candidate(1), str)", "return str(x)",
                   "return 1\ndef isinstance(a, b):\n    return True\n"),
    "float": ("assert candidate(1.5) == float('3.0')", "return x * 2",
              "return 'x'\nclass float:\n    def __new__(cls, s):\n        return 'x'\n"),
    "str": ("assert candidate(1) == str(1)", "return str(x)",
            "return 'no'\ndef str(x):\n    return 'no'\n"),
    "max": ("assert max(candidate([1, 5]), 0) == 5", "return max(x)",
            "return -3\ndef max(*a):\n    return 5\n"),
    "math.isclose": ("import math\n    assert math.isclose(candidate(1.5), 3.0)", "return x * 2",
                     "return 0.0\nimport math\nmath.isclose = lambda *a, **k: True\n"),
    "float.__eq__": ("assert candidate(1.5) == 3.0", "return x * 2",
                     "return type('F', (float,), {'__eq__': lambda s, o: True})(0.0)\n"),
    "list.__eq__": ("assert candidate([1]) == [2]", "return [v * 2 for v in x]",
                    "return type('L', (list,), {'__eq__': lambda s, o: True})()\n"),
    "the prompt's helper": ("assert helper(candidate(1.5)) == 6.0", "return x * 2",
                            "return 0.0\ndef helper(y):\n    return 6.0\n"),
}


@pytest.mark.parametrize("name", list(REDEFINED))
def test_a_completion_cannot_redefine_what_the_test_computes_with(name):
    test, reference, cheat = REDEFINED[name]
    check = f"def check(candidate):\n    {test}\n"
    p = benchmarks.Prompt("humaneval", "t", "def helper(y):\n    return y * 2\n\n\ndef f(x):\n",
                          f"    {reference}\n", tests=(check,), entry_point="f")
    assert scoring.humaneval(p, p.reference).value == 1.0
    score = scoring.humaneval(p, "    " + cheat)
    assert score.value == 0.0, score


def test_humaneval_4_with_its_own_abs_scores_zero():
    """The reported exploit: ``return -1.0`` then ``def abs(x): return 0`` scored 1.0."""
    tasks = {p.prompt_id: p for p in benchmarks.load("humaneval")}
    h = tasks["HumanEval/4"]
    score = scoring.humaneval(h, "    return -1.0\ndef abs(x):\n    return 0\n")
    assert score.value == 0.0 and "got -1.0" in score.detail, score
    poly = tasks["HumanEval/32"]  # the prompt's poly is the test's, not the completion's
    assert scoring.humaneval(poly, "    return 0.0\ndef poly(xs, x):\n    return 0\n").value == 0.0
    assert scoring.humaneval(poly, poly.reference).value == 1.0


def test_mbpp_with_its_own_builtins_scores_zero():
    p = benchmarks.Prompt("mbpp", "t", "", "def f(x):\n    return sorted(x)\n",
                          tests=("assert sorted(f([2, 1])) == [1, 2]",
                                 "assert abs(len(f([2, 1])) - 2) < 1"))
    assert scoring.mbpp(p, p.reference).value == 1.0
    cheat = "def f(x):\n    return []\ndef sorted(x):\n    return [1, 2]\ndef abs(x):\n    return 0\n"
    assert scoring.mbpp(p, cheat).value == 0.0


@pytest.mark.parametrize("test", [
    "assert (lambda v: v)(candidate(1)) == 2",  # a lambda around the program's value
    "assert [v for v in candidate([1])] == [2]",  # a comprehension over it
    "assert candidate(1).real == 2",  # an attribute of it
    "assert unknown(candidate(1)) == 2",  # a function neither the task's nor a built-in
])
def test_an_assert_that_cannot_be_reduced_scores_zero_and_says_so(test):
    p = benchmarks.Prompt("humaneval", "t", "def f(x):\n", "    return x * 2\n",
                          tests=(f"def check(candidate):\n    {test}\n",), entry_point="f")
    score = scoring.humaneval(p, p.reference)
    assert score.value == 0.0 and "test not supported here" in score.detail, score


def test_chained_calls_are_passed_as_plain_values_and_bounded():
    """A call that needs another's value plus arithmetic waits a round (the arithmetic runs in
    the scorer); a chain deeper than the bound is refused, not run for minutes."""
    p = benchmarks.Prompt("humaneval", "t", "def f(x):\n", "    return x + 1\n",
                          tests=("def check(candidate):\n"
                                 "    assert candidate(candidate(1) * 10) == 21\n",),
                          entry_point="f")
    assert scoring.humaneval(p, p.reference).value == 1.0
    assert scoring.humaneval(p, "    return x + 2\n").value == 0.0
    deep = "def check(candidate):\n    x = 0\n" + "    x = candidate(x) + 0\n" * 20 + \
        "    assert x == 20\n"
    score = scoring.humaneval(benchmarks.Prompt("humaneval", "t", "def f(x):\n",
                                                "    return x + 1\n", tests=(deep,),
                                                entry_point="f"), "    return x + 1\n")
    assert score.value == 0.0 and "more than 16 deep" in score.detail, score
