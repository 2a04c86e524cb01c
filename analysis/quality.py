"""Task quality of captured outputs, and agreement of budgeted runs with their unbudgeted twins.

For every complete run, each prompt's output tokens are decoded with the run's tokenizer and
scored by its benchmark's scorer (:mod:`tasks.scoring`); the rows go to the ``quality`` table
(one per prompt, partitioned like the traces). A run captured under a budget (MoE-Spec online
mode) is paired with its *twin*: the unbudgeted run of the same model, benchmark, prompts and
decoding settings. Per prompt: whether the outputs are identical, the first token where they
differ, and both scores; per run, the quality difference with a paired bootstrap interval.

    interval  = the 2.5th and 97.5th percentiles of the mean over 2000 resamples of prompts
    paired    = prompts resampled together, the statistic is mean(score_B − score_twin)
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from moe_spec.catalog import Run, atomic, location, schema
from moe_spec.tasks import benchmarks, scoring

BUDGET_KEYS = ("budget", "ranking", "coverage", "calibration")
REASON_CHARS = 300  # of an exception's class and message kept per prompt
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning|Iteration)"
                             r"(: .*)?$")


def answer_of(s: scoring.Score) -> str:
    """The ``answer`` column: what was extracted, or why it failed. A program that failed in
    the sandbox keeps the exception's class and message (the last line of the traceback the
    sandbox captured, at most REASON_CHARS), as lm-eval's per-sample logs do: ``failed:
    NameError: name 'x' is not defined`` rather than ``failed``."""
    if s.answer != "failed" or not s.detail:
        return s.answer[:500]
    lines = [line.strip() for line in s.detail.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if not _EXCEPTION_LINE.match(last):
        return s.answer
    return f"{s.answer}: {last[:REASON_CHARS]}"


def failures(table: pa.Table, top: int = 3) -> list[tuple[str, int]]:
    """The most common reasons prompts failed (exception class, or timeout / killed)."""
    counts: dict[str, int] = {}
    for answer, score in zip(table["answer"].to_pylist(), table["score"].to_pylist()):
        if score != 0.0 or not answer:
            continue
        if answer.startswith("failed: "):
            answer = answer.removeprefix("failed: ").split(":")[0]
        elif answer not in ("failed", "timeout") and not answer.startswith("killed"):
            continue  # a wrong answer of a non-code task, not a failure
        counts[answer] = counts.get(answer, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]


def find_twin(run: Run, runs: list[Run]) -> Run | None:
    """The unbudgeted run with the same model, benchmark, prompts and decoding settings."""
    if run.settings.get("budget") is None:
        return None
    same = {k: v for k, v in run.settings.items() if k not in BUDGET_KEYS}
    for other in runs:
        if other.settings.get("budget") is None and other.model == run.model and \
                other.bench == run.bench and \
                other.manifest.get("prompt_ids") == run.manifest.get("prompt_ids") and \
                {k: v for k, v in other.settings.items() if k not in BUDGET_KEYS} == same:
            return other
    return None


def outputs(run: Run) -> dict[int, tuple[str, list[int]]]:
    """prompt index → (prompt id, output token ids)."""
    t = location.read_table(run.files("sequences"), columns=["prompt_index", "prompt_id",
                                                           "output_token_ids"])
    return {i: (p, ids) for i, p, ids in zip(t["prompt_index"].to_pylist(),
                                            t["prompt_id"].to_pylist(),
                                            t["output_token_ids"].to_pylist())}


def first_divergence(a: list[int], b: list[int]) -> int:
    """First position where two token sequences differ (-1: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def evaluate_run(run: Run, tokenizer, prompts: dict[str, benchmarks.Prompt],
                 twin: Run | None = None, twin_scores: dict[int, float | None] | None = None
                 ) -> pa.Table:
    """The ``quality`` rows of one run."""
    mine = outputs(run)
    theirs = outputs(twin) if twin else {}
    rows = []
    for index, (pid, ids) in sorted(mine.items()):
        s = scoring.score(prompts[pid], tokenizer.decode(ids, skip_special_tokens=True))
        other = theirs.get(index)
        rows.append(dict(prompt_index=index, prompt_id=pid, metric=s.metric, score=s.value,
                         answer=answer_of(s), output_tokens=len(ids),
                         twin_run=twin.name if twin else None,
                         exact_match=None if other is None else other[1] == ids,
                         first_divergence=None if other is None else
                         first_divergence(ids, other[1]),
                         twin_score=(twin_scores or {}).get(index)))
    return pa.Table.from_pylist(rows, schema=schema.QUALITY)


def write(run: Run, table: pa.Table) -> None:
    """The run's ``quality`` part (replaces an earlier evaluation of it)."""
    folder = run.dir("quality")
    path = folder / "part-0.parquet"
    try:
        location.mkdir(folder)
        atomic.write_table(path, table)
    except atomic.UnsafeTarget:
        raise
    except OSError as exc:  # full disk, permissions: one line naming the file
        why = exc.strerror or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OSError(f"cannot write {path}: {why}; free disk space or fix permissions, then "
                      "evaluate again") from None


def bootstrap_ci(values, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean over ``n`` resamples (seeded)."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if len(v) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n, len(v)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summary(table: pa.Table, n: int = 2000, seed: int = 0) -> dict:
    """Per-run figures: mean score with a bootstrap interval; against a twin, exact matches,
    first divergence and the paired difference in score with its interval."""
    d = table.to_pydict()
    scores = [x for x in d["score"] if x is not None]
    out = dict(prompts=table.num_rows, metric=d["metric"][0] if table.num_rows else None,
               mean=float(np.mean(scores)) if scores else None,
               ci95=list(bootstrap_ci(scores, n, seed)) if scores else None)
    if any(x is not None for x in d["exact_match"]):
        pairs = [(a, b) for a, b in zip(d["score"], d["twin_score"])
                 if a is not None and b is not None]
        diffs = [a - b for a, b in pairs]
        div = [x for x in d["first_divergence"] if x is not None and x >= 0]
        out.update(twin=d["twin_run"][0],
                   exact_match=float(np.mean([bool(x) for x in d["exact_match"]])),
                   mean_first_divergence=float(np.mean(div)) if div else None,
                   score_difference=float(np.mean(diffs)) if diffs else None,
                   difference_ci95=list(bootstrap_ci(diffs, n, seed)) if diffs else None)
    return out
