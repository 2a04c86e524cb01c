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

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable

from tasks.benchmarks import Prompt
from tasks.sandbox import run_python

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


def code_of(completion: str) -> str:
    """The code in a completion: a fenced block if there is one, else the text up to a stop."""
    fenced = re.findall(r"```(?:python)?\n(.*?)```", completion, flags=re.S)
    return fenced[0] if fenced else truncate(completion)


def mbpp(prompt: Prompt, completion: str) -> Score:
    code = code_of(completion)
    program = "\n".join([prompt.setup, code, *prompt.tests])
    result = run_python(program)
    return Score("pass@1", float(result.passed), result.reason, result.stdout[-300:])


def humaneval(prompt: Prompt, completion: str) -> Score:
    program = "\n".join([prompt.text + code_of(completion), prompt.tests[0],
                         f"check({prompt.entry_point})"])
    result = run_python(program)
    return Score("pass@1", float(result.passed), result.reason, result.stdout[-300:])


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
