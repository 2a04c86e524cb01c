"""Adaptive budgets in closed loop at B̄ = k (issue 63's last goal): accepted length under the
price rule vs a fixed B = B̄ on the same trees, with paired 95% intervals and the power size.

    python bench/adaptive_closed.py --traces /tmp/adaptive/traces --output ac.json
    python bench/adaptive_closed.py --models tiny-gpt-oss --eval-prompts 120 --means k 16
    python bench/adaptive_closed.py --models tiny-olmoe --cal-prompts 64 --same-spend
    python bench/adaptive_closed.py --ranking sketch-gated --predictor surrogate --pace 0.5
    python bench/adaptive_closed.py --render docs/results/adaptive-closed/*.json --readme docs/results.md

Per model it captures (or reuses) an evaluation run (``eval-BENCH``: prompts 0..E−1) and a
calibration run (``cal-BENCH``: the next C prompts, role calibration; replay refuses a
calibration run that shares a prompt with the evaluated one), then re-verifies every tree of the
evaluation run in closed loop (``replay --mode closed``) under ``--ranking`` and both coverage
policies at each mean budget B̄ (``--means``, default k):

* fixed: B = B̄ at every layer of every pass;
* adaptive: ``--budget-mode adaptive --gain-predictor P`` at B̄, its price λ calibrated on the
  calibration run (:mod:`policy.prices`), so the evaluation trees are held out from it; with
  ``--pace η`` paced by each prompt's running deficit (``replay --pace``), or with
  ``--pace-over run`` by the run's, carried from prompt to prompt.

``--ranking`` may be any runtime ranking that ranks every budget at once, stateful ones too
(sketch-gated, coact-prior: one state per setting and B̄, fed what its own passes executed,
restarted at each prompt); ``--predictor surrogate`` prices sketch-gated by its surrogate's
predicted error. The calibration run fits both the ranking's statistics and λ.

Per cell (model × policy × B̄) it reports the mean accepted length τ (drafts + bonus) and mean
KL(p ‖ p^B) of both, the paired difference Δ = adaptive − fixed per tree with its 95% paired t
interval (:func:`analysis.power.paired_interval`: the same trees, so what makes a tree hard
cancels), the experts loaded per layer on the held-out trees (``experts_loaded``: those a tree
token routes to, so at most the layer's B; mean, and p10–p90 over tree-layers for adaptive;
within 2% of B̄ or not), and the power analysis (:mod:`analysis.power`,
α = 0.05, power 0.8, from the spread of Δ): the trees needed to detect a 0.1-token difference,
and the observed one, and whether the sample reached the former.

``--same-spend`` separates allocation from spend: the held-out mean load a of the adaptive rule
misses B̄ by a few percent, and more experts alone raise τ. It also replays fixed B_lo = ⌊a⌋ and
the first B_hi whose load reaches a, and compares adaptive per tree with the mix of the two
that loads a on average (:func:`same_spend`).

The goal, per cell: accepted length ≥ fixed-B's, i.e. the interval excludes a loss (low ≥ 0),
at the power size (trees ≥ trees needed for 0.1 tokens). Trees of one prompt are treated as
independent (steps of one prompt are correlated, so the interval is optimistic, as the
bootstrap over trees of bench/closed_loop.py is; the JSON's ``delta_tau_by_prompt`` is the
same interval over the prompts' mean Δ, which does not assume it). Captures are seeded (``--seed``); replay is
deterministic; captures and replays already on disk are reused.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import polars as pl

from moe_spec.analysis import power
from moe_spec.analysis.results_doc import add_table_options, read_model_outputs, write_block_or_exit
from moe_spec.bench.options import check_benchmarks, check_pacing, study_parser
from moe_spec.console import pipes, threads
from moe_spec.errors import fail
from moe_spec.policy import index

VERSION = 1  # of the --output layout
SCRIPT = "adaptive_closed.py"
TOOL = f"bench/{SCRIPT}"  # the --output's "tool": another bench's file is refused
MODELS = ("tiny-olmoe", "tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3")
COVERAGES = ("truncation", "substitution")
BLOCK = "adaptive closed loop"
TREE = ("prompt_index", "step")  # a tree of the evaluation run: the pairing key
WITHIN = 0.02  # the achieved mean experts per layer within 2% of B̄


def means_for(spec: list[str], k: int, n: int) -> list[int]:
    """``--means`` (``k`` or whole numbers) for a model with top-k ``k`` of ``n`` experts."""
    out = sorted({k if m == "k" else int(m) for m in spec})
    if out[0] < 1 or out[-1] > n:
        raise SystemExit(fail(SCRIPT, f"--means {' '.join(spec)} must lie within "
                                      f"1..N = {n}"))
    return out


def one_setting(df: pl.DataFrame, budget_mode: str, coverage: str, mean: int) -> pl.DataFrame:
    """One setting's rows, one per tree; refuses a tree replayed twice (two stored variants of
    the setting: replay into a fresh --traces folder)."""
    rows = df.filter((pl.col("budget_mode") == budget_mode) & (pl.col("coverage") == coverage)
                     & (pl.col("budget") == mean))
    if rows.height != rows.select(*TREE).unique().height:
        raise SystemExit(fail(SCRIPT, f"{budget_mode} · {coverage} · B̄ {mean}: a tree "
                                      "has two stored results (two variants); use a fresh "
                                      "--traces"))
    return rows


def _by_prompt(prompts: pl.Series, delta: np.ndarray) -> np.ndarray:
    """Each prompt's mean Δ over its trees, prompts in order of first appearance (a fixed
    order, so the interval over them is the same to the last bit on every run)."""
    return pl.DataFrame(dict(prompt=prompts, delta=delta)).group_by(
        "prompt", maintain_order=True).agg(pl.col("delta").mean())["delta"].to_numpy()


def compare(fixed: pl.DataFrame, adaptive: pl.DataFrame, mean: int) -> dict:
    """One cell from the two settings' per-tree rows (closed-loop columns ``accepted_length``,
    ``mean_kl``, ``experts_loaded`` per MoE layer), paired by tree; refuses settings that did not
    replay the same trees."""
    both = fixed.join(adaptive, on=list(TREE), how="inner", suffix="_adaptive")
    if not (both.height == fixed.height == adaptive.height):
        raise SystemExit(fail(SCRIPT, f"fixed ({fixed.height} trees) and adaptive "
                                      f"({adaptive.height}) did not replay the same trees; "
                                      "replay them again"))
    tau = both["accepted_length"].cast(pl.Float64).to_numpy()
    tau_a = both["accepted_length_adaptive"].cast(pl.Float64).to_numpy()
    kl, kl_a = both["mean_kl"].to_numpy(), both["mean_kl_adaptive"].to_numpy()
    delta = tau_a - tau
    loaded = _loads(both["experts_loaded_adaptive"])
    loaded_fixed = _loads(both["experts_loaded"])
    interval = power.paired_interval(delta)
    by_prompt = _by_prompt(both["prompt_index"], delta)
    observed = abs(float(delta.mean())) if len(delta) else 0.0
    needed = power.trees_needed(delta)
    return dict(
        mean_budget=mean, trees=both.height,
        tau_fixed=float(tau.mean()), tau_adaptive=float(tau_a.mean()),
        delta_tau=interval, delta_kl=power.paired_interval(kl_a - kl),
        # a check of the tree-independence the interval assumes: prompts' mean Δ as the units
        delta_tau_by_prompt=power.paired_interval(by_prompt), prompts=len(by_prompt),
        kl_fixed=float(kl.mean()), kl_adaptive=float(kl_a.mean()),
        trees_unchanged=int((delta == 0).sum()),
        achieved=float(loaded.mean()), achieved_fixed=float(loaded_fixed.mean()),
        p10=float(np.quantile(loaded, 0.1)), p90=float(np.quantile(loaded, 0.9)),
        price=(None if both["price_adaptive"].is_null().all()
               else float(both["price_adaptive"].drop_nulls()[0])),
        trees_needed=needed,  # to detect a 0.1-token difference (power.EFFECT)
        trees_needed_observed=(power.trees_needed(delta, observed) if observed > 0 else None),
        resolvable=power.resolvable(delta))


def _loads(column: pl.Series) -> np.ndarray:
    """Experts loaded per tree-layer, flat, from a per-tree ``experts_loaded`` column (a list
    per MoE layer)."""
    return np.concatenate([np.asarray(x, dtype=float) for x in column.to_list()])


def _loaded(rows: pl.DataFrame) -> float:
    """Mean experts loaded per tree-layer of a setting's rows."""
    return float(_loads(rows["experts_loaded"]).mean())


def same_spend(adaptive: pl.DataFrame, low: pl.DataFrame, high: pl.DataFrame) -> dict:
    """Adaptive against fixed budgets at adaptive's own spend: ``low`` and ``high`` are the
    per-tree rows of fixed B_lo and B_hi whose mean experts loaded L_lo ≤ a ≤ L_hi bracket the
    adaptive rows' a. The reference is the mix that loads a on average, each pass at B_hi with
    probability w = (a − L_lo) / (L_hi − L_lo) and at B_lo otherwise; its expected τ on a tree
    is (1 − w)·τ_lo + w·τ_hi, so per tree Δ = τ_adaptive − ((1 − w)·τ_lo + w·τ_hi) (KL alike),
    paired over the same trees (95% paired t; over prompts' mean Δ as well). A fixed budget
    that spends what adaptive spends, achievable at run time, so a gain here is allocation,
    not spend."""
    a, lo, hi = _loaded(adaptive), _loaded(low), _loaded(high)
    if not lo <= a <= hi or hi <= lo and a != lo:
        raise SystemExit(fail(SCRIPT, f"fixed loads {lo:.3f} and {hi:.3f} do not bracket "
                                      f"adaptive's {a:.3f}"))
    w = 0.0 if hi == lo else (a - lo) / (hi - lo)
    cols = ["accepted_length", "mean_kl"]
    both = adaptive.select(*TREE, *cols).join(
        low.select(*TREE, *cols), on=list(TREE), suffix="_lo").join(
        high.select(*TREE, *cols), on=list(TREE), suffix="_hi")
    if not both.height == adaptive.height == low.height == high.height:
        raise SystemExit(fail(SCRIPT, "the fixed and adaptive settings did not replay the same "
                                      "trees; replay them again"))

    def mix(col: str) -> np.ndarray:
        return ((1 - w) * both[f"{col}_lo"].cast(pl.Float64)
                + w * both[f"{col}_hi"].cast(pl.Float64)).to_numpy()

    def delta(col: str) -> np.ndarray:
        return both[col].cast(pl.Float64).to_numpy() - mix(col)

    d_tau = delta("accepted_length")
    by_prompt = _by_prompt(both["prompt_index"], d_tau)
    return dict(budgets=[int(low["budget"][0]), int(high["budget"][0])], weight=w,
                loaded=[lo, hi], tau_fixed=float(mix("accepted_length").mean()),
                delta_tau=power.paired_interval(d_tau), delta_kl=power.paired_interval(
                    delta("mean_kl")), delta_tau_by_prompt=power.paired_interval(by_prompt))


def spend_budgets(achieved: float, loaded_at) -> tuple[int, int]:
    """The consecutive fixed budgets B_lo = ⌊a⌋ (loads ≤ B ≤ a) and the first B_hi above it
    whose mean load ``loaded_at(B)`` reaches a (under truncation a fixed B loads ≤ B)."""
    low = max(1, int(np.floor(achieved)))
    high = low + 1
    while loaded_at(high) < achieved:
        high += 1
    return low, high


def report_key(model: str, args) -> str:
    """One model's key in the --output file: ``model@E+C`` (evaluation and λ calibration
    prompts), with ``:ranking·predictor`` (and ``+cap F``, ``+pace η[-run]``) unless router ·
    mass unpaced and uncapped (so files of one model and sizes under other rules render side by
    side)."""
    key = f"{model}@{args.eval_prompts}+{args.cal_prompts}"
    rule = f"{args.ranking}·{args.predictor}" + (
        "" if args.pass_cap is None else f"+cap{args.pass_cap:g}") + (
        "" if args.pace is None else f"+pace{args.pace:g}" + (
            "-run" if args.pace_over == "run" else ""))
    return key if rule == "router·mass" else f"{key}:{rule}"


def within(cell: dict, tolerance: float = WITHIN) -> bool:
    """The achieved mean experts per layer within ``tolerance`` of B̄ (relative)."""
    return abs(cell["achieved"] - cell["mean_budget"]) <= tolerance * cell["mean_budget"]


def verdict(cell: dict) -> str:
    """``met``: the interval of Δτ excludes a loss (low ≥ 0) and the trees reach the power size
    for 0.1 tokens; ``underpowered``: no loss, too few trees; ``loss``: the whole interval below
    zero; ``undecided``: it holds zero and a loss."""
    d = cell["delta_tau"]
    if d is None:
        return "undecided"
    if d[2] < 0:
        return "loss"
    if d[1] < 0:
        return "undecided"
    powered = cell["trees_needed"] is not None and cell["trees"] >= cell["trees_needed"]
    return "met" if powered else "underpowered"


def study(root: Path, model: str, args) -> dict:
    """Capture (or reuse), replay closed loop fixed and adaptive, and compare one model: its
    block of the --output file."""
    from moe_spec.bench.pipeline import capture, loaded_model, replay_runs
    _, adapter = loaded_model(model)
    k, n = adapter.top_k, adapter.num_experts
    means = means_for(args.means, k, n)
    common = dict(model=model, bench=args.bench, max_new_tokens=args.max_new_tokens,
                  seed=args.seed, benchmarks_root=args.benchmarks)
    ev_run, cal_run = f"eval-{args.bench}", f"cal-{args.bench}"
    capture(root, ev_run, **common, limit=args.eval_prompts)
    capture(root, cal_run, role="calibration", **common, offset=args.eval_prompts,
            limit=args.cal_prompts)
    out = root / "results" / "adaptive-closed"
    mode = index.budget_mode(args.predictor, args.pass_cap is not None,
                             None if args.pace is None else args.pace_over)
    for budget_mode in (index.FIXED, mode):
        replay_runs(root, model, [ev_run], bench=args.bench, mode="closed",
                    rankings=(args.ranking,), coverages=tuple(args.coverages),
                    budgets=",".join(map(str, means)), out=out, calibration=(cal_run,),
                    budget_mode=budget_mode,
                    pass_cap=None if budget_mode == index.FIXED else args.pass_cap,
                    pace=None if budget_mode == index.FIXED else args.pace)
    df = closed_results(out, model, ev_run, args)
    cells = []
    for cov in args.coverages:
        for mean in means:
            adaptive = one_setting(df, mode, cov, mean)
            cell = compare(one_setting(df, index.FIXED, cov, mean), adaptive, mean)
            if args.same_spend:
                cell["same_spend"] = at_adaptive_spend(root, model, ev_run, cal_run, cov,
                                                       adaptive, out, args)
            cells.append(dict(coverage=cov, b_min=index.min_budget(cov, k), **cell))
    return dict(model=model, k=k, n=n, means=means, bench=args.bench, ranking=args.ranking,
                budget_mode=mode, pass_cap=args.pass_cap, pace=args.pace,
                eval_prompts=args.eval_prompts,
                cal_prompts=args.cal_prompts, max_new_tokens=args.max_new_tokens,
                seed=args.seed, cells=cells)


def closed_results(out: Path, model: str, ev_run: str, args) -> pl.DataFrame:
    """The evaluation run's closed-loop rows under ``--ranking`` (stored rows without a budget
    mode read as fixed)."""
    from moe_spec.bench.pipeline import results_frame
    return results_frame(out, "replay_closed", model=model, bench=args.bench).filter(
        (pl.col("run") == ev_run) & (pl.col("ranking") == args.ranking)).with_columns(
        pl.col("budget_mode").fill_null(index.FIXED))


def at_adaptive_spend(root: Path, model: str, ev_run: str, cal_run: str, coverage: str,
                      adaptive: pl.DataFrame, out: Path, args) -> dict:
    """:func:`same_spend` for one cell: fixed B_lo and B_hi replayed in closed loop on the
    evaluation trees (reused when stored) and compared at adaptive's mean load."""
    from moe_spec.bench.pipeline import replay_runs

    @functools.cache
    def fixed_at(budget: int) -> pl.DataFrame:
        replay_runs(root, model, [ev_run], bench=args.bench, mode="closed",
                    rankings=(args.ranking,), coverages=(coverage,), budgets=str(budget),
                    out=out, calibration=(cal_run,))
        return one_setting(closed_results(out, model, ev_run, args), index.FIXED, coverage,
                           budget)

    low, high = spend_budgets(_loaded(adaptive), lambda b: _loaded(fixed_at(b)))
    return same_spend(adaptive, fixed_at(low), fixed_at(high))


def _interval(d, digits: int = 2) -> str:
    return "–" if d is None else f"{d[0]:+.{digits}f} [{d[1]:+.{digits}f}, {d[2]:+.{digits}f}]"


def _spend(found: dict | None) -> str:
    """The same-spend comparison's cell: the fixed budgets mixed (B_hi's share) and Δτ."""
    if found is None:
        return "–"
    low, high = found["budgets"]
    return f"{low}/{high} ({found['weight']:.2f}): {_interval(found['delta_tau'])}"


def rule_of(found: dict) -> str:
    """A model block's rule in words: ranking · budget mode, with its cap and pace."""
    cap, pace = found.get("pass_cap"), found.get("pace")
    extra = ([] if cap is None else [f"cap {cap:g}"]) + ([] if pace is None else [f"η {pace:g}"])
    return f"{found['ranking']} · {found['budget_mode']}" + (f" ({', '.join(extra)})"
                                                             if extra else "")


def markdown(report: dict) -> str:
    """The docs' table and the goal count, from the --output files alone."""
    lines = ["| model | ranking · rule | policy | B̄ | prompts: evaluation · λ | trees | τ fixed | "
             "τ adaptive | "
             "Δτ [95% CI] | Δτ vs fixed at adaptive's spend: B mix [95% CI] | trees same τ | "
             "KL fixed | KL adaptive | experts loaded/layer: fixed · adaptive (p10–p90) | "
             "adaptive within 2% of B̄ | trees needed: 0.1, observed Δ | goal |",
             "|---" * 17 + "|"]
    head, tally = [], {}
    for found in report.values():
        model = found["model"]
        head.append(f"- {model}: {rule_of(found)}, "
                    f"{found['eval_prompts']} evaluation prompts of {found['bench']} (λ "
                    f"calibrated on the {found['cal_prompts']} after them), "
                    f"{found['max_new_tokens']} new tokens, k = {found['k']} of N = {found['n']}")
        for c in found["cells"]:
            v = verdict(c)
            tally[v] = tally.get(v, 0) + 1
            obs = c["trees_needed_observed"]
            lines.append(
                f"| {model} | {rule_of(found)} | {c['coverage']} | "
                f"{c['mean_budget']} | "
                f"{found['eval_prompts']} · {found['cal_prompts']} | {c['trees']} | "
                f"{c['tau_fixed']:.2f} | {c['tau_adaptive']:.2f} | {_interval(c['delta_tau'])} | "
                f"{_spend(c.get('same_spend'))} | "
                f"{c['trees_unchanged']} | {c['kl_fixed']:.4f} | {c['kl_adaptive']:.4f} | "
                f"{c['achieved_fixed']:.2f} · {c['achieved']:.2f} ({c['p10']:.0f}–{c['p90']:.0f}) | "
                f"{'yes' if within(c) else 'no'} | {c['trees_needed'] or '–'}, "
                f"{'–' if obs is None else obs} | {v} |")
    cells = sum(tally.values())
    head.append(f"- goal (Δτ interval excludes a loss, at the trees needed for 0.1 tokens): met "
                f"in {tally.get('met', 0)} of {cells} cells; no loss but underpowered "
                f"{tally.get('underpowered', 0)}, undecided {tally.get('undecided', 0)}, loss "
                f"{tally.get('loss', 0)}; interval: paired t over trees, 95%; power: α = 0.05, "
                f"power 0.8 (analysis/power.py)")
    return "\n".join(head + [""] + lines)


@pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> None:
    p = study_parser(__doc__)
    p.add_argument("--models", nargs="+", default=list(MODELS),
                   help=f"default: {' '.join(MODELS)}")
    p.add_argument("--ranking", default="router",
                   help="the ranking of both settings (default router; a runtime one; a stateful one "
                        "keeps one state per setting and B̄, reset at each prompt)")
    p.add_argument("--predictor", default="mass", choices=list(index.GAIN_PREDICTORS),
                   help="the adaptive rule's predicted gain (default mass)")
    p.add_argument("--means", nargs="+", default=["k"],
                   help="mean budgets B̄: k (the model's top-k) and/or whole numbers, e.g. "
                        "--means k 16 (default k)")
    p.add_argument("--coverages", nargs="+", default=list(COVERAGES), choices=COVERAGES,
                   help="coverage policies (default both; at B̄ = k substitution has nothing to "
                        "adapt: B_min = k)")
    p.add_argument("--pass-cap", type=float, default=None,
                   help="hard cap on a pass's experts, as a multiple of B̄·L, above 1 "
                        "(default: none)")
    p.add_argument("--pace", type=float, default=None,
                   help="pace the adaptive rule's price by each prompt's running deficit "
                        "(replay --pace; η > 0; default: unpaced)")
    p.add_argument("--pace-over", default="prompt", choices=list(index.PACE_SCOPES),
                   help="paced: whose deficit, each prompt's or the run's (replay --pace-over; "
                        "default: prompt)")
    p.add_argument("--same-spend", action="store_true",
                   help="also replay the fixed budgets around adaptive's mean load and compare "
                        "at its spend (a mix of the two; see same_spend)")
    p.add_argument("--eval-prompts", type=int, default=8, help="default 8")
    p.add_argument("--cal-prompts", type=int, default=8, help="default 8")
    p.add_argument("--max-new-tokens", type=int, default=32, help="default 32")
    p.add_argument("--seed", type=int, default=0, help="capture seed (default 0)")
    p.add_argument("--output", type=Path, default=None, help="write every cell as JSON")
    threads.add_argument(p)
    add_table_options(p, BLOCK)
    args = p.parse_args(argv)
    if args.render:
        report = read_model_outputs(args.render, SCRIPT, VERSION, TOOL)
    else:
        entry = index.RANKINGS.get(args.ranking)
        if entry is None or not entry.runtime or not index.adapts(args.ranking, executes=True):
            p.error(f"--ranking {args.ranking}: pick a runtime ranking that ranks every budget "
                    "at once (router, sqmass, coact-prior, sketch-gated, ...)")
        bad = [m for m in args.means if m != "k" and not m.isdigit()]
        if bad:
            p.error(f"--means {' '.join(bad)}: give k or whole numbers")
        if args.pass_cap is not None and not args.pass_cap > 1:
            p.error(f"--pass-cap {args.pass_cap:g} must be above 1")
        check_pacing(p, args.pace, [args.pace_over])
        if args.eval_prompts < 2 or args.cal_prompts < 1:
            p.error("--eval-prompts needs at least 2 (an interval) and --cal-prompts 1")
        check_benchmarks(p, args)
        threads.apply(args.threads)
        # keyed by model and sample sizes (evaluation + λ calibration prompts): several files
        # of one model render side by side (files written before the λ size was in the key
        # hold "model@eval", λ on 8)
        report = {report_key(m, args): study(args.traces / m, m, args) for m in args.models}
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(dict(
                version=VERSION, tool=TOOL, models=report), indent=1))
    table = markdown(report)
    print(table)
    for readme in write_block_or_exit(args.readme, table, args.block, SCRIPT):
        print(f"wrote the table into {readme}")


if __name__ == "__main__":
    main()
