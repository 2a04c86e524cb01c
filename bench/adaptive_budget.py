"""Budgets that adapt per tree-layer at the same mean experts per layer (issue 63), open loop.

    python bench/adaptive_budget.py --traces /tmp/adaptive --output docs/results/adaptive/tiny-olmoe.json
    python bench/adaptive_budget.py --models tiny-olmoe tiny-gpt-oss --eval-prompts 4 --cal-prompts 4
    python bench/adaptive_budget.py --render docs/results/adaptive/*.json --readme docs/results.md

Per model it captures (or reuses) an evaluation run (``eval-BENCH``: prompts 0..E−1), a
calibration run for the price λ (``cal-BENCH``: the next C prompts, role calibration) and, for
rankings that need calibration statistics (``sketch-gated``: its surrogate and gate), their own
run (``stats-BENCH``: the C after those; its prompts are in neither the λ calibration nor the
table), replays the first two open loop under ``--rankings`` and the evaluation run under the
oracle, at every budget ``B_min .. B_max`` (B_min: the policy's smallest, 1 under truncation and
k under substitution; B_max = min(N, ``--max-budget``)), both coverage policies, and reads each
tree-layer's RSE, experts loaded, mass excluded and, where a surrogate ranked it, its predicted
RSE at every budget back from the replay results (the metrics' one owner,
replay/open_loop.py). Then per ranking × policy × predictor × mean budget B̄ (every B̄ from
B_min to the largest of ``--means``; the table shows ``--means``, default k, k+2, ..., 16):

* fixed: the ranking's mean RSE at B = B̄ on the evaluation run;
* adaptive: :mod:`policy.adaptive`'s price rule on predicted gains (``--predictors``: ``mass``,
  the mass each shortlist excludes; ``calibrated`` scales it per layer and budget on the
  calibration run; ``surrogate``, the sketch family's own predicted error of its shortlists,
  calibrated mass where it did not run), its price λ calibrated on the calibration run to a mean
  of B̄, applied to the held-out evaluation run; the achieved mean B per tree-layer there, its
  p10 and p90, measured. A stateful ranking (sketch-gated's coact-prior state) reads each
  layer's error at B_l from its fixed-B_l stream: its state there came from fixed-budget passes;
* the ranking's own hindsight: the least error of the ranking's true curves over each pass's
  allocations with total B̄·L (:func:`policy.adaptive.best_budgets`, exact);
* fixed-B oracle: the oracle's mean RSE at B̄; adaptive oracle: the same exact hindsight on the
  oracle's curves, the bound of the adaptive family; the marginal-allocation greedy on those
  curves is kept in the output too (exact only where the curves are convex; the share of
  non-convex oracle curves is reported);
* experts saved at matched error vs router (:func:`matched_savings`): for a target, router's
  fixed error at B (every B of ``--means``; the docs show B = k), the mean experts loaded per
  layer each of fixed, adaptive, fixed-B oracle and adaptive oracle needs to reach it,
  interpolated linearly on its curve over B̄ (x: mean experts loaded, the bytes; error: running
  minimum), as a share of router's experts at that B; and what that is worth in verification
  pass time at the family's real shape on H200 (:func:`pass_time_worth`, analysis/cost.py).

Everything is seeded; captures and replays already on disk are reused. ``--readme`` rewrites
the ``adaptive budgets`` block of docs/results.md from ``--output`` files (``--render``).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import torch

from moe_spec.analysis.results_doc import add_table_options, read_model_outputs, write_block_or_exit
from moe_spec.bench.options import check_benchmarks, check_pacing, study_parser
from moe_spec.bench.pipeline import capture, loaded_model, replay_runs, results_frame
from moe_spec.console import threads
from moe_spec.policy import adaptive, index
from moe_spec.policy.prices import Prices

VERSION = 2  # of the --output layout (2: x_* experts loaded, frontier, savings)
MODELS = ("tiny-olmoe", "tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3")
COVERAGES = ("truncation", "substitution")
BLOCK = "adaptive budgets"
TREE_TOKENS = 63  # tree tokens per verification pass at the real shapes (capture's default)


def default_means(k: int, top: int) -> list[int]:
    """k, k+2, ... up to 16 (16 included), within ``top`` (B_max)."""
    last = min(16, top)
    return sorted({*range(k, last + 1, 2), last} & set(range(k, last + 1)))


CURVE_METRICS = ("rse", "experts_loaded", *dict.fromkeys(
    r for p in adaptive.PREDICTORS.values() for r in p.reads))  # what a cell reads per budget


def curves(df: pl.DataFrame, run: str, ranking: str, coverage: str, b_min: int, b_max: int
           ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """``{metric: [P, L, S+1]}`` of one run's passes (prompt, step) × MoE layers × budgets
    ``b_min .. b_max`` for :data:`CURVE_METRICS` (rse, experts loaded and what the predictors
    read; a null, e.g. ``predicted_rse`` where no surrogate ran, is NaN), the layers ``[L]`` and
    each pass's prompt ``[P]``, from stored replay rows; refuses a grid with a hole (a pass
    without some layer or budget)."""
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
    found = {m: torch.from_numpy(rows[m].cast(pl.Float64).fill_null(float("nan")).to_numpy()
                                 .copy()).view(shape)
             for m in CURVE_METRICS if m in rows.columns}
    prompts = torch.from_numpy(rows["prompt_index"].to_numpy()[:: len(layers) * width].copy())
    return found, torch.tensor(layers), prompts.long()


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


def paced_budgets(predictor: adaptive.Predictor, found: dict, layers: torch.Tensor,
                  prompts: torch.Tensor, price: float, mean: int, b_min: int,
                  pass_cap: float | None, pace: float, pace_over: str = "prompt") -> torch.Tensor:
    """``B [P, L]`` of the paced rule on one run's curves (:func:`curves`), each prompt a
    stream, or the run one (``pace_over``): the product's own
    :meth:`policy.prices.Prices.choose` on the passes' tree-layers in (prompt, step, layer)
    order."""
    passes, count, width = found["rse"].shape
    rule = Prices(predictor, b_min, b_min + width - 1, {mean: price}, layers.tolist(), pass_cap,
                  pace=pace, pace_over=pace_over)
    flat = {r: found[r].reshape(passes * count, width) for r in predictor.reads}
    chosen = rule.choose(flat, layers.repeat(passes), [mean],
                         torch.arange(passes).repeat_interleave(count), {},
                         rule.paced_streams(prompts.repeat_interleave(count)), {})
    return chosen[:, 0].view(passes, count)


def evaluate(cal: dict, ev: dict, ranking: str, means: list[int], b_min: int, predictor: str,
             pass_cap: float | None, pace: float | None = None,
             pace_over: str = "prompt") -> list[dict]:
    """The cells of one ranking and policy: ``cal`` and ``ev`` map ``ranking`` and ``oracle``
    to :func:`curves` of the calibration and the evaluation run (the oracle's calibration curves
    are not read). Every cell also carries the mean experts loaded per tree-layer (``x_*``: the
    frontier's x axis, bytes actually loaded) of each allocation. ``pace``: the adaptive rule
    paced by each prompt's running deficit, or the run's (``pace_over``; :func:`paced_budgets`;
    λ calibrated unpaced)."""
    found_c, layers, _ = cal[ranking]
    found_e, layers_e, prompts_e = ev[ranking]
    if not torch.equal(layers, layers_e):
        raise SystemExit("adaptive_budget.py: the calibration and evaluation runs' layers differ")
    rse_c, rse_e = found_c["rse"], found_e["rse"]
    pred = adaptive.predictor(predictor)
    if any(r not in found_c or r not in found_e or bool(torch.isnan(found_c[r]).all())
           for r in pred.reads if r != adaptive.PREDICTED):
        return []
    if adaptive.PREDICTED in pred.reads and not (
            adaptive.PREDICTED in found_e and bool((~torch.isnan(found_e[adaptive.PREDICTED]))
                                                   .any())):
        return []  # no surrogate ran for this ranking: the predictor has nothing of its own
    pred.fit(found_c, rse_c, layers)
    gains_c, gains_e = pred.gains(found_c, layers), pred.gains(found_e, layers)
    oracle, oracle_loaded = ev["oracle"][0]["rse"], ev["oracle"][0]["experts_loaded"]
    loaded = found_e["experts_loaded"]
    count = len(layers)
    share = (float((~torch.isnan(found_e[adaptive.PREDICTED][..., 0])).double().mean())
             if adaptive.PREDICTED in found_e else 0.0)
    out = []
    for mean in means:
        cap = None if pass_cap is None else round(pass_cap * mean * count)
        price = adaptive.calibrate_price(gains_c, mean, b_min, cap)
        chosen = adaptive.price_budgets(gains_e, price, b_min, cap) if pace is None else \
            paced_budgets(pred, found_e, layers, prompts_e, price, mean, b_min, pass_cap, pace,
                          pace_over)
        on_cal = adaptive.price_budgets(gains_c, price, b_min, cap)
        own = adaptive.best_budgets(rse_e, mean * count, b_min)
        best = adaptive.best_budgets(oracle, mean * count, b_min)
        greedy = adaptive.hindsight_budgets(adaptive.gains_of(oracle), mean * count, b_min)
        at = lambda c, b: float(adaptive.errors_at(c, b, b_min).mean())  # noqa: E731
        fixed = torch.full_like(chosen, mean)
        out.append(dict(
            ranking=ranking, predictor=predictor, mean_budget=mean, pass_cap=cap, pace=pace,
            pace_over=None if pace is None else pace_over, price=price,
            fixed=at(rse_e, fixed), adaptive=at(rse_e, chosen), hindsight=at(rse_e, own),
            oracle_fixed=at(oracle, fixed), oracle_adaptive=at(oracle, best),
            oracle_adaptive_greedy=at(oracle, greedy),
            x_fixed=at(loaded, fixed), x_adaptive=at(loaded, chosen),
            x_oracle_fixed=at(oracle_loaded, fixed), x_oracle_adaptive=at(oracle_loaded, best),
            fixed_at_x=on_curve(rse_e, loaded, at(loaded, chosen)),
            oracle_at_x=on_curve(oracle, oracle_loaded, at(loaded, chosen)),
            surrogate_share=share,
            calibration_mean=float(on_cal.double().mean()), **spread(chosen),
            passes=int(chosen.shape[0]), tree_layers=int(chosen.numel())))
    return out


def on_curve(rse: torch.Tensor, loaded: torch.Tensor, x: float) -> float | None:
    """A fixed budget's mean error at ``x`` mean experts loaded per tree-layer: its points
    (mean experts loaded, mean rse) at every B, linearly interpolated (None outside them): what
    an allocation loading ``x`` is compared with at the same bytes."""
    xs = loaded.double().flatten(0, -2).mean(0)  # [S+1] per B
    es = rse.double().flatten(0, -2).mean(0)
    for j in range(len(xs) - 1):
        x0, x1 = float(xs[j]), float(xs[j + 1])
        if x0 <= x <= x1:
            t = 0.0 if x1 == x0 else (x - x0) / (x1 - x0)
            return float(es[j]) + t * (float(es[j + 1]) - float(es[j]))
    return None


SAVERS = ("fixed", "adaptive", "oracle_fixed", "oracle_adaptive")  # what matched error compares


def needed(points: list[tuple[float, float]], target: float) -> tuple[float | None, bool]:
    """Mean experts per layer a curve needs to reach error ``target``: ``points`` (x = mean
    experts loaded, e = mean rse) sorted by x, the error made non-increasing (running minimum),
    linearly interpolated between the last point above the target and the first at or below it.
    ``(x, False)``; ``(x₀, True)`` where the first point is already at or below the target (x₀ is
    then an upper bound of what it needs); ``(None, False)`` where the curve never reaches it."""
    pts = sorted(points)
    best, run = [], float("inf")
    for x, e in pts:
        run = min(run, e)
        best.append((x, run))
    if not best or best[-1][1] > target:
        return None, False
    if best[0][1] <= target:
        return best[0][0], True
    for (x0, e0), (x1, e1) in zip(best, best[1:]):
        if e1 <= target < e0:
            return x0 + (x1 - x0) * (e0 - target) / (e0 - e1), False
    return None, False  # (unreachable: the last point is at or below the target)


def matched_savings(cells: list[dict], router: list[dict], target_budget: int) -> dict:
    """Experts saved at matched error vs router (the rule): the target is the router's fixed
    error at B = ``target_budget``, reached with ``x_r`` experts loaded per layer; each of
    :data:`SAVERS` needs ``x`` (:func:`needed` on its curve over the cells' B̄), saving
    ``1 − x / x_r``; ``bound`` marks a saving that is a lower bound (its curve starts below the
    target)."""
    at = [c for c in router if c["mean_budget"] == target_budget]
    if not at:
        return {}
    target, x_r = at[0]["fixed"], at[0]["x_fixed"]
    out = dict(target_budget=target_budget, target_rse=target, router_experts=x_r)
    for name in SAVERS:
        x, bound = needed([(c[f"x_{name}"], c[name]) for c in cells], target)
        out[name] = None if x is None else 1 - x / x_r
        out[f"{name}_bound"] = bound
    return out


def pass_time_worth(model: str, k: int, saving: float, router_experts: float,
                    tokens: int, prefix: int = 1024) -> dict:
    """What a saving is worth in verification-pass time at the family's real shape on H200
    (:func:`analysis.cost.pass_time`): router's experts per layer at the tiny model,
    ``router_experts``, scaled to the real k (``× k_real / k``), against ``(1 − saving)`` of it,
    for a pass of ``tokens`` tree tokens after ``prefix`` cached ones."""
    from moe_spec.analysis import cost, frames
    from moe_spec.moe.shapes import REAL_SHAPES
    real = REAL_SHAPES.get(model.removeprefix("tiny-"))
    if real is None:
        return {}
    shape = frames.real_targets()[real.checkpoint]
    hw = cost.PROFILES["H200"]
    base = router_experts * shape.top_k / k
    t0 = cost.pass_time(shape, hw, tokens, prefix, base)[0]
    t1 = cost.pass_time(shape, hw, tokens, prefix, base * (1 - saving))[0]
    return dict(checkpoint=real.checkpoint, experts=base, ms=1e3 * t0, saved=1 - t1 / t0)


def study(root: Path, model: str, args) -> dict:
    """Capture, replay and evaluate one model: its block of the --output file."""
    common = dict(model=model, bench=args.bench, max_new_tokens=args.max_new_tokens,
                  seed=args.seed, benchmarks_root=args.benchmarks)
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
    plain = tuple(r for r in args.rankings if r not in calibrated)
    # the oracle on the evaluation run only: nothing reads its calibration curves
    replay_runs(root, model, [ev_run], **both, rankings=("oracle",))
    if plain:
        replay_runs(root, model, [ev_run, cal_run], **both, rankings=plain)
    if calibrated:
        replay_runs(root, model, [ev_run, cal_run], **both, rankings=calibrated,
                    calibration=(stats_run,))
    df = results_frame(out, model=model, bench=args.bench)
    cells, frontier, savings, nonconvex = [], [], [], {}
    for cov in COVERAGES:
        b_min = index.min_budget(cov, k)
        grid = list(range(b_min, max(means) + 1))  # every B̄: the curves matched error reads
        cal = {r: curves(df, cal_run, r, cov, b_min, b_max) for r in args.rankings}
        ev = {r: curves(df, ev_run, r, cov, b_min, b_max) for r in rankings}
        nonconvex[cov] = nonconvex_share(ev["oracle"][0]["rse"])
        router = None
        for ranking in args.rankings:
            for predictor in args.predictors:
                for pace, over in [(None, None)] + ([(args.pace, o) for o in args.pace_over]
                                                    if args.pace is not None else []):
                    found = [dict(coverage=cov, b_min=b_min, statistics=(
                        stats_run if ranking in calibrated else None), **c) for c in evaluate(
                        cal, ev, ranking, grid if pace is None else means, b_min, predictor,
                        args.pass_cap, pace, over or "prompt")]
                    cells += [c for c in found if c["mean_budget"] in means]
                    if pace is not None or not found:
                        continue  # the frontier and savings: the unpaced rule's
                    if ranking == "router" and router is None:
                        router = found
                    frontier += found
        for ranking in args.rankings:
            for predictor in args.predictors:
                mine = [c for c in frontier if (c["coverage"], c["ranking"], c["predictor"])
                        == (cov, ranking, predictor)]
                if not mine or router is None:
                    continue
                for target in means:
                    saved = matched_savings(mine, router, target)
                    if saved:
                        worth = {f"{name}_worth": pass_time_worth(
                            model, k, saved[name], saved["router_experts"], TREE_TOKENS)
                            if saved[name] is not None else None for name in SAVERS}
                        savings.append(dict(coverage=cov, ranking=ranking, predictor=predictor,
                                            **saved, **worth))
    return dict(k=k, n=n, b_max=b_max, means=means, layers=len(ev[rankings[0]][1]),
                pace=args.pace, pace_over=args.pace_over if args.pace is not None else None,
                eval_prompts=args.eval_prompts, cal_prompts=args.cal_prompts, bench=args.bench,
                nonconvex_oracle_curves=nonconvex, cells=cells, frontier=frontier,
                savings=savings)


def within(cell: dict, tolerance: float = 0.02) -> bool:
    """The achieved mean on the held-out prompts within ``tolerance`` of B̄ (relative)."""
    return abs(cell["achieved"] - cell["mean_budget"]) <= tolerance * cell["mean_budget"]


def below(a: float, b: float, rel: float = 1e-9) -> bool:
    """``a`` lower than ``b`` beyond rounding (means of the same numbers summed in another order
    differ in the 16th digit)."""
    return a < b - rel * abs(b)


def opt(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def fmt_saving(row: dict, name: str) -> str:
    value = row.get(name)
    if value is None:
        return "–"
    worth = row.get(f"{name}_worth") or {}
    text = f"{'≥ ' if row.get(f'{name}_bound') else ''}{round(100 * value)}%"
    return text + (f" ({round(100 * worth['saved'], 1) + 0:.1f}%)" if worth else "")


def savings_table(report: dict) -> tuple[list[str], dict]:
    """The matched-error table (targets: router's error at B = k and at the largest B̄) and,
    per ranking · predictor, how many rows its adaptive saving is ≥ 1.5× the fixed-B oracle's
    (rows where the oracle's saving is measured, not a bound, and above 0)."""
    columns: list[tuple[str, str | None, str]] = [("", None, "oracle_fixed"),
                                                  ("", None, "oracle_adaptive")]
    for found in report.values():
        for row in found.get("savings", []):
            if row["ranking"] != "router" and ("fixed", row["ranking"], "") not in columns:
                columns.append(("fixed", row["ranking"], ""))
            key = ("adaptive", row["ranking"], row["predictor"])
            if key not in columns:
                columns.append(key)
    names = [("fixed-B oracle" if f == "oracle_fixed" else "adaptive oracle") if not kind else
             (f"{r}, fixed" if kind == "fixed" else f"{r} · {f}") for kind, r, f in columns]
    out = ["", "Experts saved at matched error vs router: the share of router's experts per "
           "layer at B each allocation needs for router's error there (in brackets: the "
           "verification pass time that saves at the family's real shape on H200; ≥: its curve "
           "starts at or below the target, so the saving is at least that; –: never reached):",
           "", "| model | policy | target: router at B (rse, experts) | " + " | ".join(names)
           + " |", "|---|---|---|" + "---|" * len(names)]
    wins: dict[tuple, list[int]] = {}
    for model, found in report.items():
        rows = found.get("savings", [])
        targets = sorted({r["target_budget"] for r in rows})
        for cov in COVERAGES:
            for target in [t for t in targets if t in (found["k"], targets[-1])]:
                at = [r for r in rows if (r["coverage"], r["target_budget"]) == (cov, target)]
                if not at:
                    continue
                cells = []
                for kind, ranking, what in columns:
                    if not kind:
                        cells.append(fmt_saving(at[0], what))
                        continue
                    mine = [r for r in at if r["ranking"] == ranking and
                            (kind == "fixed" or r["predictor"] == what)]
                    cells.append(fmt_saving(mine[0], kind) if mine else "")
                    if kind == "adaptive" and mine:
                        r = mine[0]
                        if r["oracle_fixed"] is not None and not r["oracle_fixed_bound"] \
                                and r["oracle_fixed"] > 0:
                            w = wins.setdefault((ranking, what), [0, 0])
                            w[0] += 1
                            w[1] += r["adaptive"] is not None and \
                                r["adaptive"] >= 1.5 * r["oracle_fixed"]
                out.append(f"| {model} | {cov} | B = {target} ({at[0]['target_rse']:.4f}, "
                           f"{at[0]['router_experts']:.2f}) | " + " | ".join(cells) + " |")
    return out, wins


def markdown(report: dict) -> str:
    """The docs' table and goal counts, from the --output files alone."""
    lines = ["| model | policy | ranking · predictor | B̄ | fixed | adaptive | hindsight, same "
             "ranking | fixed-B oracle | adaptive oracle | achieved B̄ on held-out (p10–p90 per "
             "tree-layer) | experts loaded: adaptive (fixed at B̄) | fixed, at adaptive's "
             "experts | fixed-B oracle, at adaptive's experts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    goals: dict[tuple, list[int]] = {}
    for model, found in report.items():
        for c in found["cells"]:
            paced = "" if c.get("pace") is None else f", paced η {c['pace']:g}" + (
                " over the run" if c.get("pace_over") == "run" else "")
            key = (c["ranking"], c["predictor"] + paced)
            g = goals.setdefault(key, [0, 0, 0, 0, 0, 0, 0, 0])
            g[0] += 1
            g[1] += below(c["adaptive"], c["fixed"])
            g[2] += not below(c["adaptive"], c["fixed"]) and not below(c["fixed"], c["adaptive"])
            g[3] += below(c["adaptive"], c["oracle_fixed"])
            g[4] += within(c)
            g[5] += c["fixed_at_x"] is not None and below(c["adaptive"], c["fixed_at_x"])
            g[6] += c["oracle_at_x"] is not None and below(c["adaptive"], c["oracle_at_x"])
            g[7] += c["fixed_at_x"] is not None
            cap = f", cap {c['pass_cap']}" if c["pass_cap"] is not None else ""
            lines.append(
                f"| {model} | {c['coverage']} | {c['ranking']} · {c['predictor']}{cap}{paced} | "
                f"{c['mean_budget']} | {c['fixed']:.4f} | {c['adaptive']:.4f} | "
                f"{c['hindsight']:.4f} | {c['oracle_fixed']:.4f} | {c['oracle_adaptive']:.4f} | "
                f"{c['achieved']:.2f} ({c['p10']:.0f}–{c['p90']:.0f}) | "
                f"{c['x_adaptive']:.2f} ({c['x_fixed']:.2f}) | {opt(c['fixed_at_x'])} | "
                f"{opt(c['oracle_at_x'])} |")
    head = []
    for model, found in report.items():
        share = ", ".join(f"{cov} {100 * v:.0f}%"
                          for cov, v in found["nonconvex_oracle_curves"].items())
        head.append(f"- {model}: {found['eval_prompts']} evaluation and {found['cal_prompts']} "
                    f"calibration prompts of {found['bench']}, k = {found['k']} of N = "
                    f"{found['n']}, B per tree-layer within [B_min, {found['b_max']}], "
                    f"{found['cells'][0]['passes']} held-out passes × {found['layers']} layers; "
                    f"oracle curves not convex (greedy not guaranteed exact): {share}")
    for (ranking, predictor), (cells, lower, tied, below_oracle, near, lower_x, oracle_x,
                               measured) in goals.items():
        head.append(f"- {ranking} · {predictor}: adaptive below fixed in {lower} of {cells} "
                    f"cells (equal in {tied}), below the fixed-B oracle in {below_oracle} of "
                    f"{cells}; at the same mean experts loaded (fixed's curve interpolated at "
                    f"adaptive's), below fixed in {lower_x} and below the fixed-B oracle in "
                    f"{oracle_x} of {measured}; achieved mean within 2% of B̄ on held-out "
                    f"prompts in {near} of {cells}")
    saved, wins = savings_table(report)
    for (ranking, predictor), (rows, won) in wins.items():
        head.append(f"- {ranking} · {predictor}: experts saved at matched error ≥ 1.5× the "
                    f"fixed-B oracle's in {won} of {rows} (model, policy, target) rows with a "
                    "measured oracle saving above 0")
    return "\n".join(head + saved + [""] + lines)


def main(argv: list[str] | None = None) -> None:
    p = study_parser(__doc__)
    p.add_argument("--models", nargs="+", default=["tiny-olmoe"],
                   help=f"default tiny-olmoe; issue 63's families: {', '.join(MODELS)}")
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
    p.add_argument("--pace", type=float, default=None,
                   help="also the adaptive rule paced by each prompt's running deficit "
                        "(replay --pace; η > 0), as cells of their own (default: unpaced only)")
    p.add_argument("--pace-over", nargs="+", default=["prompt"], choices=list(index.PACE_SCOPES),
                   help="paced: whose deficit, each scope its own cells (replay --pace-over; "
                        "default: prompt)")
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
                   or not index.RANKINGS[r].runtime]
        if offline:
            p.error(f"--rankings {' '.join(offline)}: this study evaluates runtime rankings "
                    "only (router, sqmass, coact, sketch-gated, ...)")
        if args.pass_cap is not None and args.pass_cap < 1:
            p.error("--pass-cap must be at least 1 (a pass may always load B̄ per layer)")
        check_pacing(p, args.pace, args.pace_over)
        check_benchmarks(p, args)
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
