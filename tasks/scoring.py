"""Task quality: one scorer per benchmark, on a model's completion of one prompt.

* ``gsm8k`` (``accuracy``): the first number after the last ``####`` (else the last number in
  the text) equals the reference's by value (``Decimal``), not by spelling: ``007`` = ``7``,
  ``3.0`` = ``3``, ``.5`` = ``0.5``. A number is digits with optional ``,`` thousands groups
  (``1,000``; ``1,2,3`` is three numbers), an optional decimal part (``42.`` is 42) and an optional
  ``$`` before or ``%`` after (dropped: ``50%`` is 50). A ``-`` or U+2212 ``−`` right before it
  is its minus sign unless it joins two things: directly after a letter or digit (``COVID-19``,
  ``5-10``) or with only spaces after a digit, ``%`` or closing bracket (``5 - 10``), it is a
  range dash or a subtraction and the number is positive; en and em dashes are never signs;
* ``math500`` (``accuracy``): ``math-verify`` finds the completion's last LaTeX/numeric answer
  mathematically equal to the reference answer (symbolic: ``\\frac{1}{2}`` = ``0.5``), after
  U+2212 ``−`` is read as ``-`` (math-verify finds no answer in plain text like ``is −5.``);
* ``mbpp`` (``pass@1``): the completion's code, the task's setup and its asserts run in
  :mod:`tasks.sandbox`;
* ``humaneval`` (``pass@1``): prompt + completion + the task's ``check(entry_point)`` run in the
  sandbox;
* ``cnndm`` (``rougeL``): ROUGE-L F1 (``rouge-score``, stemmed) against the reference highlights;
* ``specbench`` (per category): summarization as ROUGE-L, math_reasoning as GSM8K, the others
  output length only.

Every scorer returns a :class:`Score`; bad outputs (empty, not code, an endless loop, a fork bomb)
score 0 and never hang or harm the machine.
"""

from __future__ import annotations

import ast
import copy
import importlib
import operator
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable

from moe_spec.tasks import sandbox
from moe_spec.tasks.benchmarks import Prompt

STOPS = ("\nQuestion:", "\nProblem:", "\nArticle:", "\nYou are an expert Python programmer")


@dataclass
class Score:
    metric: str
    value: float | None  # None: nothing to score against (output statistics only)
    answer: str = ""  # what was extracted or why it failed
    detail: str = ""


def truncate(completion: str) -> str:
    """The completion up to where the model starts a new prompt of the same template."""
    cut = len(completion)
    for stop in STOPS:
        i = completion.find(stop)
        if i >= 0:
            cut = min(cut, i)
    return completion[:cut]


# A minus sign is hyphen-minus or U+2212 (before or after a ``$``); en/em dashes never are.
_NUMBER = re.compile(r"""
    (?P<sign>[-\u2212])?\$?(?P<sign2>[-\u2212])?        # -5, -$5, $-5, −5
    (?P<body>\d{1,3}(?:,\d{3})+(?!\d|,\d)(?:\.\d+)?  # 1,000 and 1,234.50 (groups of three)
            |\d+(?:\.\d+)?                             # 42, 3.0 (not the period of "42.")
            |\.\d+)                                     # .5
    %?""", re.X)
_ENDS_OPERAND = ")]}%"


def _is_sign(text: str, at: int) -> bool:
    """Whether the ``-`` (or ``$-``) at ``text[at]`` is a minus sign, not a dash or a subtraction."""
    if at > 0 and text[at - 1].isalnum():
        return False  # 5-10, COVID-19, x-5
    before = text[:at].rstrip()
    return not before or not (before[-1].isdigit() or before[-1] in _ENDS_OPERAND)


def _numbers(text: str) -> list[Decimal]:
    """Every number in the text, in order, as a value (see the module docstring for the rule)."""
    found = []
    for m in _NUMBER.finditer(text):
        value = Decimal(m["body"].replace(",", ""))
        if (m["sign"] or m["sign2"]) and _is_sign(text, m.start()):
            value = -value
        found.append(value)
    return found


def _spell(value: Decimal) -> str:
    """One spelling per value: ``7``, ``-5``, ``0.5``, ``1000`` (never ``1E+3`` or ``-0``)."""
    return "0" if value == 0 else format(value.normalize(), "f")


def normalise_number(text: str) -> str:
    """The first number in the text, one spelling per value: ``$1,000.50`` → ``1000.5``,
    ``7.0`` → ``7``, ``007`` → ``7``, ``.5`` → ``0.5``, ``−5`` → ``-5``; the stripped text itself
    (``0`` if empty) when there is no number."""
    found = _numbers(text)
    return _spell(found[0]) if found else (text.strip() or "0")


def final_number(text: str) -> str | None:
    """The first number after the last ``####``, else the last number in the text, spelled as by
    :func:`normalise_number`; None if there is no number."""
    if "####" in text:
        found = _numbers(text.rsplit("####", 1)[1])
        if found:
            return _spell(found[0])
    found = _numbers(text)
    return _spell(found[-1]) if found else None


def same_number(a: str | None, b: str | None) -> bool:
    """Whether two extracted numbers are equal by value (``3.0`` = ``3``), not by spelling."""
    if a is None or b is None:
        return False
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def gsm8k(prompt: Prompt, completion: str) -> Score:
    got, want = final_number(truncate(completion)), final_number(prompt.reference)
    return Score("accuracy", float(same_number(got, want)), got or "(no number)",
                 f"reference {want}")


def math500(prompt: Prompt, completion: str) -> Score:
    from math_verify import parse, verify
    text = truncate(completion).replace("\u2212", "-")
    try:
        gold = parse(f"${prompt.reference.replace(chr(0x2212), '-')}$")
        answer = parse(text)
        ok = bool(gold) and bool(answer) and verify(gold, answer)
    except Exception as exc:  # noqa: BLE001 - an unparsable answer is a wrong answer
        return Score("accuracy", 0.0, "(unparsable)", type(exc).__name__)
    shown = str(answer[-1]) if answer else "(no answer)"
    return Score("accuracy", float(ok), shown[:200], f"reference {prompt.reference}")


# ---- MBPP and HumanEval: the sandbox computes values, this process decides ------------------
# The benchmark's tests are parsed here (``ast``), never run in the sandbox and never run here as
# code. This process executes the test's own statements with a small evaluator of plain values
# (assignments, ``for`` and ``if`` over test data, ``import`` of math, random, string and copy,
# whitelisted built-ins and methods); each call of the task's functions (the names its reference
# or prompt binds, never the completion's) becomes a *call* that the sandbox evaluates and returns
# as plain data (:func:`tasks.sandbox.run_calls`), after the test values it uses were computed
# here. Each assert is then evaluated here with those values: the comparison, ``abs``,
# ``sorted`` and the expected side never enter the sandbox. A test this cannot reduce to such
# calls is a failure that says so.

class Unsplittable(ValueError):
    """A test statement or expression this process cannot check without running it as code."""


_RNG_SEED = 0  # the tests' ``random``: a private, seeded generator (scores are reproducible)
_MAX_CALLS = 10_000
_MAX_ROUNDS = 16  # sandbox runs a test may need (a call waiting on another's value: one more)
_MAX_SIZE = 10_000_000  # elements or characters a ``*`` here may build
_BUILTINS = {f.__name__: f for f in (
    abs, all, any, bool, chr, dict, divmod, enumerate, float, frozenset, int, isinstance, len,
    list, max, min, ord, range, repr, reversed, round, set, sorted, str, sum, tuple, type, zip)}
# one of these around a program call (its only argument) goes with it: ``list(f(x))`` is one call
_CONVERSIONS = {"list", "tuple", "set", "frozenset", "sorted", "dict", "str", "int", "float",
                "bool", "len"}
_MODULES = {
    "math": {"fabs", "isclose", "sqrt", "floor", "ceil", "pi", "e", "inf", "nan", "isnan",
             "isinf", "gcd", "factorial", "comb", "log", "exp", "prod"},
    "random": {"randint", "choice", "random", "uniform", "sample", "shuffle", "randrange",
               "Random"},
    "string": {"ascii_lowercase", "ascii_uppercase", "ascii_letters", "digits", "hexdigits",
               "punctuation", "whitespace"},
    "copy": {"copy", "deepcopy"},
}
_METHODS = {
    str: {"join", "upper", "lower", "strip", "split", "replace", "startswith", "endswith"},
    list: {"append", "extend", "copy", "count", "index", "insert", "pop", "reverse"},
    dict: {"get", "keys", "values", "items", "copy"},
    random.Random: {"randint", "choice", "random", "uniform", "sample", "shuffle", "randrange"},
}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos,
          ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
            ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.Is: operator.is_, ast.IsNot: operator.is_not,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


class _Module:
    def __init__(self, name: str, rng: random.Random):
        self.name = name
        self.source = rng if name == "random" else importlib.import_module(name)

    def get(self, attr: str):
        if attr not in _MODULES[self.name]:
            raise Unsplittable(f"{self.name}.{attr} is not supported")
        return random.Random if attr == "Random" else getattr(self.source, attr)


class _Deferred:
    """A test variable whose value needs the program: the record (``_callN``) that computes it,
    resolved with the calls."""

    def __init__(self, ref: str):
        self.ref = ref


def _refs(node: ast.AST) -> set[str]:
    """The records (``_callN``) whose values ``node`` uses."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id.startswith("_call")}


def _binary(op: type, a, b):
    if op is ast.Pow and type(b) is int and abs(b) > 10_000 and type(a) is int and abs(a) > 1:
        raise ValueError("exponent too large")
    if op is ast.LShift and type(b) is int and b > 100_000:
        raise ValueError("shift too large")
    if op is ast.Mult:
        for seq, n in ((a, b), (b, a)):
            if type(n) is int and isinstance(seq, (str, bytes, list, tuple)) and \
                    len(seq) * n > _MAX_SIZE:
                raise ValueError("sequence too long")
    return _BINARY[op](a, b)


class _Checker:
    """One benchmark prompt's tests, executed here; the calls go to the sandbox."""

    def __init__(self, program_names: set[str], aliases: dict[str, str] | None = None,
                 prompt_names: set[str] = frozenset()):
        self.rng = random.Random(_RNG_SEED)
        self.aliases = aliases or {}  # HumanEval: check's ``candidate`` -> the entry point
        # the task's names (never the completion's): its functions, called in the program's
        # sandbox, and the prompt's own helpers, called in a sandbox of the prompt's code alone
        self.program = set(program_names) | set(self.aliases)
        self.prompt = set(prompt_names) - self.program
        self.imported: list = []  # functions imported by the tests from _MODULES
        # records, in order: {"world": "program" | "prompt" | "here", "node", "env", "convert",
        # "discard"}; record N's value is ``_callN``, resolved by :meth:`resolve`
        self.calls: list[dict] = []
        self.asserts: list[tuple[ast.expr, dict, str]] = []
        self.fresh = 0

    # -- what this process can evaluate ------------------------------------------------------
    def here(self, node: ast.AST, env: dict, bound: frozenset = frozenset()) -> bool:
        """Whether ``node`` needs nothing of the program (checked without side effects): the
        rule of its node type (:attr:`_HERE`); a node type without one needs the sandbox."""
        rule = self._HERE.get(type(node))
        return rule is not None and rule(self, node, env, bound)

    def _all_here(self, nodes, env: dict, bound: frozenset) -> bool:
        return all(self.here(n, env, bound) for n in nodes)

    def _here_name(self, node: ast.Name, env: dict, bound: frozenset) -> bool:
        if node.id in bound:
            return True
        if node.id in env:
            return not isinstance(env[node.id], (_Deferred, _Module))
        return node.id in _BUILTINS and node.id not in self.program | self.prompt

    def _here_elements(self, node, env: dict, bound: frozenset) -> bool:
        return all(self.here(e, env, bound) and not isinstance(e, ast.Starred)
                   for e in node.elts)

    def _here_dict(self, node: ast.Dict, env: dict, bound: frozenset) -> bool:
        return all(k is not None and self.here(k, env, bound) for k in node.keys) and \
            self._all_here(node.values, env, bound)

    def _here_compare(self, node: ast.Compare, env: dict, bound: frozenset) -> bool:
        return all(type(o) in _COMPARE for o in node.ops) and \
            self._all_here([node.left, *node.comparators], env, bound)

    def _here_slice(self, node: ast.Slice, env: dict, bound: frozenset) -> bool:
        return self._all_here([p for p in (node.lower, node.upper, node.step) if p is not None],
                              env, bound)

    def _here_call(self, node: ast.Call, env: dict, bound: frozenset) -> bool:
        return self._callable_here(node.func, env, bound) and \
            all(self.here(a, env, bound) and not isinstance(a, ast.Starred) for a in node.args) \
            and all(k.arg is not None and self.here(k.value, env, bound) for k in node.keywords)

    def _here_comprehension(self, node, env: dict, bound: frozenset) -> bool:
        inner = set(bound)
        for gen in node.generators:
            if gen.is_async or not self.here(gen.iter, env, frozenset(inner)):
                return False
            names = self._targets(gen.target)
            if names is None:
                return False
            inner |= names
            if not self._all_here(gen.ifs, env, frozenset(inner)):
                return False
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        return self._all_here(parts, env, frozenset(inner))

    _HERE = {
        ast.Constant: lambda self, node, env, bound: True,
        ast.Name: _here_name,
        ast.Tuple: _here_elements, ast.List: _here_elements, ast.Set: _here_elements,
        ast.Dict: _here_dict,
        ast.UnaryOp: lambda self, node, env, bound: type(node.op) in _UNARY and self.here(
            node.operand, env, bound),
        ast.BinOp: lambda self, node, env, bound: type(node.op) in _BINARY and self._all_here(
            [node.left, node.right], env, bound),
        ast.BoolOp: lambda self, node, env, bound: self._all_here(node.values, env, bound),
        ast.Compare: _here_compare,
        ast.IfExp: lambda self, node, env, bound: self._all_here(
            [node.test, node.body, node.orelse], env, bound),
        ast.Subscript: lambda self, node, env, bound: self._all_here(
            [node.value, node.slice], env, bound),
        ast.Slice: _here_slice,
        ast.Attribute: lambda self, node, env, bound: self._module_attr(node, env) is not None,
        ast.Call: _here_call,
        ast.ListComp: _here_comprehension, ast.SetComp: _here_comprehension,
        ast.GeneratorExp: _here_comprehension, ast.DictComp: _here_comprehension,
    }  # node type -> whether it is evaluable here (anything else: in the sandbox)

    @staticmethod
    def _targets(target: ast.expr) -> set[str] | None:
        if isinstance(target, ast.Name):
            return {target.id}
        if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
            return {e.id for e in target.elts}
        return None

    @staticmethod
    def _module_attr(node: ast.Attribute, env: dict):
        if isinstance(node.value, ast.Name) and isinstance(env.get(node.value.id), _Module) and \
                node.attr in _MODULES[env[node.value.id].name]:
            return env[node.value.id]
        return None

    def _callable_here(self, func: ast.expr, env: dict, bound: frozenset) -> bool:
        if isinstance(func, ast.Name):
            if func.id in env:
                return any(env[func.id] is f for f in self.imported)
            return func.id in _BUILTINS and func.id not in bound and \
                func.id not in self.program | self.prompt
        if isinstance(func, ast.Attribute):
            if self._module_attr(func, env) is not None:
                return True
            if isinstance(func.value, ast.Constant):
                owner = func.value.value
            elif isinstance(func.value, ast.Name) and func.value.id in env and \
                    func.value.id not in bound:
                owner = env[func.value.id]
            else:
                return False
            return func.attr in _METHODS.get(type(owner), ())
        return False

    # -- evaluating here ----------------------------------------------------------------------
    def value(self, node: ast.AST, env: dict):
        """``node`` evaluated here; only after :meth:`here` said yes (or with call values): the
        evaluation of its node type (:attr:`_VALUE`)."""
        rule = self._VALUE.get(type(node))
        if rule is None:
            raise Unsplittable(f"cannot evaluate {type(node).__name__}")
        return rule(self, node, env)

    def _value_bool(self, node: ast.BoolOp, env: dict):
        result = None
        for part in node.values:
            result = self.value(part, env)
            if bool(result) != isinstance(node.op, ast.And):
                break
        return result

    def _value_compare(self, node: ast.Compare, env: dict) -> bool:
        left = self.value(node.left, env)
        for op, right in zip(node.ops, node.comparators):
            right = self.value(right, env)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def _value_call(self, node: ast.Call, env: dict):
        func = node.func
        if isinstance(func, ast.Attribute) and self._module_attr(func, env) is None:
            owner = self.value(func.value, env)
            if (type(owner) not in sandbox.PLAIN and type(owner) not in _METHODS) or \
                    func.attr.startswith("_"):  # the tests' own values, or plain returned ones
                raise TypeError(f"{type(owner).__name__}.{func.attr} is not a method of plain data")
            target = getattr(owner, func.attr)
        else:
            target = self.value(func, env)
        return target(*(self.value(a, env) for a in node.args),
                      **{k.arg: self.value(k.value, env) for k in node.keywords})

    def _value_comprehension(self, node, env: dict):
        out = []
        self._comprehend(node, list(node.generators), dict(env), out)
        if isinstance(node, ast.SetComp):
            return set(out)
        return dict(out) if isinstance(node, ast.DictComp) else out

    _VALUE = {
        ast.Constant: lambda self, node, env: node.value,
        ast.Name: lambda self, node, env: env[node.id] if node.id in env else _BUILTINS[node.id],
        ast.Tuple: lambda self, node, env: tuple(self.value(e, env) for e in node.elts),
        ast.List: lambda self, node, env: [self.value(e, env) for e in node.elts],
        ast.Set: lambda self, node, env: {self.value(e, env) for e in node.elts},
        ast.Dict: lambda self, node, env: {self.value(k, env): self.value(x, env)
                                           for k, x in zip(node.keys, node.values)},
        ast.UnaryOp: lambda self, node, env: _UNARY[type(node.op)](self.value(node.operand, env)),
        ast.BinOp: lambda self, node, env: _binary(type(node.op), self.value(node.left, env),
                                                   self.value(node.right, env)),
        ast.BoolOp: _value_bool,
        ast.Compare: _value_compare,
        ast.IfExp: lambda self, node, env: self.value(node.body, env)
        if self.value(node.test, env) else self.value(node.orelse, env),
        ast.Subscript: lambda self, node, env: self.value(node.value, env)[
            self.value(node.slice, env)],
        ast.Slice: lambda self, node, env: slice(*(None if p is None else self.value(p, env)
                                                   for p in (node.lower, node.upper, node.step))),
        ast.Attribute: lambda self, node, env: self._module_attr(node, env).get(node.attr),
        ast.Call: _value_call,
        ast.ListComp: _value_comprehension, ast.SetComp: _value_comprehension,
        ast.GeneratorExp: _value_comprehension, ast.DictComp: _value_comprehension,
    }  # node type -> its value here

    def _comprehend(self, node, generators, env, out):
        if not generators:
            out.append((self.value(node.key, env), self.value(node.value, env))
                       if isinstance(node, ast.DictComp) else self.value(node.elt, env))
            return
        gen, rest = generators[0], generators[1:]
        for item in self.value(gen.iter, env):
            self._bind(gen.target, item, env)
            if all(self.value(c, env) for c in gen.ifs):
                self._comprehend(node, rest, env, out)

    @staticmethod
    def _bind(target: ast.expr, item, env: dict) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = item
        else:
            items = list(item)
            if len(items) != len(target.elts):
                raise ValueError("cannot unpack")
            for t, x in zip(target.elts, items):
                env[t.id] = x

    # -- what the sandboxes evaluate ----------------------------------------------------------
    # The program's sandbox evaluates only calls of the task's functions, on arguments computed
    # here and sent as plain data (nested calls of its functions, and displays of them, stay one
    # call): ``f(_v0, g(_v1))``. Everything around them (built-ins, operators, ``abs``,
    # comparisons, the expected side) is evaluated here, with the values it returned: nothing the
    # completion defines (an ``abs``, a ``float`` subclass) takes part. The prompt's own helpers
    # (HumanEval/32's ``poly``) run in a sandbox of the prompt's code alone.
    def world(self, name: str, env: dict) -> str | None:
        """Where a call of ``name`` is evaluated: "program", "prompt", or None (not the task's)."""
        if name in env:
            return None
        if name in self.program:
            return "program"
        return "prompt" if name in self.prompt else None

    def _record(self, world: str, node: ast.AST, env: dict, convert: str | None = None,
                discard: bool = False) -> ast.Name:
        if len(self.calls) >= _MAX_CALLS:
            raise Unsplittable(f"more than {_MAX_CALLS} calls")
        self.calls.append(dict(world=world, node=node, env=env, convert=convert, discard=discard))
        return ast.Name(f"_call{len(self.calls) - 1}", ast.Load())

    @staticmethod
    def _snapshot(env: dict) -> dict:
        return {k: copy.deepcopy(v) if type(v) in sandbox.PLAIN else v for k, v in env.items()}

    def call(self, node: ast.Call, env: dict, discard: bool = False,
             convert: str | None = None) -> ast.Name:
        """``node`` (a call of one of the task's functions) as a record for its sandbox: the test
        values in its arguments are computed here first (in order, so ``random`` draws as in
        the test) and sent as plain data; returns the name its value will have here."""
        world = self.world(node.func.id, env)
        sent: dict = {}
        expr = self._child(node, env, sent, world)
        for val in sent.values():
            try:
                sandbox.encode(val)
            except (TypeError, ValueError, RecursionError) as exc:
                raise Unsplittable(f"a test value is not plain data ({exc})") from None
        return self._record(world, expr, copy.deepcopy(sent), convert, discard)

    def _child(self, node: ast.AST, env: dict, sent: dict, world: str) -> ast.AST:
        """``node`` as the sandbox of ``world`` evaluates it: calls of that world's functions,
        displays of them, and placeholders for values computed here or by other records."""
        if isinstance(node, ast.Constant):
            return node  # a literal: evaluated there without any name
        if isinstance(node, ast.expr) and self.here(node, env):
            found = self.value(node, env)
            if type(found) not in sandbox.PLAIN:
                raise Unsplittable(f"{ast.unparse(node)[:80]} is not plain data")
            return self._placeholder(found, sent)
        if isinstance(node, ast.Name):
            deferred = env.get(node.id)
            if isinstance(deferred, _Deferred):
                record = self.calls[int(deferred.ref[5:])]
                if record["world"] == world and not record["convert"]:
                    sent.update(record["env"])  # f(g(x)) as one call, as the test wrote it
                    return copy.deepcopy(record["node"])
                return ast.Name(deferred.ref, ast.Load())
            if node.id in self.aliases:
                return ast.Name(self.aliases[node.id], ast.Load())
            if self.world(node.id, env) == world:
                return node  # the task's own name (MBPP 367's trees, built by its setup)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                self.world(node.func.id, env) == world and not any(
                isinstance(a, ast.Starred) for a in node.args) and \
                all(k.arg is not None for k in node.keywords):
            return ast.Call(self._child(node.func, env, sent, world),
                            [self._child(a, env, sent, world) for a in node.args],
                            [ast.keyword(k.arg, self._child(k.value, env, sent, world))
                             for k in node.keywords])
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(
                isinstance(e, ast.Starred) for e in node.elts):
            return type(node)(elts=[self._child(e, env, sent, world) for e in node.elts],
                              **({} if isinstance(node, ast.Set) else {"ctx": ast.Load()}))
        elif isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
            return ast.Dict([self._child(k, env, sent, world) for k in node.keys],
                            [self._child(v, env, sent, world) for v in node.values])
        # anything else (arithmetic on a result, another world's call): computed first, here
        part = self.split(node, env)
        if not (isinstance(part, ast.Name) and part.id.startswith("_call")):
            part = self._record("here", part, self._snapshot(env))
        return ast.Name(part.id, ast.Load())

    def _placeholder(self, found, sent: dict) -> ast.Name:
        name = f"_v{self.fresh}"
        self.fresh += 1
        sent[name] = found
        return ast.Name(name, ast.Load())

    def split(self, node: ast.expr, env: dict) -> ast.expr:
        """``node`` with each call of the task's functions replaced by a record's name; the
        operations around them (comparisons, arithmetic, ``abs``, methods of the returned
        values, the expected side) stay here. Anything else that needs the program (a lambda,
        a comprehension over its values, an unknown function) cannot be split."""
        if self.here(node, env):
            return node
        if isinstance(node, ast.Name) and isinstance(env.get(node.id), _Deferred):
            return ast.Name(env[node.id].ref, ast.Load())
        if isinstance(node, ast.Starred) or (isinstance(node, ast.Call) and any(
                isinstance(a, ast.Starred) for a in node.args)):
            raise Unsplittable("a starred argument")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and self.world(func.id, env):
                return self.call(node, env)
            inner = node.args[0] if len(node.args) == 1 else None
            if isinstance(func, ast.Name) and func.id in _CONVERSIONS and not node.keywords and \
                    self._callable_here(func, env, frozenset()) and \
                    isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and \
                    self.world(inner.func.id, env):
                # list(f(x)): the program's value (an iterator, say) made plain there by the
                # runner's own ``list``, which the completion cannot redefine
                return self.call(inner, env, convert=func.id)
            args = [self.split(a, env) for a in node.args]
            keywords = [ast.keyword(k.arg, self.split(k.value, env)) for k in node.keywords]
            if self._callable_here(func, env, frozenset()):
                pass
            elif isinstance(func, ast.Attribute) and not func.attr.startswith("_") and \
                    self._module_attr(func, env) is None:  # a method of a returned value
                func = ast.Attribute(self.split(func.value, env), func.attr, ast.Load())
            else:
                raise Unsplittable(f"{ast.unparse(func)[:60]} is neither a function of the "
                                   "task nor a supported built-in")
            return ast.Call(func, args, keywords)
        if not isinstance(node, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.IfExp,
                                 ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Subscript,
                                 ast.Slice)):
            raise Unsplittable(f"a {type(node).__name__} around the program's values")
        node = copy.copy(node)
        for field, old in ast.iter_fields(node):
            if isinstance(old, list):
                setattr(node, field, [self.split(x, env) if isinstance(x, ast.expr) else x
                                      for x in old])
            elif isinstance(old, ast.expr):
                setattr(node, field, self.split(old, env))
        return node


    # -- statements -------------------------------------------------------------------------
    def run(self, statements: list[ast.stmt], env: dict) -> None:
        for st in statements:
            self.statement(st, env)

    def statement(self, st: ast.stmt, env: dict) -> None:
        """Run one test statement: the rule of its type (:attr:`_STATEMENTS`) where it takes the
        statement, else it cannot be split (:class:`Unsplittable`, naming the line)."""
        rule = self._STATEMENTS.get(type(st))
        if rule is None or rule(self, st, env) is False:
            raise Unsplittable(f"line {getattr(st, 'lineno', '?')}: "
                               f"{ast.unparse(st).splitlines()[0][:80]}")

    def _assert(self, st: ast.Assert, env: dict) -> None:
        snapshot = self._snapshot(env)
        self.asserts.append((self.split(st.test, env), snapshot, ast.unparse(st.test)))

    def _expression(self, st: ast.Expr, env: dict) -> None:
        if isinstance(st.value, (ast.Constant, ast.Name)):
            return  # a docstring, a bare ``print``
        if self.here(st.value, env):
            self.value(st.value, env)
        elif isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Name) and \
                self.world(st.value.func.id, env):
            self.call(st.value, env, discard=True)
        else:
            self._record("here", self.split(st.value, env), self._snapshot(env))

    def _assign(self, st: ast.Assign, env: dict) -> bool | None:
        if len(st.targets) != 1:
            return False
        target = st.targets[0]
        if self.here(st.value, env):
            self._bind_checked(target, self.value(st.value, env), env)
        elif isinstance(target, ast.Name):
            part = self.split(st.value, env)
            if not (isinstance(part, ast.Name) and part.id.startswith("_call")):
                part = self._record("here", part, self._snapshot(env))
            env[target.id] = _Deferred(part.id)
        else:
            raise Unsplittable("unpacking a value that needs the program")
        return None

    def _for(self, st: ast.For, env: dict) -> bool | None:
        if st.orelse or not self.here(st.iter, env):
            return False
        if self._targets(st.target) is None:
            raise Unsplittable("a for loop target that is not names")
        for item in self.value(st.iter, env):
            self._bind(st.target, item, env)
            self.run(st.body, env)
        return None

    def _if(self, st: ast.If, env: dict) -> bool | None:
        if not self.here(st.test, env):
            return False
        self.run(st.body if self.value(st.test, env) else st.orelse, env)
        return None

    def _import(self, st: ast.Import, env: dict) -> None:
        for alias in st.names:
            if alias.name not in _MODULES:
                raise Unsplittable(f"import {alias.name}")
            env[alias.asname or alias.name] = _Module(alias.name, self.rng)

    def _import_from(self, st: ast.ImportFrom, env: dict) -> bool | None:
        if st.module not in _MODULES or st.level:
            return False
        module = _Module(st.module, self.rng)
        for alias in st.names:
            found = module.get(alias.name)
            self.imported.append(found)
            env[alias.asname or alias.name] = found
        return None

    _STATEMENTS = {
        ast.Assert: _assert, ast.Expr: _expression, ast.Assign: _assign, ast.For: _for,
        ast.If: _if, ast.Import: _import, ast.ImportFrom: _import_from,
        ast.Pass: lambda self, st, env: None,
    }  # statement type -> how it runs here (False: this one cannot be split)

    def _bind_checked(self, target: ast.expr, item, env: dict) -> None:
        if self._targets(target) is None:
            raise Unsplittable("an assignment target that is not names")
        self._bind(target, item, env)

    # -- the records' values and the verdict, here -----------------------------------------
    def resolve(self, run: Callable[[str, list[dict]], list]) -> dict:
        """Every record's value (``{"_callN": value}``), in rounds: the records whose inputs are
        known are evaluated (``here``: by this process; ``program``/``prompt``: one
        ``run(world, calls)`` each, calls as :func:`tasks.sandbox.run_calls` takes them), until
        all are. A value computed here that the program needs must be plain data."""
        values: dict = {}
        needs = [_refs(c["node"]) for c in self.calls]
        rounds = 0
        while len(values) < len(self.calls):
            ready = [i for i, c in enumerate(self.calls)
                     if f"_call{i}" not in values and needs[i] <= values.keys()]
            if not ready:
                raise Unsplittable("records that wait on each other")
            local = [i for i in ready if self.calls[i]["world"] == "here"]
            for i in local:
                c = self.calls[i]
                values[f"_call{i}"] = self.value(c["node"], {**c["env"], **values})
            if local:
                continue  # what they unblock may be local too: one sandbox run per world
            rounds += 1
            if rounds > _MAX_ROUNDS:
                raise Unsplittable(f"calls that wait on each other more than {_MAX_ROUNDS} "
                                   "deep")
            for world in ("prompt", "program"):
                batch = [i for i in ready if self.calls[i]["world"] == world]
                if not batch:
                    continue
                calls = []
                for i in batch:
                    c = self.calls[i]
                    env = dict(c["env"])
                    for ref in sorted(needs[i]):
                        if type(values[ref]) not in sandbox.PLAIN:
                            raise TypeError(f"{type(values[ref]).__name__} is not plain data")
                        env[ref] = values[ref]
                    calls.append(dict(expr=ast.unparse(c["node"]), env=env,
                                      discard=c["discard"], convert=c["convert"]))
                values.update(zip((f"_call{i}" for i in batch), run(world, calls)))
        return values

    def verdict(self, named: dict) -> str | None:
        """None if every assert holds with the records' values (:meth:`resolve`), else why not
        (one line)."""
        for number, (node, env, text) in enumerate(self.asserts, 1):
            try:
                ok = bool(self.value(node, {**env, **named}))
            except Exception as exc:  # noqa: BLE001 - a test that raises is a failed test
                return f"AssertionError: test {number}: {text[:150]} raised " \
                       f"{type(exc).__name__}: {str(exc)[:100]}"
            if not ok:
                got = ", ".join(f"{repr(named[n.id])[:80]}" for n in ast.walk(node)
                                if isinstance(n, ast.Name) and n.id in named)
                return f"AssertionError: test {number}: {text[:150]} (got {got})"
        return None


def code_of(completion: str) -> str:
    """The code in a completion: a fenced block if there is one, else the text up to a stop."""
    fenced = re.findall(r"```(?:python)?\n(.*?)```", completion, flags=re.S)
    return fenced[0] if fenced else truncate(completion)


def _task_names(source: str) -> set[str]:
    """Names the task's own code (a reference solution, MBPP's setup, a HumanEval prompt) binds
    at its top level (parsed, never run): the only names a test's call may reach the program
    (or prompt) by. The completion's names never count: its ``abs`` is not the test's."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for st in tree.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(st.name)
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            continue  # modules the code uses, never the test's
        else:
            names |= {n.id for n in ast.walk(st)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


class _CallsFailed(Exception):
    """A sandbox run of the calls did not return values: its :class:`sandbox.Result`."""

    def __init__(self, result):
        super().__init__(result.reason)
        self.result = result


def _checked(programs: dict[str, str], checker: _Checker, build: Callable[[], None]) -> Score:
    """Split the tests (``build``), evaluate the task's calls in sandboxes (``programs``: the
    source each world runs: ``program`` the completion with the task's code around it,
    ``prompt`` the task's own code alone), and decide here whether every assert holds."""
    try:
        build()
    except (Unsplittable, SyntaxError) as exc:
        return Score("pass@1", 0.0, "failed", f"ValueError: test not supported here: {exc}")
    except Exception as exc:  # noqa: BLE001 - the test's own values raised (as in the test)
        return Score("pass@1", 0.0, "failed", f"{type(exc).__name__}: {str(exc)[:200]}")
    if not checker.asserts:
        return Score("pass@1", 0.0, "failed", "ValueError: the task has no asserts")
    output: list[str] = []

    def run(world: str, calls: list[dict]) -> list:
        result = sandbox.run_calls(programs[world], calls)
        output.append(result.stdout)
        if not result.passed:
            raise _CallsFailed(result)
        return result.values

    try:
        values = checker.resolve(run)
    except _CallsFailed as failed:
        return Score("pass@1", 0.0, failed.result.reason, failed.result.stdout[-300:])
    except Unsplittable as exc:
        return Score("pass@1", 0.0, "failed", f"ValueError: test not supported here: {exc}")
    except sandbox.SandboxUnavailable:
        raise  # no sandbox: nothing is scored (evaluate says so in one line)
    except Exception as exc:  # noqa: BLE001 - a test value computed here raised
        return Score("pass@1", 0.0, "failed", f"{type(exc).__name__}: {str(exc)[:200]}")
    shown = "".join(output)[-300:]
    why = checker.verdict(values)
    if why is not None:
        return Score("pass@1", 0.0, "failed", (shown + "\n" + why).lstrip())
    return Score("pass@1", 1.0, "passed", shown)


def mbpp(prompt: Prompt, completion: str) -> Score:
    """The tests call the functions the reference solution defines (and read the values MBPP's
    setup builds, as MBPP 367's trees): the setup runs after the code, whose classes it uses."""
    code = code_of(completion)
    program = "\n".join([code, prompt.setup])
    checker = _Checker(_task_names(prompt.reference) | _task_names(prompt.setup))

    def build():
        env: dict = {}
        for test in prompt.tests:
            checker.run(ast.parse(test).body, env)
    return _checked({"program": program, "prompt": prompt.setup}, checker, build)


def humaneval(prompt: Prompt, completion: str) -> Score:
    """``check(candidate)`` calls the entry point in the program's sandbox, and the prompt's
    other functions (HumanEval/32's ``poly``, /38's ``encode_cyclic``) in a sandbox of the
    prompt alone: a completion that redefines them changes nothing the test computes."""
    program = prompt.text + code_of(completion)

    def build():
        tree = ast.parse(prompt.tests[0])
        checks = [st for st in tree.body if isinstance(st, ast.FunctionDef)]
        if len(checks) != 1 or checks[0].name != "check" or len(checks[0].args.args) != 1:
            raise Unsplittable("the tests are not one check(candidate) function")
        checker.aliases[checks[0].args.args[0].arg] = prompt.entry_point
        checker.program.add(checks[0].args.args[0].arg)
        env: dict = {}
        checker.run([st for st in tree.body if st is not checks[0]], env)
        checker.run(checks[0].body, env)
    checker = _Checker({prompt.entry_point}, prompt_names=_task_names(_prompt_code(prompt.text)))
    return _checked({"program": program, "prompt": _prompt_code(prompt.text)}, checker, build)


def _prompt_code(text: str) -> str:
    """A HumanEval prompt as a module of its own (its helpers, for the prompt's sandbox): as
    written, or with a ``pass`` body for the function it leaves open."""
    try:
        ast.parse(text)
        return text
    except SyntaxError:
        return text.rstrip("\n") + "\n    pass\n"


def rouge_l(prompt: Prompt, completion: str) -> Score:
    from rouge_score import rouge_scorer
    text = truncate(completion).strip()
    if not prompt.reference:
        return Score("rougeL", None, "(no reference)")
    f1 = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score(
        prompt.reference, text)["rougeL"].fmeasure if text else 0.0
    return Score("rougeL", float(f1), text[:200])


def specbench(prompt: Prompt, completion: str) -> Score:
    if prompt.category == "summarization":
        return rouge_l(prompt, completion)
    if prompt.category == "math_reasoning" and prompt.reference:
        return gsm8k(prompt, completion)
    words = len(truncate(completion).split())
    return Score("output_words", None, f"{words} words", f"category {prompt.category}")


SCORERS: dict[str, Callable[[Prompt, str], Score]] = {
    "gsm8k": gsm8k, "math500": math500, "mbpp": mbpp, "humaneval": humaneval, "cnndm": rouge_l,
    "specbench": specbench,
}


def score(prompt: Prompt, completion: str) -> Score:
    return SCORERS[prompt.bench](prompt, completion)
