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
# whitelisted built-ins and methods); every sub-expression that needs the program (a call of its
# functions, a name it defines) becomes a *call* that the sandbox evaluates and returns as plain
# data (:func:`tasks.sandbox.run_calls`), after the test values it uses were computed here. Each
# assert is then evaluated here with those values: the comparison and its expected side never
# enter the sandbox. A test this cannot split is a failure that says so.

class Unsplittable(ValueError):
    """A test statement or expression this process cannot check without running it as code."""


_RNG_SEED = 0  # the tests' ``random``: a private, seeded generator (scores are reproducible)
_MAX_CALLS = 10_000
_MAX_SIZE = 10_000_000  # elements or characters a ``*`` here may build
_BUILTINS = {f.__name__: f for f in (
    abs, all, any, bool, chr, dict, divmod, enumerate, float, frozenset, int, len, list, max, min,
    ord, range, repr, reversed, round, set, sorted, str, sum, tuple, zip)}
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


class _Symbolic:
    """A test variable whose value needs the program: its expression, sent with each use."""

    def __init__(self, node: ast.expr, env: dict):
        self.node, self.env = node, env


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

    def __init__(self, program_names: set[str], aliases: dict[str, str] | None = None):
        self.rng = random.Random(_RNG_SEED)
        self.aliases = aliases or {}  # HumanEval: check's ``candidate`` -> the entry point
        self.program = set(program_names) | set(self.aliases)  # names the program binds
        self.imported: list = []  # functions imported by the tests from _MODULES
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
            return not isinstance(env[node.id], (_Symbolic, _Module))
        return node.id in _BUILTINS and node.id not in self.program

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
            return func.id in _BUILTINS and func.id not in bound and func.id not in self.program
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
            target = getattr(self.value(func.value, env), func.attr)
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

    # -- what the sandbox evaluates ------------------------------------------------------------
    def call(self, node: ast.expr, env: dict, discard: bool = False) -> ast.Name:
        """``node`` as a call for the sandbox: the test values in it are computed here first (in
        order, so ``random`` draws as in the test) and sent as plain data; returns the name the
        call's value will have when the assert is evaluated here."""
        if len(self.calls) >= _MAX_CALLS:
            raise Unsplittable(f"more than {_MAX_CALLS} calls")
        sent: dict = {}
        expr = self._send(copy.deepcopy(node), env, sent)
        for val in sent.values():
            try:
                sandbox.encode(val)
            except (TypeError, ValueError, RecursionError) as exc:
                raise Unsplittable(f"a test value is not plain data ({exc})") from None
        sent = copy.deepcopy(sent)  # as it is now: the test may change it later
        self.calls.append(dict(expr=ast.unparse(expr), env=sent, discard=discard))
        return ast.Name(f"_call{len(self.calls) - 1}", ast.Load())

    def _send(self, node: ast.AST, env: dict, sent: dict) -> ast.AST:
        if isinstance(node, ast.Name):
            if isinstance(env.get(node.id), _Symbolic):
                symbolic = env[node.id]
                sent.update(symbolic.env)
                return copy.deepcopy(symbolic.node)
            if node.id in self.aliases:
                return ast.Name(self.aliases[node.id], ast.Load())
            if node.id not in env:
                return node  # a built-in or the program's own name: the sandbox resolves it
            if type(env[node.id]) not in sandbox.PLAIN:
                raise Unsplittable(f"{node.id} (not plain data) used by the program's code")
            return self._placeholder(env[node.id], sent)
        if isinstance(node, ast.Attribute) and self._module_attr(node, env) is not None:
            module = self._module_attr(node, env)
            found = module.get(node.attr)
            if type(found) in sandbox.PLAIN:
                return self._placeholder(found, sent)
            if module.name == "random":  # its state stays here
                raise Unsplittable(f"random.{node.attr} used by the program's code")
            return ast.parse(f"__import__({module.name!r}).{node.attr}", mode="eval").body
        if isinstance(node, ast.expr) and not isinstance(node, ast.Constant) and \
                self.here(node, env):
            found = self.value(node, env)
            if type(found) not in sandbox.PLAIN:
                raise Unsplittable(f"{ast.unparse(node)[:80]} is not plain data")
            return self._placeholder(found, sent)
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.GeneratorExp,
                             ast.DictComp, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            raise Unsplittable(f"a {type(node).__name__} around the program's code")
        for field, old in ast.iter_fields(node):
            if isinstance(old, list):
                setattr(node, field, [self._send(x, env, sent) if isinstance(x, ast.AST) else x
                                      for x in old])
            elif isinstance(old, ast.AST):
                setattr(node, field, self._send(old, env, sent))
        return node

    def _placeholder(self, found, sent: dict) -> ast.Name:
        name = f"_v{self.fresh}"
        self.fresh += 1
        sent[name] = found
        return ast.Name(name, ast.Load())

    def split(self, node: ast.expr, env: dict) -> ast.expr:
        """``node`` with each largest part that needs the program replaced by a call's name; the
        operations around those parts (comparisons, arithmetic, ``abs``, the expected side)
        stay here."""
        if self.here(node, env):
            return node
        if isinstance(node, ast.Starred) or (isinstance(node, ast.Call) and any(
                isinstance(a, ast.Starred) for a in node.args)):
            raise Unsplittable("a starred argument")
        if isinstance(node, ast.Call) and self._callable_here(node.func, env, frozenset()):
            if isinstance(node.func, ast.Name) and node.func.id in _CONVERSIONS and \
                    len(node.args) == 1 and not node.keywords and \
                    isinstance(node.args[0], (ast.Call, ast.Name, ast.Subscript, ast.Attribute)):
                return self.call(node, env)  # list(f(x)): the conversion goes with the call
            node = copy.copy(node)
            node.args = [self.split(a, env) for a in node.args]
            node.keywords = [ast.keyword(k.arg, self.split(k.value, env)) for k in node.keywords]
            return node
        if isinstance(node, ast.Subscript) and not self.here(node.value, env):
            return self.call(node, env)  # f(x)[0]
        if not isinstance(node, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.IfExp,
                                 ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Subscript)):
            return self.call(node, env)  # a call of the program's code, a name it defines
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
        snapshot = {k: copy.deepcopy(v) if type(v) in sandbox.PLAIN else v
                    for k, v in env.items()}
        self.asserts.append((self.split(st.test, env), snapshot, ast.unparse(st.test)))

    def _expression(self, st: ast.Expr, env: dict) -> None:
        if isinstance(st.value, (ast.Constant, ast.Name)):
            return  # a docstring, a bare ``print``
        if self.here(st.value, env):
            self.value(st.value, env)
        else:
            self.call(st.value, env, discard=True)

    def _assign(self, st: ast.Assign, env: dict) -> bool | None:
        if len(st.targets) != 1:
            return False
        target = st.targets[0]
        if self.here(st.value, env):
            self._bind_checked(target, self.value(st.value, env), env)
        elif isinstance(target, ast.Name):
            sent: dict = {}
            node = self._send(copy.deepcopy(st.value), env, sent)
            env[target.id] = _Symbolic(node, sent)
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

    # -- the verdict, here ---------------------------------------------------------------------
    def verdict(self, values: list) -> str | None:
        """None if every assert holds with the calls' values, else why not (one line)."""
        named = {f"_call{i}": v for i, v in enumerate(values)}
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


def _program_names(source: str) -> set[str]:
    """Names the program binds at its top level (parsed, never run): a test's ``max(...)`` is
    the program's ``max`` if it defines one, so that part goes to the sandbox."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()  # the sandbox reports it
    names = set()
    for st in tree.body:
        for node in ast.walk(st):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return names


def _checked(program: str, checker: _Checker, build: Callable[[], None]) -> Score:
    """Split the tests (``build``), run the program and its calls in the sandbox, and decide
    here whether every assert holds."""
    try:
        build()
    except (Unsplittable, SyntaxError) as exc:
        return Score("pass@1", 0.0, "failed", f"ValueError: test not supported here: {exc}")
    except Exception as exc:  # noqa: BLE001 - the test's own values raised (as in the test)
        return Score("pass@1", 0.0, "failed", f"{type(exc).__name__}: {str(exc)[:200]}")
    if not checker.asserts:
        return Score("pass@1", 0.0, "failed", "ValueError: the task has no asserts")
    result = sandbox.run_calls(program, checker.calls)
    if not result.passed:
        return Score("pass@1", 0.0, result.reason, result.stdout[-300:])
    why = checker.verdict(result.values)
    if why is not None:
        return Score("pass@1", 0.0, "failed", (result.stdout[-300:] + "\n" + why).lstrip())
    return Score("pass@1", 1.0, "passed", result.stdout[-300:])


def mbpp(prompt: Prompt, completion: str) -> Score:
    code = code_of(completion)
    program = "\n".join([prompt.setup, code])
    checker = _Checker(_program_names(program))

    def build():
        env: dict = {}
        for test in prompt.tests:
            checker.run(ast.parse(test).body, env)
    return _checked(program, checker, build)


def humaneval(prompt: Prompt, completion: str) -> Score:
    program = prompt.text + code_of(completion)
    names = _program_names(program) | {prompt.entry_point}

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
    checker = _Checker(names)
    return _checked(program, checker, build)


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
