"""Does a selector calibrated on one benchmark hold on another? The calibration × evaluation
matrix of the router→oracle gap closed, and coact's ablation, per model.

    python bench/cross_domain.py --traces /tmp/xdomain                       # both models
    python bench/cross_domain.py --models tiny-olmoe --rankings coact --output matrix.json

Per model and benchmark (mbpp, humaneval, gsm8k, math500, cnndm, specbench) it captures an
evaluation run (prompts 0..E−1) and a calibration run (prompts E..E+C−1, role calibration) —
or reuses them — then replays every evaluation run open loop under router, oracle and the
runtime rankings of the ablation (sqmass, coact-diag, coact, learned where asked) at
B ∈ {8, 16, 24, 32}, truncation and substitution, once per calibration source: each benchmark's
calibration run, ``all`` (the six together, a mixed-domain calibration) and ``others`` (the five
benchmarks other than the evaluated one: mixed-domain and still out of domain). It prints

    gap closed = (RSE_router − RSE_X) / (RSE_router − RSE_oracle)      (mean RSE over tree-layers)

for every (evaluation, calibration) cell, the worst off-diagonal cell per ranking, and the
ablation (router → sqmass → coact-diag → coact → oracle) per model and benchmark, calibrated on
``all``. Everything is seeded; one run of this script is one set of numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import capture, replay_runs  # noqa: E402

BENCHES = ("mbpp", "humaneval", "gsm8k", "math500", "cnndm", "specbench")
BUDGETS = (8, 16, 24, 32)
BASE = ("router", "oracle", "sqmass")  # need no calibration: replayed once per evaluation run
ABLATION_ONLY = {"coact-diag"}  # replayed for the diagonal, all and others only (the ablation)


def capture_all(root: Path, model: str, args) -> None:
    common = dict(model=model, max_new_tokens=args.max_new_tokens, seed=args.seed)
    for bench in args.benches:
        capture(root, f"eval-{bench}", **common, bench=bench, limit=args.eval_prompts)
        capture(root, f"cal-{bench}", role="calibration", **common, bench=bench,
                offset=args.eval_prompts, limit=args.cal_prompts)


def replay_all(root: Path, model: str, args) -> None:
    budgets = ",".join(map(str, BUDGETS))
    sources = {**{b: [f"cal-{b}"] for b in args.benches},
               "all": [f"cal-{b}" for b in args.benches]}
    both = ("truncation", "substitution")
    for bench in args.benches:
        # mixed-domain calibration that has never seen the evaluated benchmark
        sources["others"] = [f"cal-{b}" for b in args.benches if b != bench]
        evaluated = dict(bench=bench, runs=[f"eval-{bench}"], budgets=budgets)
        replay_runs(root, model, **evaluated, coverages=both, rankings=BASE,
                    out=root / "results" / "base")
        for source, runs in sources.items():
            if source not in ("all", "others") and not args.full_matrix \
                    and source not in (bench, *args.sources):
                continue
            core = source in (bench, "all", "others")
            ranks = [r for r in args.rankings if r not in ABLATION_ONLY or core]
            cover = both if core or not args.off_diagonal_truncation_only else ("truncation",)
            replay_runs(root, model, **evaluated, coverages=cover, rankings=tuple(ranks),
                        calibration=tuple(runs), out=root / "results" / f"cal={source}")


def mean_rse(root: Path, model: str) -> pl.DataFrame:
    """Mean RSE per (evaluation bench, calibration source, ranking, coverage, budget)."""
    frames = []
    for folder in sorted((root / "results").iterdir()):
        if not (folder / "replay_open" / f"model={model}").is_dir():
            continue  # closed-loop results (bench/closed_loop.py) live beside these
        source = folder.name.removeprefix("cal=") if folder.name != "base" else None
        df = pl.read_parquet(f"{folder}/replay_open/model={model}/**/*.parquet",
                             hive_partitioning=True)
        frames.append(df.group_by("bench", "ranking", "coverage", "budget")
                      .agg(pl.col("rse").mean(), pl.len().alias("tree_layers"))
                      .with_columns(calibration=pl.lit(source)))
    return pl.concat(frames, how="diagonal_relaxed")


def gap_table(rse: pl.DataFrame, rankings: list[str]) -> pl.DataFrame:
    base = rse.filter(pl.col("calibration").is_null())
    ref = base.pivot(on="ranking", index=["bench", "coverage", "budget"], values="rse")
    rows = rse.filter(pl.col("ranking").is_in(rankings) | (pl.col("ranking") == "sqmass"))
    out = rows.join(ref.select("bench", "coverage", "budget", "router", "oracle"),
                    on=["bench", "coverage", "budget"])
    return out.with_columns(gap_closed=(pl.col("router") - pl.col("rse"))
                            / (pl.col("router") - pl.col("oracle")))


def print_matrix(model: str, gaps: pl.DataFrame, ranking: str) -> dict:
    worst = {}
    for coverage in ("truncation", "substitution"):
        g = gaps.filter((pl.col("ranking") == ranking) & (pl.col("coverage") == coverage))
        if g.is_empty():
            continue
        print(f"\n{model} · {ranking} · {coverage}: gap closed (%), rows evaluation ← "
              "calibration")
        print(f"  {'evaluated on':<11} {'calibrated on':<14}" +
              "".join(f"{'B=' + str(b):>8}" for b in BUDGETS))
        for (bench, source), cell in sorted(g.group_by(["bench", "calibration"]),
                                            key=lambda x: (x[0][0], x[0][1] != x[0][0], x[0][1])):
            vals = {r["budget"]: r["gap_closed"] for r in cell.iter_rows(named=True)}
            mark = "*" if bench == source else " "
            print(f"  {bench:<11} {source + mark:<14}" +
                  "".join(f"{100 * vals.get(b, float('nan')):8.0f}" for b in BUDGETS))
        kinds = {"single benchmark": ~pl.col("calibration").is_in(["all", "others"])
                 & (pl.col("bench") != pl.col("calibration")),
                 "others (mixed, out of domain)": pl.col("calibration") == "others"}
        for kind, sel in kinds.items():
            off = g.filter(sel)
            if not off.is_empty():
                row = off.sort("gap_closed").row(0, named=True)
                worst[f"{coverage}, {kind}"] = row
                print(f"  worst off-diagonal cell, {kind}: {100 * row['gap_closed']:.0f}% "
                      f"({row['bench']} ← {row['calibration']}, B={row['budget']})")
    return worst


def print_ablation(model: str, gaps: pl.DataFrame, rse: pl.DataFrame, source: str) -> None:
    """router → sqmass → coact-diag → coact → oracle, as gap closed, calibrated on ``source``."""
    steps = ["sqmass", "coact-diag", "coact", "learned"]
    have = [s for s in steps if s in set(gaps["ranking"])]
    print(f"\n{model} · ablation (gap closed %, calibration: {source}; sqmass needs none)")
    for coverage in ("truncation", "substitution"):
        print(f"  {coverage}: {'bench':<10} {'B':>3}" + "".join(f"{s:>12}" for s in have))
        g = gaps.filter(pl.col("coverage") == coverage)
        for bench in sorted(set(g["bench"])):
            for b in BUDGETS:
                cells = []
                for s in have:
                    sel = g.filter((pl.col("bench") == bench) & (pl.col("budget") == b)
                                   & (pl.col("ranking") == s)
                                   & ((pl.col("calibration") == source)
                                      | pl.col("calibration").is_null()))
                    cells.append(f"{100 * sel['gap_closed'][0]:12.0f}" if sel.height
                                 else f"{'—':>12}")
                print(f"  {'':<12} {bench:<10} {b:>3}" + "".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-xdomain"))
    p.add_argument("--models", nargs="+", default=["tiny-olmoe", "tiny-qwen3-moe"])
    p.add_argument("--benches", nargs="+", default=list(BENCHES))
    p.add_argument("--rankings", nargs="+",
                   default=["coact-diag", "coact", "coact-online", "learned"],
                   help="calibrated rankings replayed per calibration source")
    p.add_argument("--sources", nargs="*", default=[],
                   help="calibration benchmarks beyond the diagonal and 'all' (default: every "
                        "benchmark, the full matrix)")
    p.add_argument("--off-diagonal-truncation-only", action="store_true",
                   help="replay single-benchmark off-diagonal cells under truncation only "
                        "(both policies on the diagonal, all and others): half the time")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--cal-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write every cell as JSON")
    args = p.parse_args()
    args.full_matrix = not args.sources
    report = {}
    for model in args.models:
        root = args.traces / model
        capture_all(root, model, args)
        replay_all(root, model, args)
        rse = mean_rse(root, model)
        gaps = gap_table(rse, args.rankings)
        report[model] = dict(worst={r: print_matrix(model, gaps, r) for r in args.rankings},
                             cells=gaps.to_dicts())
        for source in ("all", "others"):
            print_ablation(model, gaps, rse, source)
    if args.output:
        args.output.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
