"""Task quality: one scorer per benchmark, on a model's completion of one prompt.

* ``gsm8k`` (``accuracy``): the number after the last ``####`` (else the last number) equals
  the reference's, after normalisation (commas, ``$`` and trailing zeros of decimals dropped);
* ``math500`` (``accuracy``): ``math-verify`` finds the completion's last LaTeX/numeric answer
  mathematically equal to the reference answer (symbolic: ``\\frac{1}{2}`` = ``0.5``);
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


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def normalise_number(text: str) -> str:
    """``$1,000.50`` → ``1000.5``; ``7.0`` → ``7``."""
    text = text.replace(",", "").replace("$", "").strip()
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def final_number(text: str) -> str | None:
    """The number after the last ``####``, else the last number in the text."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        if found:
            return normalise_number(found[0])
    found = _NUMBER.findall(text)
    return normalise_number(found[-1]) if found else None


def gsm8k(prompt: Prompt, completion: str) -> Score:
    got, want = final_number(truncate(completion)), final_number(prompt.reference)
    return Score("accuracy", float(got is not None and got == want), got or "(no number)",
                 f"reference {want}")


def math500(prompt: Prompt, completion: str) -> Score:
    from math_verify import parse, verify
    text = truncate(completion)
    try:
        gold = parse(f"${prompt.reference}$")
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
