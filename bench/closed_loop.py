"""Closed loop is the judge: acceptance under a budget per ranking, with 95% bootstrap intervals
over trees, and the online mode's output agreement with the unbudgeted run.

    python bench/cross_domain.py --traces /tmp/xdomain         # first: the runs this reuses
    python bench/closed_loop.py --traces /tmp/xdomain --output closed.json   # every model, bench
    python bench/closed_loop.py --traces /tmp/xdomain --models tiny-olmoe --benches gsm8k mbpp
    python bench/closed_loop.py --render closed.json --readme docs/results.md   # table only

Per model and benchmark it re-verifies every tree of the evaluation run ``eval-<bench>`` (from
``bench/cross_domain.py``) under each ranking × coverage × budget, calibrated on the mixed-domain
calibration runs (``cal-*`` of every benchmark, none sharing a prompt with the evaluation run),
and reports the mean and a percentile-bootstrap 95% interval (2000 resamples of trees, seeded) of

    accepted length (drafts + bonus) · path unchanged · top-1 agreement over nodes · KL(p ‖ p^B)

and, for accepted length and KL, the paired difference from router on the same trees (Δ =
X − router per tree, the trees resampled together): with a few dozen trees a cell's own
interval is wide, the paired one says whether a ranking differs from router at all. For
accepted length each cell also says its power (:mod:`analysis.power`): the trees it would need
to resolve a 0.1-token difference (α = 0.05, power 0.8, from the spread of its Δ) and the
difference its own trees resolve.

Then it captures the same prompts in MoE-Spec's online mode (``capture --budget B --ranking R``)
and reports output agreement with the unbudgeted run: the share of prompts whose output is
identical and the mean first divergence (output tokens before the first change; a prompt that
never diverges counts its full length).

Budgets default to each model's closed-loop grid (``cross_domain.closed_budgets_for``: k, 8, 16,
32 within range). Last, where ``bench/cross_domain.py`` stored the open-loop results of the same
calibration (``all``), it lists the cells where a lower open-loop error did not translate: a
ranking with a lower mean RSE than router whose mean accepted length is not higher.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import polars as pl

from moe_spec.analysis import power
from moe_spec.analysis.results_doc import add_table_options, write_block_or_exit
from moe_spec.bench.cross_domain import mean_rse, model_budgets
from moe_spec.bench.pipeline import capture, replay_runs, results_frame, run_names
from moe_spec.catalog import Catalog, reader
from moe_spec.console import threads

BENCHES = ("mbpp", "humaneval", "gsm8k", "math500", "cnndm", "specbench")
ORDER = ("router", "sqmass", "coact", "coact-online", "coact-prior", "learned", "sketch")  # columns
BLOCK = "closed loop"  # the marker lines' name (--block picks another block of the same file)
METRICS = ("accepted_length", "path_unchanged", "top1_agreement", "mean_kl")
PAIRED = ("accepted_length", "mean_kl")  # also as a difference from router on the same trees


def calibration_runs(root: Path, model: str) -> list[str]:
    """Every complete calibration run of ``bench/cross_domain.py`` (the mixed-domain source)."""
    return run_names(root, model, prefix="cal-")


def bootstrap(values: np.ndarray, rng: np.random.Generator, draws: int = 2000):
    """Mean and the 2.5/97.5 percentiles of the mean over ``draws`` resamples of trees."""
    picks = rng.integers(0, len(values), size=(draws, len(values)))
    means = values[picks].mean(1)
    return float(values.mean()), float(np.percentile(means, 2.5)), \
        float(np.percentile(means, 97.5))


def closed_table(root: Path, model: str, bench: str, args, budgets: str) -> list[dict]:
    out = root / "results" / "closed"
    replay_runs(root, model, [f"eval-{bench}"], bench=bench, mode="closed",
                rankings=tuple(args.rankings), coverages=("truncation", "substitution"),
                calibration=tuple(calibration_runs(root, model)), budgets=budgets, out=out)
    df = results_frame(out, "replay_closed", model=model, bench=bench)
    rng = np.random.default_rng(args.seed)
    tree = ["prompt_index", "step"]
    routers = {(coverage, budget): g.select(*tree, *PAIRED) for (coverage, budget), g in
               df.filter(pl.col("ranking") == "router").group_by("coverage", "budget")}
    rows = []
    for (ranking, coverage, budget), g in sorted(df.group_by("ranking", "coverage", "budget"),
                                                 key=lambda x: (x[0][1], x[0][2], x[0][0])):
        row = dict(model=model, bench=bench, ranking=ranking, coverage=coverage,
                   budget=int(budget), trees=g.height,
                   captured_accepted_length=float(g["captured_accepted_length"].mean()))
        for m in METRICS:
            row[m] = bootstrap(g[m].cast(pl.Float64).to_numpy(), rng)
        base = routers.get((coverage, budget))
        if ranking != "router" and base is not None:  # paired: the same trees, resampled together
            both = g.select(*tree, *PAIRED).join(base, on=tree, suffix="_router")
            for m in PAIRED:
                delta = (both[m] - both[f"{m}_router"]).cast(pl.Float64).to_numpy()
                row[f"{m}_vs_router"] = bootstrap(delta, rng) if both.height else None
            delta = (both["accepted_length"] - both["accepted_length_router"]).cast(
                pl.Float64).to_numpy()
            row["trees_needed"] = power.trees_needed(delta)  # for a 0.1-token difference
            row["resolvable"] = power.resolvable(delta)  # what these trees resolve
        rows.append(row)
    return rows


def outputs(root: Path, model: str, bench: str, run: str) -> dict[int, list[int]]:
    """Each prompt's output token ids in a run (read through the catalog)."""
    (found,) = Catalog(root).runs(model=model, bench=bench, names=[run])
    seq = pl.concat([pl.from_arrow(reader.read_parts(found, "sequences", i, [
        "prompt_index", "output_token_ids"])) for i in found.prompt_indices()])
    return dict(zip(seq["prompt_index"].to_list(), seq["output_token_ids"].to_list()))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first output token where ``a`` and ``b`` differ; None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def online_table(root: Path, model: str, bench: str, args) -> list[dict]:
    rows = []
    budgets = [] if args.online_budgets == "none" else args.online_budgets.split(",")
    for ranking in args.rankings:
        for budget in budgets:
            name = f"online-{bench}-{ranking}-{budget}"
            if name not in run_names(root, model, bench=bench):
                capture(root, name, model=model, bench=bench, limit=args.eval_prompts,
                        max_new_tokens=args.max_new_tokens, seed=args.seed, budget=int(budget),
                        ranking=ranking, coverage=args.online_coverage,
                        calibration=tuple(calibration_runs(root, model)))
            ours, twin = outputs(root, model, bench, name), outputs(root, model, bench,
                                                                    f"eval-{bench}")
            first = [first_divergence(ours[p], twin[p]) for p in sorted(twin)]
            rows.append(dict(model=model, bench=bench, ranking=ranking, budget=int(budget),
                             coverage=args.online_coverage, prompts=len(first),
                             exact_match=float(np.mean([f is None for f in first])),
                             first_divergence=float(np.mean([
                                 len(twin[p]) if f is None else f
                                 for p, f in zip(sorted(twin), first)])),
                             output_tokens=float(np.mean([len(t) for t in twin.values()]))))
    return rows


def untranslated(root: Path, model: str, closed: list[dict]) -> list[dict]:
    """Cells where a ranking's open-loop mean RSE (calibrated on ``all``, as the closed loop is)
    is lower than router's but its closed-loop mean accepted length is not higher; empty when
    ``bench/cross_domain.py`` has not stored those open-loop results."""
    try:
        rse = mean_rse(root, model)
    except (FileNotFoundError, ValueError):
        return []
    rse = rse.filter(pl.col("calibration").is_null() | (pl.col("calibration") == "all"))
    open_rse = {(r["bench"], r["ranking"], r["coverage"], int(r["budget"])): r["rse"]
                for r in rse.iter_rows(named=True)}
    acc = {(r["bench"], r["ranking"], r["coverage"], r["budget"]): r for r in closed
           if r["model"] == model}
    rows = []
    for (bench, ranking, coverage, budget), r in sorted(acc.items()):
        base = acc.get((bench, "router", coverage, budget))
        mine, theirs = (open_rse.get((bench, x, coverage, budget)) for x in (ranking, "router"))
        if ranking == "router" or base is None or mine is None or theirs is None:
            continue
        if mine < theirs and r["accepted_length"][0] <= base["accepted_length"][0]:
            rows.append(dict(model=model, bench=bench, ranking=ranking, coverage=coverage,
                             budget=budget, rse=mine, router_rse=theirs,
                             accepted_length=r["accepted_length"],
                             router_accepted_length=base["accepted_length"],
                             accepted_length_vs_router=r.get("accepted_length_vs_router")))
    return rows


BETTER = {"accepted_length": +1, "mean_kl": -1}  # the sign of an improvement over router


def verdicts(rows: list[dict], m: str) -> tuple[int, int, int]:
    """(better, worse, cells) among ``rows`` with a paired interval of Δ ``m`` vs router: better
    when the whole 95% interval lies on the improving side of zero, worse on the other."""
    deltas = [r[f"{m}_vs_router"] for r in rows if r.get(f"{m}_vs_router")]
    above, below = sum(lo > 0 for _, lo, _ in deltas), sum(hi < 0 for _, _, hi in deltas)
    return (above, below, len(deltas)) if BETTER[m] > 0 else (below, above, len(deltas))


def paired_summary(closed: list[dict]) -> dict[str, int]:
    """Cells (ranking ≠ router) whose paired 95% interval of Δ vs router says better, worse,
    or neither: for accepted length (higher is better) and KL (lower is better)."""
    out = {}
    for m in PAIRED:
        out[f"{m}_better"], out[f"{m}_worse"], out[f"{m}_cells"] = verdicts(closed, m)
    return out


def online_markdown(online: list[dict]) -> str:
    """The online-mode captures, one row per model × coverage × budget × ranking, averaged
    over the benchmarks (each a mean over its prompts)."""
    groups: dict[tuple, list[dict]] = {}
    for r in online:
        groups.setdefault((r["model"], r["coverage"], r["budget"], r["ranking"]), []).append(r)
    lines = ["| model | online, policy | B | ranking | benches | identical outputs | "
             "first divergence (tokens) | output tokens |", "|---|---|---|---|---|---|---|---|"]
    models = list(dict.fromkeys(r["model"] for r in online))
    for key in sorted(groups, key=lambda k: (models.index(k[0]), k[1], k[2],
                                             ORDER.index(k[3]) if k[3] in ORDER else 99)):
        g = groups[key]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(g)} | "
                     f"{100 * np.mean([r['exact_match'] for r in g]):.0f}% | "
                     f"{np.mean([r['first_divergence'] for r in g]):.1f} | "
                     f"{np.mean([r['output_tokens'] for r in g]):.1f} |")
    return "\n".join(lines)


def markdown(closed: list[dict]) -> str:
    """One row per model × policy × budget, one column per ranking: mean KL and mean accepted
    length over the benchmarks, and in how many benchmarks the paired 95% interval vs router
    says better (↓ KL, ↑ accepted; worse after a slash); "no budget" is the captured accepted
    length of the same trees."""
    found = set(r["ranking"] for r in closed)
    rankings = [x for x in ORDER if x in found] + sorted(found - set(ORDER))
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for r in closed:
        cells.setdefault((r["model"], r["coverage"], r["budget"]), {}).setdefault(
            r["ranking"], []).append(r)

    def count(rows, m):
        good, bad, _ = verdicts(rows, m)
        return f"{good}" + (f"/{bad}" if bad else "")

    lines = ["| model | policy | B | benches | no budget | " + " | ".join(rankings) + " |",
             "|---|---|---|---|---|" + "---|" * len(rankings)]
    models = list(dict.fromkeys(r["model"] for r in closed))
    for key in sorted(cells, key=lambda k: (models.index(k[0]), k[1] != "truncation", k[2])):
        by = cells[key]
        row = []
        for x in rankings:
            rows = by.get(x, [])
            if not rows:
                row.append("")
                continue
            kl = np.mean([r["mean_kl"][0] for r in rows])
            acc = np.mean([r["accepted_length"][0] for r in rows])
            row.append(f"{kl:.4f} · {acc:.2f}" if x == "router" else
                       f"{kl:.4f} ↓{count(rows, 'mean_kl')} · {acc:.2f} "
                       f"↑{count(rows, 'accepted_length')}")
        unbudgeted = np.mean([r["captured_accepted_length"] for r in by.get("router", [])])
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(by.get('router', []))} | "
                     f"{unbudgeted:.2f} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def power_markdown(closed: list[dict]) -> str:
    """Per model × policy × B × ranking, over the benchmarks: the median number of trees a cell
    needs to resolve a 0.1-token difference in accepted length from router (α = 0.05, power
    0.8; :mod:`analysis.power`), the median trees it has and the median difference those
    resolve."""
    groups: dict[tuple, list[dict]] = {}
    for r in closed:
        if r.get("trees_needed") is not None:
            groups.setdefault((r["model"], r["coverage"], r["budget"], r["ranking"]), []).append(r)
    lines = ["| model | policy | B | ranking | benches | trees per cell | trees needed for 0.1 "
             "(median, max) | resolvable now (median) |", "|---|---|---|---|---|---|---|---|"]
    models = list(dict.fromkeys(r["model"] for r in closed))
    for key in sorted(groups, key=lambda k: (models.index(k[0]), k[1] != "truncation", k[2],
                                             ORDER.index(k[3]) if k[3] in ORDER else 99)):
        g = groups[key]
        need = [r["trees_needed"] for r in g]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(g)} | "
                     f"{np.median([r['trees'] for r in g]):.0f} | {np.median(need):.0f}, "
                     f"{max(need)} | {np.median([r['resolvable'] for r in g]):.2f} tokens |")
    return "\n".join(lines)


def write_tables(closed: list[dict], online: list[dict], readmes: list[Path],
                 block: str = BLOCK) -> str:
    """The closed-loop (and, if any, online) summary tables and the power table, written
    between the markers of each of ``readmes``; returned for printing."""
    table = markdown(closed) + (f"\n\n{online_markdown(online)}" if online else "")
    if any(r.get("trees_needed") is not None for r in closed):
        table += ("\n\nTrees needed to resolve a 0.1-token difference in accepted length from "
                  "router (paired, α = 0.05, power 0.8; bench/closed_loop.py, analysis/power.py):"
                  f"\n\n{power_markdown(closed)}")
    write_block_or_exit(readmes, table, block, "closed_loop.py")
    return table


def print_closed(rows: list[dict]) -> None:
    print(f"\n{'model':<15}{'bench':<8}{'coverage':<13}{'B':>3} {'ranking':<13}"
          f"{'accepted':>20}{'path same':>20}{'top-1':>20}{'KL (nats)':>24}"
          f"{'Δ accepted vs router':>26}{'Δ KL vs router':>26}{'trees for 0.1':>14}"
          f"{'resolves':>9}")
    for r in rows:
        cells = "".join(f"{r[m][0]:8.3f} [{r[m][1]:.3f},{r[m][2]:.3f}]".rjust(20 if m !=
                        "mean_kl" else 24) for m in METRICS)
        paired = "".join((f"{d[0]:+8.3f} [{d[1]:+.3f},{d[2]:+.3f}]" if d else "").rjust(26)
                         for d in (r.get(f"{m}_vs_router") for m in PAIRED))
        need = "" if r.get("trees_needed") is None else f"{r['trees_needed']:14d}"
        resolves = "" if r.get("resolvable") is None else f"{r['resolvable']:9.3f}"
        print(f"{r['model']:<15}{r['bench']:<8}{r['coverage']:<13}{r['budget']:>3} "
              f"{r['ranking']:<13}{cells}{paired}{need:>14}{resolves:>9}")


def print_online(rows: list[dict]) -> None:
    print(f"\n{'model':<15}{'bench':<8}{'B':>3} {'ranking':<13}{'identical':>10}"
          f"{'first divergence':>18}{'of tokens':>10}")
    for r in rows:
        print(f"{r['model']:<15}{r['bench']:<8}{r['budget']:>3} {r['ranking']:<13}"
              f"{100 * r['exact_match']:9.0f}%{r['first_divergence']:18.1f}"
              f"{r['output_tokens']:10.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-xdomain"))
    p.add_argument("--models", nargs="+",
                   default=["tiny-olmoe", "tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"])
    p.add_argument("--benches", nargs="+", default=list(BENCHES))
    p.add_argument("--rankings", nargs="+",
                   default=["router", "sqmass", "coact", "coact-online", "coact-prior", "learned",
                            "sketch"])
    p.add_argument("--budgets", default="auto",
                   help="comma-separated budgets, or auto: each model's closed-loop grid")
    p.add_argument("--online-coverage", default="substitution")
    p.add_argument("--online-budgets", default="16,32",
                   help="budgets of the online-mode captures, comma-separated; none: skip them")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None)
    add_table_options(p, BLOCK)
    threads.add_argument(p)
    args = p.parse_args()
    if args.render:
        found = [json.loads(path.read_text()) for path in args.render]
        closed = [r for f in found for r in f["closed"]]
        online = [r for f in found for r in f.get("online", [])]
        print(write_tables(closed, online, args.readme, args.block))
        for readme in args.readme:
            print(f"wrote the table into {readme}")
        return
    threads.apply(args.threads)
    closed, online, missed = [], [], []
    for model in args.models:
        root = args.traces / model
        budgets = (",".join(map(str, model_budgets(model, closed=True)))
                   if args.budgets == "auto" else args.budgets)
        mine = []
        for bench in args.benches:
            mine += closed_table(root, model, bench, args, budgets)
            online += online_table(root, model, bench, args)
        closed += mine
        missed += untranslated(root, model, mine)
    print_closed(closed)
    print_online(online)
    print(f"\nlower open-loop RSE than router, accepted length not higher: {len(missed)} of "
          f"{sum(r['ranking'] != 'router' for r in closed)} cells")
    for r in missed:
        d = r["accepted_length_vs_router"]
        print(f"  {r['model']:<17}{r['bench']:<10}{r['coverage']:<13}B={r['budget']:<3}"
              f"{r['ranking']:<13} RSE {r['rse']:.4f} < {r['router_rse']:.4f}, accepted "
              f"{r['accepted_length'][0]:.3f} ≤ {r['router_accepted_length'][0]:.3f}"
              + (f" (paired Δ {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}])" if d else ""))
    paired = paired_summary(closed)
    for m, name in (("accepted_length", "accepted length"), ("mean_kl", "KL")):
        print(f"paired 95% interval vs router, {name}: better in {paired[f'{m}_better']}, worse "
              f"in {paired[f'{m}_worse']}, indistinguishable in "
              f"{paired[f'{m}_cells'] - paired[f'{m}_better'] - paired[f'{m}_worse']} of "
              f"{paired[f'{m}_cells']} cells")
    if args.output:
        args.output.write_text(json.dumps(dict(closed=closed, online=online, untranslated=missed,
                                               paired=paired), indent=1))
    write_tables(closed, online, args.readme, args.block)
    for readme in args.readme:
        print(f"wrote the table into {readme}")


if __name__ == "__main__":
    main()
