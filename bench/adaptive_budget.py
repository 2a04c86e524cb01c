"""Budgets that adapt per tree-layer at the same mean experts per layer (issue 63), open loop.

    python bench/adaptive_budget.py --traces /tmp/adaptive --output docs/results/adaptive/tiny-olmoe.json
    python bench/adaptive_budget.py --models tiny-olmoe tiny-gpt-oss --eval-prompts 4 --cal-prompts 4
    python bench/adaptive_budget.py --render docs/results/adaptive/*.json --readme docs/results.md

Per model it captures (or reuses) an evaluation run (``eval-BENCH``: prompts 0..E−1), a
calibration run for the price λ (``cal-BENCH``: the next C prompts, role calibration) and, for
rankings that need calibration statistics, their own run (``stats-BENCH``: the C after those;
its prompts are in neither the λ calibration nor the table), replays the first two open loop
under ``--rankings`` and the oracle at every budget ``B_min .. B_max`` (B_min: the policy's
smallest, 1 under truncation and k under substitution; B_max = min(N, ``--max-budget``)), both
coverage policies, and reads each tree-layer's RSE and mass excluded at every budget back from
the replay results (the metrics' one owner, replay/open_loop.py). Then per ranking × policy ×
mean budget B̄ (``--means``, default k, k+2, ..., 16):

* fixed: the ranking's mean RSE at B = B̄ on the evaluation run;
* adaptive: :mod:`policy.adaptive`'s price rule on predicted gains (``--predictor``, from the
  mass each shortlist excludes; ``calibrated`` scales it per layer and budget on the calibration
  run), its price λ calibrated on the calibration run to a mean of B̄, applied to the held-out
  evaluation run; the achieved mean B per tree-layer there, its p10 and p90, measured;
* the ranking's own hindsight: the least error of the ranking's true curves over each pass's
  allocations with total B̄·L (:func:`policy.adaptive.best_budgets`, exact);
* fixed-B oracle: the oracle's mean RSE at B̄; adaptive oracle: the same exact hindsight on the
  oracle's curves, the bound of the adaptive family; the marginal-allocation greedy on those
  curves is kept in the output too (exact only where the curves are convex; the share of
  non-convex oracle curves is reported).

Everything is seeded; captures and replays already on disk are reused. ``--readme`` rewrites
the ``adaptive budgets`` block of docs/results.md from ``--output`` files (``--render``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl
import torch

from moe_spec.analysis.results_doc import add_table_options, read_model_outputs, write_block_or_exit
from moe_spec.bench.pipeline import capture, loaded_model, replay_runs, results_frame
from moe_spec.console import threads
from moe_spec.policy import adaptive, index

VERSION = 1  # of the --output layout
MODELS = ("tiny-olmoe", "tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3")
COVERAGES = ("truncation", "substitution")
BLOCK = "adaptive budgets"


def default_means(k: int, top: int) -> list[int]:
    """k, k+2, ... up to 16 (16 included), within ``top`` (B_max)."""
    last = min(16, top)
    return sorted({*range(k, last + 1, 2), last} & set(range(k, last + 1)))


def curves(df: pl.DataFrame, run: str, ranking: str, coverage: str, b_min: int, b_max: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rse, mass_excluded) [P, L, S+1]`` of one run's passes (prompt, step) × MoE layers ×
    budgets ``b_min .. b_max``, and the layers ``[L]``, from stored replay rows; refuses a grid
    with a hole (a pass without some layer or budget)."""
    rows = df.filter((pl.col("run") == run) & (pl.col("ranking") == ranking)
                     & (pl.col("coverage") == coverage)
                     & pl.col("budget").is_between(b_min, b_max)).sort(
        "prompt_index", "step", "layer", "budget")
    passes = rows.select("prompt_index", "step").unique().height
    layers = sorted(rows["layer"].unique().to_list())
    width = b_max - b_min + 1
    if rows.height == 0 or rows.height != passes * len(layers) * width:
        raise SystemExit(f"adaptive_budget.py: {run} · {ranking} · {coverage}: {rows.height} "
                         f"replay rows, not {passes} passes × {len(layers)} layers × {width} "
                         "budgets; replay them again")
    shape = (passes, len(layers), width)
    rse = torch.from_numpy(rows["rse"].to_numpy().astype("float64")).view(shape)
    mass = torch.from_numpy(rows["mass_excluded"].to_numpy().astype("float64")).view(shape)
    return rse, mass, torch.tensor(layers)


def spread(budgets: torch.Tensor) -> dict:
    """Achieved mean B per tree-layer, its p10 and p90, and p10/p90 of the passes' means."""
    b = budgets.double()
    q = torch.tensor([0.1, 0.9], dtype=torch.float64)
    per_layer, per_pass = b.flatten().quantile(q), b.mean(-1).quantile(q)
    return dict(achieved=float(b.mean()), p10=float(per_layer[0]), p90=float(per_layer[1]),
                pass_p10=float(per_pass[0]), pass_p90=float(per_pass[1]))


def nonconvex_share(rse: torch.Tensor) -> float:
    """Share of tree-layers whose error curve has a gain larger than the one before it (beyond
    10⁻¹² of rounding): where the greedy is not guaranteed exact."""
    g = adaptive.gains_of(rse)
    return float(((g[..., 1:] - g[..., :-1]) > 1e-12).any(-1).double().mean())


def evaluate(cal: dict, ev: dict, ranking: str, means: list[int], b_min: int, predictor: str,
             pass_cap: float | None) -> list[dict]:
    """The cells of one ranking and policy: ``cal`` and ``ev`` map ``ranking`` and ``oracle``
    to :func:`curves` of the calibration and the evaluation run."""
    rse_c, mass_c, layers = cal[ranking]
    rse_e, mass_e, layers_e = ev[ranking]
    if not torch.equal(layers, layers_e):
        raise SystemExit("adaptive_budget.py: the calibration and evaluation runs' layers differ")
    pred = adaptive.predictor(predictor).fit(mass_c, rse_c, layers)
    gains_c, gains_e = pred.gains(mass_c, layers), pred.gains(mass_e, layers)
    oracle = ev["oracle"][0]
    count = len(layers)
    out = []
    for mean in means:
        cap = None if pass_cap is None else round(pass_cap * mean * count)
        price = adaptive.calibrate_price(gains_c, mean, b_min, cap)
        chosen = adaptive.price_budgets(gains_e, price, b_min, cap)
        on_cal = adaptive.price_budgets(gains_c, price, b_min, cap)
        own = adaptive.best_budgets(rse_e, mean * count, b_min)
        best = adaptive.best_budgets(oracle, mean * count, b_min)
        greedy = adaptive.hindsight_budgets(adaptive.gains_of(oracle), mean * count, b_min)
        out.append(dict(
            ranking=ranking, predictor=predictor, mean_budget=mean, pass_cap=cap, price=price,
            fixed=float(rse_e[..., mean - b_min].mean()),
            adaptive=float(adaptive.errors_at(rse_e, chosen, b_min).mean()),
            hindsight=float(adaptive.errors_at(rse_e, own, b_min).mean()),
            oracle_fixed=float(oracle[..., mean - b_min].mean()),
            oracle_adaptive=float(adaptive.errors_at(oracle, best, b_min).mean()),
            oracle_adaptive_greedy=float(adaptive.errors_at(oracle, greedy, b_min).mean()),
            calibration_mean=float(on_cal.double().mean()), **spread(chosen),
            passes=int(chosen.shape[0]), tree_layers=int(chosen.numel())))
    return out


def study(root: Path, model: str, args) -> dict:
    """Capture, replay and evaluate one model: its block of the --output file."""
    common = dict(model=model, bench=args.bench, max_new_tokens=args.max_new_tokens,
                  seed=args.seed)
    _, adapter = loaded_model(model)
    k, n = adapter.top_k, adapter.num_experts
    b_max = min(n, args.max_budget)
    means = args.means or default_means(k, b_max)
    if max(means) > b_max or min(means) < k:
        raise SystemExit(f"adaptive_budget.py: --means must lie within k = {k} .. B_max = {b_max}")
    ev_run, cal_run, stats_run = (f"{r}-{args.bench}" for r in ("eval", "cal", "stats"))
    capture(root, ev_run, **common, limit=args.eval_prompts)
    capture(root, cal_run, role="calibration", **common, offset=args.eval_prompts,
            limit=args.cal_prompts)
    calibrated = tuple(r for r in args.rankings if index.RANKINGS[r].needs_calibration)
    if calibrated:  # the rankings' own statistics: prompts neither λ nor the table sees
        capture(root, stats_run, role="calibration", **common,
                offset=args.eval_prompts + args.cal_prompts, limit=args.cal_prompts)
    rankings = tuple(dict.fromkeys([*args.rankings, "oracle"]))
    out = root / "results" / "adaptive"
    both = dict(coverages=COVERAGES, budgets=f"1:{b_max}", out=out, bench=args.bench)
    replay_runs(root, model, [ev_run, cal_run], **both,
                rankings=tuple(r for r in rankings if r not in calibrated))
    if calibrated:
        replay_runs(root, model, [ev_run, cal_run], **both, rankings=calibrated,
                    calibration=(stats_run,))
    df = results_frame(out, model=model, bench=args.bench)
    cells, nonconvex = [], {}
    for cov in COVERAGES:
        b_min = index.min_budget(cov, k)
        cal = {r: curves(df, cal_run, r, cov, b_min, b_max) for r in rankings}
        ev = {r: curves(df, ev_run, r, cov, b_min, b_max) for r in rankings}
        nonconvex[cov] = nonconvex_share(ev["oracle"][0])
        for ranking in args.rankings:
            for predictor in args.predictors:
                cells += [dict(coverage=cov, b_min=b_min, statistics=(
                    stats_run if ranking in calibrated else None), **c) for c in evaluate(
                    cal, ev, ranking, means, b_min, predictor, args.pass_cap)]
    return dict(k=k, n=n, b_max=b_max, means=means, layers=len(cal[rankings[0]][2]),
                eval_prompts=args.eval_prompts, cal_prompts=args.cal_prompts, bench=args.bench,
                nonconvex_oracle_curves=nonconvex, cells=cells)


def within(cell: dict, tolerance: float = 0.02) -> bool:
    """The achieved mean on the held-out prompts within ``tolerance`` of B̄ (relative)."""
    return abs(cell["achieved"] - cell["mean_budget"]) <= tolerance * cell["mean_budget"]


def below(a: float, b: float, rel: float = 1e-9) -> bool:
    """``a`` lower than ``b`` beyond rounding (means of the same numbers summed in another order
    differ in the 16th digit)."""
    return a < b - rel * abs(b)


def markdown(report: dict) -> str:
    """The docs' table and goal counts, from the --output files alone."""
    lines = ["| model | policy | ranking · predictor | B̄ | fixed | adaptive | hindsight, same "
             "ranking | fixed-B oracle | adaptive oracle | achieved B̄ on held-out (p10–p90 per "
             "tree-layer) |", "|---|---|---|---|---|---|---|---|---|---|"]
    goals: dict[tuple, list[int]] = {}
    for model, found in report.items():
        for c in found["cells"]:
            key = (c["ranking"], c["predictor"])
            g = goals.setdefault(key, [0, 0, 0, 0, 0])
            g[0] += 1
            g[1] += below(c["adaptive"], c["fixed"])
            g[2] += not below(c["adaptive"], c["fixed"]) and not below(c["fixed"], c["adaptive"])
            g[3] += below(c["adaptive"], c["oracle_fixed"])
            g[4] += within(c)
            cap = f", cap {c['pass_cap']}" if c["pass_cap"] is not None else ""
            lines.append(
                f"| {model} | {c['coverage']} | {c['ranking']} · {c['predictor']}{cap} | "
                f"{c['mean_budget']} | {c['fixed']:.4f} | {c['adaptive']:.4f} | "
                f"{c['hindsight']:.4f} | {c['oracle_fixed']:.4f} | {c['oracle_adaptive']:.4f} | "
                f"{c['achieved']:.2f} ({c['p10']:.0f}–{c['p90']:.0f}) |")
    head = []
    for model, found in report.items():
        share = ", ".join(f"{cov} {100 * v:.0f}%"
                          for cov, v in found["nonconvex_oracle_curves"].items())
        head.append(f"- {model}: {found['eval_prompts']} evaluation and {found['cal_prompts']} "
                    f"calibration prompts of {found['bench']}, k = {found['k']} of N = "
                    f"{found['n']}, B per tree-layer within [B_min, {found['b_max']}], "
                    f"{found['cells'][0]['passes']} held-out passes × {found['layers']} layers; "
                    f"oracle curves not convex (greedy not guaranteed exact): {share}")
    for (ranking, predictor), (cells, lower, tied, below_oracle, near) in goals.items():
        head.append(f"- {ranking} · {predictor}: adaptive below fixed in {lower} of {cells} "
                    f"cells (equal in {tied}), below the fixed-B oracle in {below_oracle} of "
                    f"{cells}; achieved mean within 2% of B̄ on held-out prompts in {near} of "
                    f"{cells}")
    return "\n".join(head + [""] + lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1].split("\n\nPer model")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-adaptive"),
                   help="captures and replays, one folder per model (default traces-adaptive)")
    p.add_argument("--models", nargs="+", default=["tiny-olmoe"],
                   help=f"default tiny-olmoe; issue 63's families: {', '.join(MODELS)}")
    p.add_argument("--bench", default="mbpp", help="benchmark of both runs (default mbpp)")
    p.add_argument("--rankings", nargs="+", default=["router"],
                   help="stateless runtime rankings (default router); one that needs "
                        "calibration gets its own run, stats-BENCH (--cal-prompts prompts after "
                        "the calibration run's)")
    p.add_argument("--predictors", nargs="+", default=list(adaptive.PREDICTORS),
                   choices=list(adaptive.PREDICTORS), help="predicted gains (default: all)")
    p.add_argument("--means", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="mean budgets B̄, e.g. 8,12,16 (default k, k+2, ..., 16)")
    p.add_argument("--max-budget", type=int, default=32,
                   help="B_max: the largest budget a tree-layer may get, capped at N (default 32)")
    p.add_argument("--pass-cap", type=float, default=None,
                   help="hard cap on a pass's experts, as a multiple of B̄·L (default: none)")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--cal-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write every cell as JSON")
    threads.add_argument(p)
    add_table_options(p, BLOCK)
    args = p.parse_args(argv)
    if args.render:
        report = read_model_outputs(args.render, "adaptive_budget.py", VERSION)
    else:
        offline = [r for r in args.rankings if r not in index.RANKINGS
                   or not index.RANKINGS[r].runtime or index.RANKINGS[r].stateful]
        if offline:
            p.error(f"--rankings {' '.join(offline)}: this step evaluates stateless runtime "
                    "rankings only (router, sqmass, coact, ...): a stateful one's state would "
                    "come from fixed-budget passes")
        if args.pass_cap is not None and args.pass_cap < 1:
            p.error("--pass-cap must be at least 1 (a pass may always load B̄ per layer)")
        threads.apply(args.threads)
        report = {m: study(args.traces / m, m, args) for m in args.models}
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(dict(version=VERSION, models=report), indent=1))
    table = markdown(report)
    print(table)
    for readme in write_block_or_exit(args.readme, table, args.block, "adaptive_budget.py"):
        print(f"wrote the table into {readme}")


if __name__ == "__main__":
    main()
