"""Options the benches share, importing nothing heavy (a bench refuses bad options before it
loads torch or a model)."""

from __future__ import annotations

import argparse
from pathlib import Path


def study_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of an adaptive-budget study (bench/adaptive_budget.py, adaptive_closed.py):
    its docstring's first paragraph as description, its usage examples as epilog (up to "Per
    model"), and the options every study has: ``--traces`` and ``--bench``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1].split("\n\nPer model")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-adaptive"),
                   help="captures and replays, one folder per model (default traces-adaptive)")
    p.add_argument("--bench", default="mbpp", help="benchmark of both runs (default mbpp)")
    p.add_argument("--benchmarks", type=Path, default=None,
                   help="the benchmarks folder (default: $MOESPEC_BENCHMARKS, else "
                        "../shared/data/benchmarks beside the repository)")
    return p


def check_benchmarks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an unknown ``--bench`` or a missing benchmarks folder in one line, before any
    model loads (the capture a study starts with would find it only after)."""
    from moe_spec.tasks import benchmarks
    if args.bench not in benchmarks.BENCHMARKS:
        p.error(f"--bench {args.bench}: unknown; known: {', '.join(benchmarks.BENCHMARKS)}")
    try:
        benchmarks.benchmarks_dir(args.benchmarks)
    except benchmarks.BenchmarkError as exc:
        p.error(str(exc))


def check_pacing(p: argparse.ArgumentParser, pace: float | None, scopes: list[str]) -> None:
    """``--pace`` (η > 0, finite) and ``--pace-over`` (only with a pace), refused as replay
    refuses them: a scope without a pace would give unpaced cells under a paced name."""
    if pace is not None and not 0 < pace < float("inf"):
        p.error(f"--pace {pace:g} must be a positive number")
    if pace is None and list(scopes) != ["prompt"]:
        p.error(f"--pace-over {' '.join(scopes)} is for a paced rule; add --pace ETA")
