"""Verdicts that code in the sandbox cannot produce (issue 41, item 3).

MBPP and HumanEval are scored by :func:`tasks.sandbox.run_calls`: the sandbox returns only the
values of the calls of the program (plain built-in data, strictly encoded), and this process
evaluates each assert with them. Each forgery below scored pass@1 = 1.0 when the sandbox's runner
wrote the verdict; each must now score 0, end to end through ``tasks.scoring``."""

import json
import re
import textwrap

import pytest

from moe_spec.tasks import benchmarks, sandbox, scoring
from moe_spec.tasks.benchmarks import Prompt

# a function whose value is equal to everything: ``assert f(x) == y`` held in the sandbox
EQ_ANYTHING = textwrap.dedent("""
    class Anything:
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
        __hash__ = object.__hash__
    def {name}(*args, **kwargs):
        return Anything()
""")
# a subclass of a plain type with the same trick (isinstance would let it through)
EQ_SUBCLASS = textwrap.dedent("""
    class Sly(str):
        def __eq__(self, other):
            return True
        __hash__ = str.__hash__
    def {name}(*args, **kwargs):
        return Sly('x')
""")
# walking up to the runner's frame for the nonce, then the verdict on its file descriptor
FRAME_WALK = textwrap.dedent("""
    import os, sys
    frame = sys._getframe()
    while frame is not None and 'nonce' not in frame.f_locals:
        frame = frame.f_back
    os.write(4, frame.f_locals['nonce'] + b' passed\\n')
    os._exit(0)
""")
# scanning the interpreter's own memory for the nonce (a NUL-terminated bytes object)
PROC_MEM = textwrap.dedent("""
    import os, re
    found = set()
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            fields = line.split()
            if 'r' not in fields[1] or line.rstrip().endswith(('[vvar]', '[vsyscall]',
                                                              '[vvar_vclock]')):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split('-'))
            try:
                mem.seek(lo)
                chunk = mem.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue
            found.update(re.findall(rb'(?<![0-9a-f])([0-9a-f]{32})\\x00', chunk))
    assert len(found) == 1, len(found)
    os.write(4, found.pop() + b' passed\\n')
    os._exit(0)
""")


@pytest.fixture(scope="module")
def mbpp_prompt():
    return benchmarks.load("mbpp", limit=1)[0]


@pytest.fixture(scope="module")
def humaneval_prompt():
    return benchmarks.load("humaneval", limit=1)[0]


def _name(p: Prompt) -> str:
    return p.reference.split("def ", 1)[1].split("(", 1)[0]


@pytest.mark.parametrize("forgery", ["eq-anything", "eq-subclass", "frame-walk", "proc-mem"])
def test_forgeries_score_zero_through_mbpp(mbpp_prompt, forgery):
    p = mbpp_prompt
    code = {"eq-anything": EQ_ANYTHING.format(name=_name(p)),
            "eq-subclass": EQ_SUBCLASS.format(name=_name(p)),
            "frame-walk": FRAME_WALK, "proc-mem": PROC_MEM}[forgery]
    assert scoring.mbpp(p, p.reference).value == 1.0
    score = scoring.mbpp(p, code)
    assert score.value == 0.0 and score.answer == "failed", score
    if forgery.startswith("eq"):
        assert "not plain data" in score.detail, score.detail


@pytest.mark.parametrize("forgery", ["eq-anything", "frame-walk", "proc-mem"])
def test_forgeries_score_zero_through_humanevals_check(humaneval_prompt, forgery):
    h = humaneval_prompt
    code = "    pass\n" + {"eq-anything": EQ_ANYTHING.format(name=h.entry_point),
                           "frame-walk": FRAME_WALK, "proc-mem": PROC_MEM}[forgery]
    assert scoring.humaneval(h, h.reference).value == 1.0
    score = scoring.humaneval(h, code)
    assert score.value == 0.0 and score.answer == "failed", score


def test_the_same_tricks_still_fake_run_pythons_bare_verdict():
    """Documented: run_python's "ran to the end" verdict is written inside the sandbox and can be
    faked (scoring does not use it)."""
    wrong = "def f(x):\n    return x\n"
    for trick in (FRAME_WALK, PROC_MEM):
        assert sandbox.run_python(wrong + trick + "assert f(1) == 2\n").passed


def test_a_forged_results_document_is_not_well_formed():
    """A document written on the results descriptor besides the runner's is refused."""
    program = FRAME_WALK.replace("b' passed\\n')\n    os._exit(0)", "b' [1]\\n')")
    program = "def f(x):\n    return x\n" + program
    result = sandbox.run_calls(program, [dict(expr="f(1)", env={}, discard=False)])
    assert not result.passed and "not well-formed" in result.stdout, result


def test_printing_a_results_document_changes_nothing():
    program = "def f(x):\n    return x\nprint('0' * 32 + ' [2]')\n"
    result = sandbox.run_calls(program, [dict(expr="f(y)", env={"y": 1}, discard=False)])
    assert result.passed and result.values == [1], result


def test_values_cross_as_plain_data():
    program = "import collections\ndef f(x):\n    return x\n"
    values = [None, True, 3, -2.5, float("inf"), 1j, "s\udc80", b"\x00", [1, (2, 3)],
              {1: {"a"}}, frozenset({4})]
    calls = [dict(expr="f(v)", env={"v": v}, discard=False) for v in values]
    calls.append(dict(expr="collections.Counter('aab')", env={}, discard=False))
    calls.append(dict(expr="print('x')", env={}, discard=True))
    result = sandbox.run_calls(program, calls)
    assert result.passed and result.values == [*values, {"a": 2, "b": 1}, None], result
    assert type(result.values[-2]) is dict and type(result.values[8][1]) is tuple
    nan = sandbox.run_calls(program, [dict(expr="float('nan')", env={}, discard=False)])
    assert nan.passed and nan.values[0] != nan.values[0]


@pytest.mark.parametrize("returned", ["type('I', (int,), {})(1)", "iter([1])", "lambda: 1",
                                      "[object()]", "{1: type('S', (str,), {})('a')}"])
def test_anything_but_plain_data_fails(returned):
    result = sandbox.run_calls("", [dict(expr=returned, env={}, discard=False)])
    assert not result.passed and "not plain data" in result.stdout, result


@pytest.mark.parametrize("document", [
    b"N [1]", b"N [1]\n\n", b"M [1]\n", b"N [1]\nN [1]\n", b"N [NaN]\n", b"N [1, 2]\n",
    b"N {\"a\": 1}\n", b"N [{\"tuple\": [1], \"set\": [1]}]\n", b"N [{\"object\": []}]\n",
    b"N [{\"float\": \"1e999999999999999999999999999999999999999999999999999999999999999\"}]\n",
    b"N [{\"set\": [[1]]}]\n", b"N passed\n",
])
def test_only_one_well_formed_document_is_accepted(document):
    with pytest.raises((ValueError, TypeError)):
        sandbox.parse_values(document, "N", 1)
    assert sandbox.parse_values(b"N [{\"tuple\": [1, {\"float\": \"2.5\"}]}]\n", "N", 1) == \
        [(1, 2.5)]


def test_encode_is_strict():
    for bad in (type("I", (int,), {})(1), type("D", (dict,), {})(), object(), range(3)):
        with pytest.raises(TypeError):
            sandbox.encode(bad)
    value = {"k": [1, 2.0, (None, {3})]}
    assert sandbox.decode(json.loads(json.dumps(sandbox.encode(value)))) == value


# ---- splitting tests: what runs where -----------------------------------------------------------

def _checker(tests: str, **aliases):
    import ast
    checker = scoring._Checker({"f", "g"} | set(aliases.values()), aliases)
    checker.run(ast.parse(tests).body, {})
    return checker


def _exprs(checker) -> list[str]:
    """What the program's sandbox is asked to evaluate: each call (with its conversion)."""
    import ast
    return [f"{c['convert']}({ast.unparse(c['node'])})" if c["convert"] else ast.unparse(c["node"])
            for c in checker.calls]


def _named(values: list) -> dict:
    return {f"_call{i}": v for i, v in enumerate(values)}


def test_the_expected_side_never_enters_the_sandbox():
    checker = _checker("assert f(1) == 2\nassert abs(f(1.33) - 0.33) < 1e-6\n"
                       "assert tuple(f([1])) == tuple([7])\nassert not f('<')\n"
                       "assert f(2) is True\nassert f(3) == (3 + 5, 3 * 5)\n")
    exprs = _exprs(checker)
    assert exprs == ["f(1)", "f(1.33)", "tuple(f(_v0))", "f('<')", "f(2)", "f(3)"], exprs
    assert {c["world"] for c in checker.calls} == {"program"}
    assert checker.verdict(_named([2, 0.3300000001, (7,), False, True, (8, 15)])) is None
    assert "test 2" in checker.verdict(_named([2, 0.0, (7,), False, True, (8, 15)]))
    assert "test 5" in checker.verdict(_named([2, 0.33, (7,), False, 1, (8, 15)]))  # 1 not True


def test_loops_random_and_test_variables_run_here():
    tests = textwrap.dedent("""
        import random
        from random import choice
        for i in range(3):
            x = random.randint(0, 9)
            s = ''.join(choice('ab') for _ in range(4))
            y = g(s)
            assert f(x, y) == x + 1
    """)
    checker = _checker(tests)
    calls = [(e, c) for e, c in zip(_exprs(checker), checker.calls) if e.startswith("f")]
    assert len(calls) == 3
    for e, c in calls:  # x and s computed here, g(s) and f(...) there
        assert re.fullmatch(r"f\(_v\d+, g\(_v\d+\)\)", e), e
        assert sorted(type(v).__name__ for v in c["env"].values()) == ["int", "str"], c
    xs = [next(v for v in c["env"].values() if type(v) is int) for _, c in calls]
    f_at = [i for i, e in enumerate(_exprs(checker)) if e.startswith("f")]
    right = {f"_call{i}": x + 1 for i, x in zip(f_at, xs)}
    assert checker.verdict(right) is None
    assert checker.verdict({k: v - 1 for k, v in right.items()}) is not None
    again = _checker(tests)  # the tests' random numbers are reproducible
    assert [c["env"] for c in again.calls] == [c["env"] for c in checker.calls]


@pytest.mark.parametrize("test", [
    "assert all(f(x) for x in range(3))", "import os\nassert f(1) == 1",
    "def g():\n    pass\nassert f(1) == 1", "while True:\n    assert f(1)",
    "assert f(*[1]) == 1",
])
def test_a_test_that_cannot_be_split_fails_and_says_so(test):
    p = Prompt("mbpp", "x", "", "def f(x):\n    return x\n", tests=(test,))
    score = scoring.mbpp(p, p.reference)
    assert score.value == 0.0 and "test not supported here" in score.detail, score


def test_scored_benchmark_forms(humaneval_prompt):
    """Forms of HumanEval's check functions: a tolerance, ``is True``, bare truth, a loop over
    the tests' own random data, a helper of the prompt."""
    check = textwrap.dedent("""
        def check(candidate):
            import random
            assert abs(candidate(1.5) - 0.5) < 1e-6
            assert candidate(2.25) is not None
            assert not candidate(3.0)
            for _ in range(5):
                x = random.randint(1, 100) + 0.5
                assert candidate(helper(x)) == 0.5
    """)
    p = Prompt("humaneval", "t", "def helper(x):\n    return x\n\ndef frac(x):\n",
               "    return x % 1\n", tests=(check,), entry_point="frac")
    assert scoring.humaneval(p, p.reference).value == 1.0
    assert scoring.humaneval(p, "    return 0.5 if x % 1 else 0.0\n").value == 1.0
    assert scoring.humaneval(p, "    return 0.5\n").value == 0.0
    score = scoring.humaneval(p, "    class F(float):\n        pass\n    return F(x % 1)\n")
    assert score.value == 0.0 and "not plain data" in score.detail
