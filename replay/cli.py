"""``replay``: re-run captured MoE layers under expert budgets and record what they cost.

The parser imports nothing heavy (torch, transformers and the catalog load once a replay
starts), so ``--help`` appears at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import console
from catalog import ROLES
from policy import index

EXAMPLES = """
replay --ranking oracle --budget 24
replay --ranking router oracle --budget 8:56:8 --coverage substitution
replay --ranking static router oracle coact --budget sweep --calibration cal
replay --mode closed --ranking router --budget 16,32,48
replay --config sweep.toml --output summary.json
"""


def parser() -> argparse.ArgumentParser:
    p = console.ArgumentParser(
        prog="replay", examples=EXAMPLES,
        description="Replay captured verification trees under expert budgets. Open loop: every "
                    "MoE layer of every tree is recomputed from its captured input under each "
                    "ranking, coverage policy and budget, and the reconstruction error recorded. "
                    "Closed loop: each tree is re-verified through the whole target with the "
                    "budget in every MoE layer. Results go to Parquet beside the traces; cells "
                    "already replayed are reused, never stored twice.")
    p.add_config_option()
    p.add_argument("--traces", type=Path, default=Path("traces"), help="captured traces root")
    p.add_argument("--model", default=None,
                   help="only runs of this model (default: the model of the runs found)")
    p.add_argument("--bench", default=None, help="only runs of this benchmark")
    p.add_argument("--run", nargs="+", default=None, help="only these runs")
    p.add_argument("--role", default="evaluation", choices=ROLES,
                   help="which runs to evaluate (calibration runs are never evaluated by "
                        "accident)")
    p.add_argument("--ranking", nargs="+", default=["router", "oracle"],
                   choices=index.ranking_names(),
                   help="rankings to compare (closed loop: runtime ones only): "
                        + index.ranking_help())
    p.add_argument("--coverage", default="both", choices=(*index.COVERAGES, "both"),
                   help=index.coverage_help() + "; both: one result per policy")
    p.add_argument("--budget", default="24",
                   help="24, a list 8,16,32, a range 8:56:8 or sweep (the paper's grid for N)")
    p.add_argument("--layers", default=None, help="comma-separated decoder layers (default all)")
    p.add_argument("--calibration", nargs="+", default=[],
                   help="runs (under --traces) that static counts and coact statistics are "
                        "learned from; must not share prompts with the evaluated runs")
    p.add_argument("--allow-evaluation-calibration", action="store_true",
                   help="accept --calibration runs captured with --role evaluation (refused "
                        "by default)")
    p.add_argument("--mode", default="open", choices=("open", "closed"),
                   help="open: per-layer reconstruction error; closed: re-verify every tree "
                        "with the budget in all layers (acceptance under budget)")
    p.add_argument("--out", type=Path, default=None, help="results root (default --traces)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA if present), cpu, cuda, cuda:N: where the whole engine runs")
    p.add_argument("--batch", type=int, default=None, metavar="TREE_LAYERS",
                   help="tree-layers per batch (default: as many as fit in ~256 MiB of work "
                        "arrays)")
    p.add_argument("--workers", type=int, default=0,
                   help="fan prompts out to N Ray actors on a local cluster (pip install -e "
                        ".[ray]); each loads the model once")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_output_option()
    return p


def select_runs(catalog, args) -> list:
    from replay.run import ReplayError
    runs = catalog.runs(model=args.model, bench=args.bench, names=args.run)
    runs = [r for r in runs if r.name not in args.calibration]
    other = [r for r in runs if r.role != args.role]
    if args.run and other:
        raise ReplayError(f"run {other[0].name} is a {other[0].role} run; pass --role "
                          f"{other[0].role} to evaluate it anyway")
    runs = [r for r in runs if r.role == args.role]
    if not runs:
        raise ReplayError(f"no complete {args.role} runs match under {args.traces} (model="
                          f"{args.model}, bench={args.bench}, run={args.run})")
    names = {r.model for r in runs}
    if len(names) > 1:
        raise ReplayError(f"runs of several models found ({', '.join(sorted(names))}); pick one "
                          "with --model")
    empty = [r for r in runs if not r.prompt_indices()]
    if empty:
        raise ReplayError(f"run {empty[0].name} says complete but has no complete prompt (its "
                          f"sequences table is missing or empty under {empty[0].dir('sequences')})"
                          "; recapture it")
    if any(r.settings.get("budget") is not None for r in runs):
        raise ReplayError("replay needs plain EAGLE captures; some selected runs were captured "
                          "under a budget (pick runs with --run)")
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from catalog import Catalog, CatalogError
    from moe import models
    from moe.adapter import MoEAdapter
    from moe.families import UnsupportedModelError
    from policy import coverage, rankings
    from policy.calibration import evaluation_calibration
    from replay.open_loop import GoldMismatch
    from replay.run import ReplayError, ReplayRequest, calibration_stats, parse_budgets, replay, summary_frame
    models.quiet_transformers()
    try:
        catalog = Catalog(args.traces)
        if not catalog.manifests():
            raise ReplayError(f"no captured runs under {args.traces}; run `capture` first or "
                              "point --traces at a traces folder")
        runs = select_runs(catalog, args)
        model = runs[0].model
        if args.calibration and not args.allow_evaluation_calibration:
            problem = evaluation_calibration(catalog.runs(model=model, names=args.calibration))
            if problem:
                raise ReplayError(problem)
        classes = [rankings.get(r) for r in args.ranking]
        need_cal = [c.name for c in classes if c.needs_calibration]
        if need_cal and not args.calibration:
            raise ReplayError(f"--ranking {' '.join(need_cal)} needs --calibration RUN (captured "
                              "on other prompts)")
        offline = [c.name for c in classes if not c.runtime]
        if args.mode == "closed" and offline:
            raise ReplayError(f"closed loop takes runtime rankings only "
                              f"({', '.join(rankings.names(runtime=True))}), not "
                              f"{', '.join(offline)}")
        loaded = models.load(model, device=args.device)
        adapter = MoEAdapter(loaded.model)
        budgets = parse_budgets(args.budget, adapter.num_experts)
        coverages = tuple(coverage.COVERAGES) if args.coverage == "both" else (args.coverage,)
        if all(b < coverage.get(c).min_budget(adapter.top_k) for c in coverages for b in budgets):
            raise ReplayError(f"substitution needs a budget ≥ k = {adapter.top_k}")
        if args.batch is not None and args.batch < 1:
            raise ReplayError(f"--batch {args.batch} must be at least 1")
        try:
            layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
        except ValueError:
            raise ReplayError(f"cannot read --layers {args.layers!r}; use decoder layer numbers "
                              "like 0,4,7") from None
        for layer in layers or ():
            adapter.layer(layer)
        stats, cal = None, []
        if args.calibration:
            stats, cal = calibration_stats(catalog, args.calibration, model, runs, adapter,
                                           progress=not args.no_progress,
                                           rankings_used=tuple(args.ranking))
        request = ReplayRequest(tuple(args.ranking), coverages, tuple(budgets), layers, args.mode)
        outcome = replay(catalog, runs, adapter, request, stats, cal, args.out or args.traces,
                         device=loaded.device, progress=not args.no_progress,
                         max_batch=args.batch, workers=args.workers,
                         ray_address=args.ray_address)
    except (ReplayError, CatalogError, GoldMismatch, models.ModelError, UnsupportedModelError,
            rankings.RankingError) as exc:
        print(f"replay: error: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"replay: error: {exc.args[0]}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = getattr(exc, "filename", None) or args.out or args.traces
        print(f"replay: error: cannot write results to {where}: {exc.strerror or exc}; choose a "
              "writable --out", file=sys.stderr)
        return 2
    for name, skipped in outcome.skipped.items():
        print(f"replay: {name} skipped budgets {', '.join(map(str, skipped))}: C(N, B) exceeds "
              f"its limit of {rankings.get(name).limit} subsets", file=sys.stderr)
    for note in outcome.notes:
        print(f"replay: {note}", file=sys.stderr)
    for name in outcome.reused:
        print(f"reused stored results for run {name}", file=sys.stderr)
    frame = summary_frame(outcome, request)
    if frame is not None:
        import polars as pl
        with pl.Config(tbl_rows=200, tbl_cols=-1, tbl_width_chars=160,
                       tbl_hide_dataframe_shape=True, float_precision=4):
            print(frame)
    folders = sorted({str(u.folder.parent) for u in outcome.units})
    if outcome.tree_layers:
        print(f"replayed {outcome.tree_layers} tree-layers in {outcome.seconds:.1f} s "
              f"({outcome.tree_layers / max(outcome.seconds, 1e-9):.0f} tree-layers/s)")
    if outcome.trees:
        print(f"re-verified {outcome.trees} trees in {outcome.seconds:.1f} s")
    print(f"results: {', '.join(folders)}")
    payload = {"tool": "replay", "mode": args.mode, "traces": str(args.traces),
               "model": runs[0].model, "runs": [r.name for r in runs],
               "calibration": list(args.calibration), "rankings": list(args.ranking),
               "coverages": list(coverages), "budgets": list(budgets),
               "tree_layers": outcome.tree_layers, "trees": outcome.trees,
               "seconds": outcome.seconds, "results": folders,
               "reused": list(outcome.reused), "notes": list(outcome.notes),
               "skipped": {k: list(v) for k, v in outcome.skipped.items()},
               "summary": frame.to_dicts() if frame is not None else []}
    try:
        console.write_json(args.output, payload)
    except OSError as exc:
        print(f"replay: error: cannot write --output {args.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
