"""Is the oracle a bound in practice? Count the cells where a runtime ranking beats it.

    python bench/oracle_bound.py --traces /tmp/oracle-bound            # all five embedded models
    python bench/oracle_bound.py --traces /tmp/ob --models tiny-olmoe --eval-prompts 2

For each model: captures (or reuses) an evaluation run and a disjoint calibration run, replays
every runtime ranking, the oracle and (where C(N, B) is small) ``exact`` under both coverage
policies over the budget sweep, then counts per coverage the *cells* (tree-layer × budget) where
a runtime ranking's RSE is below the oracle's by more than 1e-9 relative, and the largest
|oracle − exact| where ``exact`` ran. Prints a table and writes ``oracle_bound.json`` beside the
traces. Goal: 0 cells on every model, oracle = exact wherever exact runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import polars as pl
import torch

from moe_spec.bench.pipeline import capture, replay_runs, results_frame
from moe_spec.moe.models import EMBEDDED
from moe_spec.policy import index

TOLERANCE = 1e-9  # relative
KEYS = ["prompt_index", "step", "layer", "coverage", "budget"]


def count(df: pl.DataFrame) -> list[dict]:
    """Per coverage and runtime ranking: cells compared, cells below the oracle, worst margin."""
    oracle = df.filter(pl.col("ranking") == "oracle").select(*KEYS, pl.col("rse").alias("oracle"))
    rows = []
    for (cov, ranking), part in df.filter(pl.col("ranking").is_in(
            index.ranking_names(runtime=True))).group_by("coverage", "ranking",
                                                         maintain_order=True):
        j = part.join(oracle, on=KEYS, how="inner")
        below = j.filter(pl.col("rse") < pl.col("oracle") * (1 - TOLERANCE) - 1e-15)
        worst = float((below["oracle"] - below["rse"]).max() or 0.0)
        rows.append(dict(coverage=cov, ranking=ranking, cells=j.height, below=below.height,
                         worst=worst))
    return sorted(rows, key=lambda r: (r["coverage"], r["ranking"]))


def versus_exact(df: pl.DataFrame) -> dict:
    exact = df.filter(pl.col("ranking") == "exact").select(*KEYS, pl.col("rse").alias("exact"))
    if not exact.height:
        return dict(cells=0, max_abs_diff=None)
    j = df.filter(pl.col("ranking") == "oracle").join(exact, on=KEYS, how="inner")
    return dict(cells=j.height, max_abs_diff=float((j["rse"] - j["exact"]).abs().max()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-oracle-bound"))
    p.add_argument("--models", nargs="+", default=list(EMBEDDED))
    p.add_argument("--bench", default="mbpp")
    p.add_argument("--eval-prompts", type=int, default=3)
    p.add_argument("--cal-prompts", type=int, default=8)
    p.add_argument("--cal-offset", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runtime = index.ranking_names(runtime=True)
    report = {}
    for model in args.models:
        t0 = time.perf_counter()
        common = dict(model=model, bench=args.bench, max_new_tokens=args.max_new_tokens)
        capture(args.traces, f"{model}-eval", **common, limit=args.eval_prompts)
        capture(args.traces, f"{model}-cal", role="calibration", **common,
                limit=args.cal_prompts, offset=args.cal_offset)
        out = args.traces / "results"
        replay_runs(args.traces, model, [f"{model}-eval"], calibration=(f"{model}-cal",),
                    rankings=(*runtime, "oracle", "exact"),
                    coverages=("truncation", "substitution"), budgets="sweep", out=out)
        df = results_frame(out, model=model)
        report[model] = dict(rows=count(df), exact=versus_exact(df),
                             seconds=round(time.perf_counter() - t0, 1))
    print(f"\ncells (tree-layer x budget) where a runtime ranking beats the oracle by more than "
          f"{TOLERANCE:g} relative")
    print(f"{'model':<18}{'coverage':<14}{'ranking':<14}{'cells':>7}{'below':>7}{'worst':>11}")
    for model, found in report.items():
        for r in found["rows"]:
            print(f"{model:<18}{r['coverage']:<14}{r['ranking']:<14}{r['cells']:>7}"
                  f"{r['below']:>7}{r['worst']:>11.2e}")
        ex = found["exact"]
        if ex["cells"]:
            print(f"{model:<18}oracle vs exact: {ex['cells']} cells, max |diff| "
                  f"{ex['max_abs_diff']:.2e}")
    total = sum(r["below"] for found in report.values() for r in found["rows"])
    print(f"total cells below the oracle: {total}")
    (args.traces / "oracle_bound.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
