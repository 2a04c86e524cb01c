"""How much of the router→oracle gap does coact close, on held-out prompts?

    python bench/coact_gap.py --traces /tmp/coact-traces

Captures (or reuses) a calibration run (MBPP prompts from --cal-offset) and an evaluation run
(MBPP prompts from 0) with the default model, replays router, oracle and coact under both
coverage policies over the budget sweep, and prints per budget

    gap closed = (RSE_router − RSE_coact) / (RSE_router − RSE_oracle)     (mean RSE over tree-layers)

and the experts saved at matched error: for the router's RSE at budget B, the budget coact needs
(linear interpolation on its sweep), B − B_coact. Static ranking is shown for reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import polars as pl

from moe_spec.analysis.replay_views import budget_at
from moe_spec.bench.pipeline import capture, replay_runs, results_frame


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-coact"))
    p.add_argument("--model", default="tiny-olmoe")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--cal-prompts", type=int, default=24)
    p.add_argument("--cal-offset", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None,
                   help="also write the curves as JSON (ranking, coverage, budget, mean RSE)")
    args = p.parse_args()
    common = dict(model=args.model, bench="mbpp", max_new_tokens=args.max_new_tokens)
    capture(args.traces, "eval", **common, limit=args.eval_prompts)
    capture(args.traces, "cal", role="calibration", **common, limit=args.cal_prompts,
            offset=args.cal_offset)
    results = args.traces / "results"
    replay_runs(args.traces, args.model, ["eval"], calibration=("cal",),
                rankings=("static", "router", "oracle", "coact"),
                coverages=("truncation", "substitution"), budgets="sweep", out=results)
    df = results_frame(results)
    mean = df.group_by("ranking", "coverage", "budget").agg(pl.col("rse").mean()).sort("budget")
    for coverage in ("truncation", "substitution"):
        rows = df.filter(pl.col("coverage") == coverage).height // 4
        print(f"\n{args.model}, {coverage}: mean RSE over {rows} tree-layer-budgets per ranking")
        curves = {r: mean.filter((pl.col("ranking") == r) & (pl.col("coverage") == coverage))
                  for r in ("static", "router", "oracle", "coact")}
        print(f"{'B':>4} {'static':>9} {'router':>9} {'coact':>9} {'oracle':>9} "
              f"{'gap closed':>11} {'experts saved':>14}")
        for row in curves["router"].iter_rows(named=True):
            b = row["budget"]
            get = lambda r: float(curves[r].filter(pl.col("budget") == b)["rse"][0])  # noqa: E731
            r_, c_, o_, s_ = get("router"), get("coact"), get("oracle"), get("static")
            gap = (r_ - c_) / (r_ - o_) if r_ > o_ else np.nan
            saved = b - budget_at(curves["coact"]["budget"], curves["coact"]["rse"], r_)
            print(f"{b:4d} {s_:9.4f} {r_:9.4f} {c_:9.4f} {o_:9.4f} {gap:10.0%} {saved:14.1f}")
    if args.out:
        args.out.write_text(json.dumps(mean.sort("ranking", "coverage", "budget").to_dicts(),
                                       indent=1))


if __name__ == "__main__":
    main()
