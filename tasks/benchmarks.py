"""Benchmark prompt sets, read offline from a benchmarks folder.

The folder (layout of ``shared/data/benchmarks``) is found, in order, from the ``--benchmarks``
option, the ``MOESPEC_BENCHMARKS`` environment variable, or ``../shared/data/benchmarks`` next
to the repository. Files are never copied into the repository.

Every benchmark yields :class:`Prompt` records with a stable ``prompt_id`` (the upstream id,
never a position in a shuffled list) and the text after the benchmark's prompt template.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from moe_spec.errors import UserError

ENV_VAR = "MOESPEC_BENCHMARKS"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT.parent / "shared" / "data" / "benchmarks"

# MBPP's published split: task ids 11-510 are the test set, 601-974 the train set.
MBPP_TEST_IDS = range(11, 511)
MBPP_TRAIN_IDS = range(601, 975)


class BenchmarkError(UserError, ValueError):
    """A benchmark name or file that cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Prompt:
    bench: str
    prompt_id: str
    text: str  # the prompt after the benchmark's template
    reference: str = ""  # reference answer / code / summary where upstream has one
    tests: tuple[str, ...] = ()  # MBPP asserts; HumanEval's check(candidate) code
    setup: str = ""  # MBPP test_setup_code
    entry_point: str = ""  # HumanEval: the function the tests call
    category: str = ""  # Spec-Bench category


def benchmarks_dir(override: str | os.PathLike | None = None) -> Path:
    """The benchmarks folder; raises BenchmarkError naming where it looked."""
    candidates = [Path(override)] if override else []
    if not override and os.environ.get(ENV_VAR):
        candidates.append(Path(os.environ[ENV_VAR]))
    if not candidates:
        candidates.append(DEFAULT_DIR)
    for path in candidates:
        if path.is_dir():
            return path
    raise BenchmarkError(
        f"benchmarks folder not found at {candidates[0]}; point --benchmarks or ${ENV_VAR} "
        "at a folder laid out like shared/data/benchmarks"
    )


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise BenchmarkError(
            f"benchmark file {path} is missing; point --benchmarks or ${ENV_VAR} at a complete "
            "benchmarks folder"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    rows: list[dict] = []
    number = 0
    fix = f"restore {path} from the benchmark's upstream release"
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise BenchmarkError(f"{path} line {number} is not a JSON object; {fix}")
                rows.append(_Row(row, path=path, line=number))
    except json.JSONDecodeError as exc:
        raise BenchmarkError(f"{path} line {number} is not valid JSON ({exc.msg}); {fix}") \
            from None
    except UnicodeDecodeError:
        raise BenchmarkError(f"{path} line {number + 1} is not valid UTF-8; {fix}") from None
    except (OSError, EOFError) as exc:  # unreadable, or a damaged .gz
        raise BenchmarkError(f"cannot read {path} ({exc.strerror or exc}); {fix}") from None
    if not rows:
        raise BenchmarkError(f"{path} holds no rows; {fix}")
    return rows


class _Row(dict):
    """A benchmark row that names its file and line when a field is missing."""

    def __init__(self, row: dict, *, path: Path, line: int):
        super().__init__(row)
        self.path, self.line = path, line

    def __missing__(self, key):
        raise BenchmarkError(f"{self.path} line {self.line} has no {key!r} field; restore the "
                             "file from the benchmark's upstream release")


# --- prompt templates -------------------------------------------------------------------------
# One template per task family; the training corpus of the tiny models uses the same templates
# on the *train* splits, so that the embedded models have seen the format (never the prompts).


def mbpp_prompt(text: str, tests: list[str]) -> str:
    """MBPP's standard few-shot-free prompt: task text plus its asserts, then code."""
    return (
        f"You are an expert Python programmer, and here is your task: {text} "
        "Your code should pass these tests:\n\n" + "\n".join(tests) + "\n\n"
    )


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def math_prompt(problem: str) -> str:
    return f"Problem: {problem}\nSolution:"


def summary_prompt(article: str) -> str:
    return f"Article: {article}\n\nSummary:"


def _clean_code(code: str) -> str:
    return code.replace("\r\n", "\n").replace("\t", "    ")


def _mbpp(root: Path, ids: range) -> Iterator[Prompt]:
    for r in _read_jsonl(root / "mbpp" / "mbpp.jsonl"):
        if r["task_id"] in ids:
            yield Prompt("mbpp", str(r["task_id"]), mbpp_prompt(r["text"], r["test_list"]),
                         _clean_code(r["code"]), tests=tuple(r["test_list"]),
                         setup=r.get("test_setup_code") or "")


def _humaneval(root: Path) -> Iterator[Prompt]:
    for r in _read_jsonl(root / "humaneval" / "HumanEval.jsonl.gz"):
        yield Prompt("humaneval", r["task_id"], r["prompt"], r["canonical_solution"],
                     tests=(r["test"],), entry_point=r["entry_point"])


def _gsm8k(root: Path, split: str) -> Iterator[Prompt]:
    for i, r in enumerate(_read_jsonl(root / "gsm8k" / f"{split}.jsonl")):
        yield Prompt("gsm8k", f"{split}-{i}", gsm8k_prompt(r["question"]), " " + r["answer"])


def _math500(root: Path) -> Iterator[Prompt]:
    for r in _read_jsonl(root / "math500" / "test.jsonl"):
        yield Prompt("math500", r["unique_id"], math_prompt(r["problem"]), r["answer"])


def _specbench(root: Path, category: str | None) -> Iterator[Prompt]:
    for r in _read_jsonl(root / "cnndm" / "question.jsonl"):
        if category is not None and r["category"] != category:
            continue
        turn = r["turns"][0]
        if r["category"] == "summarization":
            # Spec-Bench's summarization turn already reads "Summarize: <article>".
            text = summary_prompt(turn.split(":", 1)[-1].strip())
        else:
            text = turn
        ref = (r.get("reference") or [""])[0] if isinstance(r.get("reference"), list) else ""
        yield Prompt("cnndm" if category else "specbench", str(r["question_id"]), text, ref,
                     category=r["category"])


LOADERS: dict[str, Callable[[Path], Iterator[Prompt]]] = {
    "mbpp": lambda root: _mbpp(root, MBPP_TEST_IDS),
    "humaneval": _humaneval,
    "gsm8k": lambda root: _gsm8k(root, "test"),
    "math500": _math500,
    "cnndm": lambda root: _specbench(root, "summarization"),
    "specbench": lambda root: _specbench(root, None),
}
BENCHMARKS = tuple(LOADERS)


def load(bench: str, *, root: str | os.PathLike | None = None, offset: int = 0,
         limit: int | None = None) -> list[Prompt]:
    """Evaluation prompts of ``bench`` in upstream order, sliced by offset/limit."""
    if bench not in LOADERS:
        raise BenchmarkError(f"unknown benchmark {bench!r}; known: {', '.join(BENCHMARKS)}")
    folder = benchmarks_dir(root)
    try:
        prompts = list(LOADERS[bench](folder))
    except (TypeError, IndexError, AttributeError, ValueError) as exc:
        if isinstance(exc, BenchmarkError):
            raise
        raise BenchmarkError(f"benchmark {bench} under {folder} has a field of the wrong type "
                             f"({type(exc).__name__}: {exc}); restore its file from the "
                             "upstream release") from None
    end = None if limit is None else offset + limit
    return prompts[offset:end]


def load_train(name: str, *, root: str | os.PathLike | None = None) -> list[Prompt]:
    """Training splits used for the embedded models' corpus (never evaluation prompts)."""
    base = benchmarks_dir(root)
    if name == "mbpp":
        return list(_mbpp(base, MBPP_TRAIN_IDS))
    if name == "gsm8k":
        return list(_gsm8k(base, "train"))
    raise BenchmarkError(f"no training split for {name!r}; available: mbpp, gsm8k")
