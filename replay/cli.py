"""``replay``: re-run captured MoE layers under expert budgets and record what they cost.

    replay --ranking oracle --budget 24
    replay --ranking static router oracle coact --coverage both --budget sweep --calibration RUN
    replay --mode closed --ranking router --budget 16,32,48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from capture import console, models
from capture.moe_adapter import MoEAdapter
from replay import rankings
from replay.data import ReplayError, find_runs
from replay.run import ReplaySettings, calibrate, check_disjoint, parse_budgets, replay_run, summary_frame


def parser() -> argparse.ArgumentParser:
    p = console.ArgumentParser(
        prog="replay",
        description="Replay captured verification trees under expert budgets. Open loop: every "
                    "MoE layer of every tree is recomputed from its captured input under each "
                    "ranking, coverage policy and budget, and the reconstruction error recorded. "
                    "Closed loop: each tree is re-verified through the whole target with the "
                    "budget in every MoE layer. Results go to Parquet beside the traces; a "
                    "configuration already replayed is reused.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--traces", type=Path, default=Path("traces"), help="captured traces root")
    p.add_argument("--model", default=None,
                   help="only runs of this model (default: the model of the runs found)")
    p.add_argument("--bench", default=None, help="only runs of this benchmark")
    p.add_argument("--run", nargs="+", default=None, help="only these runs")
    p.add_argument("--ranking", nargs="+", default=["router", "oracle"], choices=rankings.ALL,
                   help="rankings to compare (closed loop: runtime rankings only)")
    p.add_argument("--coverage", default="both", choices=("truncation", "substitution", "both"))
    p.add_argument("--budget", default="24",
                   help="24, a list 8,16,32, a range 8:56:8 or sweep (the paper's grid for N)")
    p.add_argument("--layers", default=None, help="comma-separated decoder layers (default all)")
    p.add_argument("--calibration", nargs="+", default=[],
                   help="runs (under --traces) that static counts and coact statistics are "
                        "learned from; must not share prompts with the evaluated runs")
    p.add_argument("--mode", default="open", choices=("open", "closed"))
    p.add_argument("--out", type=Path, default=None, help="results root (default --traces)")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    models.quiet_transformers()
    try:
        runs = find_runs(args.traces, model=args.model, bench=args.bench, runs=args.run)
        runs = [r for r in runs if r.name not in args.calibration]
        if not runs:
            raise ReplayError(f"no complete captured runs match under {args.traces} (model="
                              f"{args.model}, bench={args.bench}, run={args.run})")
        names = {r.model for r in runs}
        if len(names) > 1:
            raise ReplayError(f"runs of several models found ({', '.join(sorted(names))}); "
                              "pick one with --model")
        model = args.model or names.pop()
        if args.model and args.model != runs[0].model:
            raise ReplayError(f"traces were captured with {runs[0].model}, not {args.model}")
        if any(r.manifest["settings"].get("budget") is not None for r in runs):
            raise ReplayError("replay needs plain EAGLE captures; some selected runs were "
                              "captured under a budget (pick runs with --run)")
        need_cal = [r for r in args.ranking if r in rankings.NEEDS_CALIBRATION]
        if need_cal and not args.calibration:
            raise ReplayError(f"--ranking {' '.join(need_cal)} needs --calibration RUN (captured "
                              "on other prompts)")
        if args.mode == "closed" and any(r in rankings.OFFLINE for r in args.ranking):
            raise ReplayError("closed loop takes runtime rankings only (router, static, coact)")
        loaded = models.load(model, device=args.device)
        adapter = MoEAdapter(loaded.model)
        budgets = parse_budgets(args.budget, adapter.num_experts)
        coverages = ("truncation", "substitution") if args.coverage == "both" else (args.coverage,)
        if coverages == ("substitution",) and max(budgets) < adapter.top_k:
            raise ReplayError(f"substitution needs a budget ≥ k = {adapter.top_k}")
        layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
        if layers:
            for layer in layers:
                adapter.layer(layer)
        stats = None
        if args.calibration:
            cal = find_runs(args.traces, model=model, runs=args.calibration)
            missing = set(args.calibration) - {r.name for r in cal}
            if missing:
                raise ReplayError(f"calibration run(s) {', '.join(sorted(missing))} not found "
                                  f"complete under {args.traces} for {model}")
            check_disjoint(runs, cal)
            stats = calibrate(cal, adapter, progress=not args.no_progress)
        settings = ReplaySettings(tuple(args.ranking), coverages, tuple(budgets), layers,
                                  tuple(sorted(args.calibration)), args.mode)
        folders = []
        for run in runs:
            folder, reused = replay_run(run, adapter, settings, stats, args.out or args.traces,
                                        progress=not args.no_progress)
            folders.append(folder)
            if reused:
                print(f"reused {folder}", file=sys.stderr)
    except (ReplayError, models.ModelError, KeyError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        print(f"replay: error: {msg}", file=sys.stderr)
        return 2
    frame = summary_frame(folders, args.mode)
    if frame is not None:
        import polars as pl
        with pl.Config(tbl_rows=200, tbl_cols=-1, tbl_width_chars=160,
                       tbl_hide_dataframe_shape=True, float_precision=4):
            print(frame)
    print(f"results: {', '.join(str(f) for f in folders)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
