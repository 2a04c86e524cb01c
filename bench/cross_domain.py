"""Does a selector calibrated on one benchmark hold on another? The calibration × evaluation
matrix of the router→oracle gap closed, and coact's ablation, per model.

    python bench/cross_domain.py --traces /tmp/xdomain --output matrix.json   # the whole matrix
    python bench/cross_domain.py --models tiny-olmoe --rankings coact --output olmoe.json
    python bench/cross_domain.py --render matrix.json --readme README.md      # table from output

The whole matrix is one command: every model of ``--models`` (the four families of issue 28),
every evaluation × calibration cell, both policies, at the model's budgets (:func:`budgets_for`:
k to 32, N = 32 models k to 20). Captures and replays already on disk are reused, so a rerun
finishes what an interrupted one left and adds new rankings only. ``--readme`` rewrites the block
between a file's ``cross-domain matrix`` markers (``--block NAME`` for another: the README's
table is the ``sketch matrix`` block) from the JSON written with ``--output`` (or read with
``--render``): the table is never typed.

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
import statistics
import sys
from pathlib import Path

import polars as pl

from moe_spec.analysis.results_doc import add_table_options, write_block_or_exit
from moe_spec.bench.pipeline import capture, loaded_model, replay_runs, results_frame
from moe_spec.catalog.replay_metrics import gap_closed
from moe_spec.console import threads

BENCHES = ("mbpp", "humaneval", "gsm8k", "math500", "cnndm", "specbench")
BUDGETS = (8, 16, 24, 32)  # k = 8, N ≥ 64 (tiny-olmoe, tiny-qwen3-moe): budgets_for(8, 64)
MODELS = ("tiny-olmoe", "tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3")


def budgets_for(k: int, n: int) -> tuple[int, ...]:
    """The matrix's budgets for a model with top-k of N routed experts: from k (one token's own
    experts) to ``min(32, 5N/8)``, on a grid of 8 (N ≥ 64) or 4 (smaller N), k included.
    (8, 64) → 8, 16, 24, 32; (6, 64) → 6, 8, 16, 24, 32; (4, 32) → 4, 8, 12, 16, 20."""
    top, step = min(32, 5 * n // 8), 8 if n >= 64 else 4
    return tuple(sorted({k, *range(step, top + 1, step)} & set(range(k, top + 1))))


def closed_budgets_for(k: int, n: int) -> tuple[int, ...]:
    """The closed-loop tables' budgets (each re-verifies every tree): k, 8, 16 and 32 within
    :func:`budgets_for`'s range. (8, 64) → 8, 16, 32; (6, 64) → 6, 8, 16, 32; (4, 32) → 4, 8, 16."""
    return tuple(b for b in sorted({k, 8, 16, 32}) if b in budgets_for(k, n))


def model_budgets(model: str, closed: bool = False) -> tuple[int, ...]:
    """:func:`budgets_for` (or :func:`closed_budgets_for`) of an embedded or hub model."""
    _, adapter = loaded_model(model)
    return (closed_budgets_for if closed else budgets_for)(adapter.top_k, adapter.num_experts)
BASE = ("router", "oracle", "sqmass")  # need no calibration: replayed once per evaluation run
ABLATION_ONLY = {"coact-diag"}  # replayed for the diagonal, all and others only (the ablation)


def check_prompts(p: argparse.ArgumentParser, args) -> None:
    """Before any capture: each benchmark holds ``--eval-prompts`` evaluation prompts and at least
    one calibration prompt after them (else one line and exit 2); a calibration shorter than
    ``--cal-prompts`` (CNN/DM holds 80 prompts) is said, with the count it gets."""
    from moe_spec.tasks import benchmarks
    for bench in args.benches:
        have = len(benchmarks.load(bench))
        if have <= args.eval_prompts:
            p.error(f"{bench} holds {have} prompts: none left for its calibration run after "
                    f"--eval-prompts {args.eval_prompts}; ask for fewer")
        if have < args.eval_prompts + args.cal_prompts:
            print(f"note: {bench} holds {have} prompts: its calibration run gets the "
                  f"{have - args.eval_prompts} after the {args.eval_prompts} evaluation ones, "
                  f"not --cal-prompts {args.cal_prompts}", file=sys.stderr)


def capture_all(root: Path, model: str, args) -> None:
    common = dict(model=model, max_new_tokens=args.max_new_tokens, seed=args.seed)
    for bench in args.benches:
        capture(root, f"eval-{bench}", **common, bench=bench, limit=args.eval_prompts)
        capture(root, f"cal-{bench}", role="calibration", **common, bench=bench,
                offset=args.eval_prompts, limit=args.cal_prompts)


def replay_all(root: Path, model: str, args, budget_grid: tuple[int, ...] = BUDGETS) -> None:
    budgets = ",".join(map(str, budget_grid))
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
        df = results_frame(folder, model=model)
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
    return out.with_columns(gap_closed=gap_closed(pl.col("router"), pl.col("oracle"),
                                                  pl.col("rse")))


def print_matrix(model: str, gaps: pl.DataFrame, ranking: str,
                 budgets: tuple[int, ...] = BUDGETS) -> dict:
    worst = {}
    for coverage in ("truncation", "substitution"):
        g = gaps.filter((pl.col("ranking") == ranking) & (pl.col("coverage") == coverage))
        if g.is_empty():
            continue
        print(f"\n{model} · {ranking} · {coverage}: gap closed (%), rows evaluation ← "
              "calibration")
        print(f"  {'evaluated on':<11} {'calibrated on':<14}" +
              "".join(f"{'B=' + str(b):>8}" for b in budgets))
        for (bench, source), cell in sorted(g.group_by(["bench", "calibration"]),
                                            key=lambda x: (x[0][0], x[0][1] != x[0][0], x[0][1])):
            vals = {r["budget"]: r["gap_closed"] for r in cell.iter_rows(named=True)}
            mark = "*" if bench == source else " "
            print(f"  {bench:<11} {source + mark:<14}" +
                  "".join(f"{100 * vals.get(b, float('nan')):8.0f}" for b in budgets))
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


def print_ablation(model: str, gaps: pl.DataFrame, source: str,
                   budgets: tuple[int, ...] = BUDGETS) -> None:
    """router → sqmass → coact-diag → coact → oracle, as gap closed, calibrated on ``source``."""
    steps = ["sqmass", "coact-diag", "coact", "learned"]
    have = [s for s in steps if s in set(gaps["ranking"])]
    print(f"\n{model} · ablation (gap closed %, calibration: {source}; sqmass needs none)")
    for coverage in ("truncation", "substitution"):
        print(f"  {coverage}: {'bench':<10} {'B':>3}" + "".join(f"{s:>12}" for s in have))
        g = gaps.filter(pl.col("coverage") == coverage)
        for bench in sorted(set(g["bench"])):
            for b in budgets:
                cells = []
                for s in have:
                    sel = g.filter((pl.col("bench") == bench) & (pl.col("budget") == b)
                                   & (pl.col("ranking") == s)
                                   & ((pl.col("calibration") == source)
                                      | pl.col("calibration").is_null()))
                    cells.append(f"{100 * sel['gap_closed'][0]:12.0f}" if sel.height
                                 else f"{'—':>12}")
                print(f"  {'':<12} {bench:<10} {b:>3}" + "".join(cells))


SOURCE_KINDS = {
    "single": ("Off-diagonal single-benchmark cells (evaluated on one benchmark, calibrated on "
               "another alone), every budget:",
               lambda c: c["calibration"] not in (None, "all", "others")
               and c["calibration"] != c["bench"]),
    "others": ("Calibrated on the other benchmarks together (mixed, never the evaluated one), "
               "every budget:", lambda c: c["calibration"] == "others"),
}


def off_diagonal_summary(report: dict, kind: str = "single") -> list[dict]:
    """Per model × policy × calibrated ranking, over the off-diagonal cells of ``kind``
    (:data:`SOURCE_KINDS`: single-benchmark calibration, or ``others``) at every budget: how
    many, the share closing ≥ 50% of the router→oracle gap, the worst cell, and the median at
    the smallest budget (B = k: one token's own experts, where calibration statistics run out)."""
    rows = []
    for model, found in report.items():
        cells = [c for c in found["cells"]
                 if SOURCE_KINDS[kind][1](c) and c["ranking"] != "sqmass"]
        for key in sorted({(c["coverage"], c["ranking"]) for c in cells},
                          key=lambda x: (x[0] != "truncation", x[1])):
            mine = [c for c in cells if (c["coverage"], c["ranking"]) == key]
            worst = min(mine, key=lambda c: c["gap_closed"])
            missed = {}  # budget -> cells under 50%
            for c in mine:
                if c["gap_closed"] < 0.5:
                    missed[c["budget"]] = missed.get(c["budget"], 0) + 1
            k = min(c["budget"] for c in mine)
            at_k = [c["gap_closed"] for c in mine if c["budget"] == k]
            rows.append(dict(model=model, coverage=key[0], ranking=key[1], cells=len(mine),
                             median_at_k=statistics.median(at_k),
                             missed_by_budget=dict(sorted(missed.items())),
                             budgets=found.get("budgets"),
                             share_ge_50=sum(c["gap_closed"] >= 0.5 for c in mine) / len(mine),
                             worst=worst["gap_closed"], worst_cell=(
                                 f"{worst['bench']} ← {worst['calibration']}, B={worst['budget']}")))
    return rows


def markdown(report: dict) -> str:
    """The README's tables, from the report alone: one per kind of calibration source
    (:data:`SOURCE_KINDS`) the report holds cells of."""
    blocks = [markdown_table(report, kind) for kind in SOURCE_KINDS]
    return "\n\n".join(b for b in blocks if b)


def markdown_table(report: dict, kind: str) -> str:
    rows = off_diagonal_summary(report, kind)
    if not rows:
        return ""
    lines = [SOURCE_KINDS[kind][0], "",
             "| model | budgets | policy | ranking | off-diagonal cells | ≥ 50% of gap closed | "
             "cells under 50%, by B | worst cell | median at B = k |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        budgets = ", ".join(map(str, r["budgets"] or ()))
        missed = ", ".join(f"B={b}: {n}" for b, n in r["missed_by_budget"].items()) or "none"
        lines.append(f"| {r['model']} | {budgets} | {r['coverage']} | {r['ranking']} | "
                     f"{r['cells']} | {100 * r['share_ge_50']:.0f}% | {missed} | "
                     f"{100 * r['worst']:.0f}% ({r['worst_cell']}) | "
                     f"{100 * r['median_at_k']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-xdomain"))
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--benches", nargs="+", default=list(BENCHES))
    p.add_argument("--rankings", nargs="+",
                   default=["coact-diag", "coact", "coact-online", "coact-prior", "learned",
                            "sketch"],
                   help="calibrated rankings replayed per calibration source (coact-prior: the "
                        "recommended one)")
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
    p.add_argument("--capture-only", action="store_true",
                   help="capture the evaluation and calibration runs and stop (no replay, no "
                        "table): e.g. bench/closed_loop.py's runs at another --eval-prompts")
    threads.add_argument(p)
    add_table_options(p, "cross-domain matrix")
    args = p.parse_args()
    if args.render:
        report = {m: found for path in args.render
                  for m, found in json.loads(path.read_text()).items()}
    else:
        check_prompts(p, args)
        threads.apply(args.threads)
        if args.capture_only:
            for model in args.models:
                capture_all(args.traces / model, model, args)
                print(f"{model}: captured under {args.traces / model}")
            return
        args.full_matrix = not args.sources
        report = {}
        for model in args.models:
            root = args.traces / model
            budgets = model_budgets(model)
            capture_all(root, model, args)
            replay_all(root, model, args, budgets)
            rse = mean_rse(root, model)
            gaps = gap_table(rse, args.rankings)
            report[model] = dict(budgets=list(budgets),
                                 worst={r: print_matrix(model, gaps, r, budgets)
                                        for r in args.rankings}, cells=gaps.to_dicts())
            for source in ("all", "others"):
                print_ablation(model, gaps, source, budgets)
        if args.output:
            args.output.write_text(json.dumps(report, indent=1, default=str))
    table = markdown(report)
    print("\n" + table)
    for readme in write_block_or_exit(args.readme, table, args.block, "cross_domain.py"):
        print(f"wrote the table into {readme}")


if __name__ == "__main__":
    main()
