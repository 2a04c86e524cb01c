"""``replay``: re-run captured MoE layers under expert budgets and record what they cost.

The parser imports nothing heavy, so ``--help`` appears at once; the runs, calibration runs and
options are checked before torch loads, and a replay whose every cell is stored already is
answered from the stored results without loading the model.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moe_spec import console
from moe_spec.catalog import ROLES, location
from moe_spec.catalog.replay_metrics import gap_closed
from moe_spec.errors import UserError, fail
from moe_spec.policy import index
from moe_spec.replay import modes

EXAMPLES = """
replay --ranking oracle --budget 24
replay --ranking router oracle --budget 8:56:8 --coverage substitution
replay --ranking static router oracle coact --budget sweep --calibration cal
replay --mode closed --ranking router --budget 16,32,48 --threads 4
replay --mode closed --ranking router sqmass --budget 16,32 --batch-size 8   # one shortlist per pass
replay --config sweep.toml --output summary.csv     # every summary row (.json, .csv, .parquet)
replay --ranking router --budget 4,8,16 --budget-mode adaptive --calibration cal   # mean budgets B̄
replay --mode closed --ranking router --budget 8 --budget-mode adaptive --pass-cap 1.25 --calibration cal
replay --mode closed --ranking sketch-gated --budget 4 --budget-mode adaptive --pace 0.5 --calibration cal
replay --ranking router --budget 8 --budget-mode adaptive --pace 0.5 --pace-over run --calibration cal
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
    p.add_config_option('ranking = ["router", "oracle"], budget = "8,16,24"')
    p.add_argument("--traces", default="traces",
                   help="captured traces root: a folder or s3://bucket/prefix")
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
                   help="24, a list 8,16,32, a range 8:56:8 or sweep (the paper's grid for N); "
                        "with --budget-mode adaptive: mean budgets B̄ per layer")
    p.add_argument("--budget-mode", default=index.FIXED, choices=(index.FIXED, index.ADAPTIVE),
                   help="fixed: B experts at every layer of every pass; adaptive: each layer "
                        "gets its own B in [B_min, N] (B_min: 1 under truncation, k under "
                        "substitution), loading the ranking's next expert while its predicted "
                        "gain exceeds a price λ calibrated on --calibration (needed) so the "
                        "mean over its tree-layers is B̄; results keyed budget_mode "
                        "adaptive:<predictor>[+cap], the rows' budget is B̄, experts_loaded what "
                        "was loaded (default: %(default)s)")
    p.add_argument("--gain-predictor", default=None, choices=tuple(index.GAIN_PREDICTORS),
                   help="adaptive: what predicts the next expert's gain, from the router mass "
                        "each shortlist excludes: "
                        + "; ".join(f"{n}: {d}" for n, d in index.GAIN_PREDICTORS.items())
                        + " (default: mass)")
    p.add_argument("--pass-cap", type=float, default=None, metavar="F",
                   help="adaptive: a hard cap on each verification pass's total, F·B̄·L experts "
                        "(F > 1; layers in order, later ones keep B_min; default: no cap)")
    p.add_argument("--pace", type=float, default=None, metavar="ETA",
                   help="adaptive: pace the price by each prompt's running deficit, "
                        "λ·exp(η·D/B̄) with D = Σ (B_l − B̄) over its tree-layers so far, so "
                        "prompts unlike the calibration's still average B̄ (η > 0; e.g. 0.5; "
                        "default: unpaced)")
    p.add_argument("--pace-over", choices=list(index.PACE_SCOPES), default=None,
                   help="adaptive, paced: whose deficit: each prompt's, restarted with it, or "
                        "the run's, carried from prompt to prompt in the run's order as a "
                        "server's spend would be (budget mode +pace-run; the mean then misses "
                        "B̄ by a share ln(λ*/λ)/(η·T), T the run's tree-layers, not each "
                        "prompt's; default: prompt)")
    p.add_argument("--layers", default=None, help="comma-separated decoder layers (default all)")
    p.add_argument("--calibration", nargs="+", default=[],
                   help="runs (under --traces) that static counts and coact statistics are "
                        "learned from; must not share prompts with the evaluated runs")
    p.add_argument("--allow-evaluation-calibration", action="store_true",
                   help="accept --calibration runs captured with --role evaluation (refused "
                        "by default)")
    p.add_argument("--mode", default="open", choices=tuple(modes.MODES),
                   help="open: per-layer reconstruction error; closed: re-verify every tree "
                        "with the budget in all layers (acceptance under budget)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="budgets across a batch: one shortlist per verification pass of b trees "
                        "(runs captured at b = 1: prompts grouped into virtual batches of b by "
                        "--batch-seed, trees of the same decoding step together; runs captured "
                        "with --batch-size b: their real passes); open loop: one row per pass "
                        "× layer in replay_batch; closed loop: each pass's trees re-verified in "
                        "one batched forward, one row per tree in replay_closed_batch")
    p.add_argument("--batch-seed", type=int, default=0,
                   help="seed of the virtual batches' grouping")
    p.add_argument("--out", default=None, help="results root (default --traces; a folder or "
                                               "s3://bucket/prefix)")
    location.add_storage_options_argument(p)
    p.add_argument("--device", default="auto",
                   help="auto (CUDA if present), cpu, cuda, cuda:N: where the whole engine runs")
    p.add_argument("--dtype", default="captured",
                   help="dtype the model is loaded in: captured (the dtype the runs were "
                        "captured in; a bf16 capture replayed on a CPU stays bf16 in memory, "
                        "experts are upcast per call), auto, float32, bfloat16, float16")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the checkpoint's own modelling code (as the capture did with "
                        "--trust-remote-code); the hub revision is the one the run recorded")
    p.add_argument("--chunk-tree-layers", type=int, default=None, metavar="N",
                   help="tree-layers computed together in one chunk (default: as many as fit "
                        "in ~256 MiB of work arrays); not --batch-size, which is sequences per "
                        "verification pass")
    p.add_argument("--batch", type=int, default=None, dest="old_batch", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0,
                   help="fan prompts out to N Ray actors on a local cluster (pip install -e "
                        ".[ray]); each loads the model once")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead")
    console.threads.add_argument(p, what="torch (with --workers: shared among the workers)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--output", type=Path, default=None, metavar="FILE",
                   help="also write every summary row (all metrics): FILE.csv or FILE.parquet "
                        "as a table, else JSON with the request and outcome")
    return p


def select_runs(catalog, args) -> list:
    from moe_spec.replay.plan import ReplayError
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


def load_dtype(option: str, runs: list) -> str:
    """``--dtype``: ``captured`` is the dtype the first run's model ran in when captured."""
    if option != "captured":
        return option
    return str(runs[0].manifest.get("dtype") or "auto").removeprefix("torch.")


def check_budget_mode(args) -> None:
    """Before any work: what ``--budget-mode adaptive`` needs (a calibration run, rankings that
    can rank every budget at once, one process) and flags that only it takes; sets
    ``args.budget_mode_name`` (the results' ``budget_mode``)."""
    from moe_spec.replay.plan import ReplayError
    adaptive = args.budget_mode == index.ADAPTIVE
    if not adaptive:
        for flag, value in (("--gain-predictor", args.gain_predictor),
                            ("--pass-cap", args.pass_cap), ("--pace", args.pace),
                            ("--pace-over", args.pace_over)):
            if value is not None:
                raise ReplayError(f"{flag} is for adaptive budgets; add --budget-mode adaptive")
        args.budget_mode_name = index.FIXED
        return
    if not args.calibration:
        raise ReplayError("--budget-mode adaptive needs --calibration RUN: the price λ of each "
                          "mean budget is calibrated there (captured on other prompts)")
    if args.pass_cap is not None and not args.pass_cap > 1:
        raise ReplayError(f"--pass-cap {args.pass_cap:g} must be above 1 (a pass's total "
                          "≤ F·B̄·L; at 1 every pass spends exactly B̄·L, the first layers "
                          "taking all they want and the last ones B_min)")
    if args.pace_over is not None and args.pace is None:
        raise ReplayError("--pace-over is for a paced rule; add --pace ETA")
    if args.pace is not None and not (args.pace > 0 and math.isfinite(args.pace)):
        raise ReplayError(f"--pace {args.pace:g} must be a positive number (e.g. 0.5: each B̄ "
                          "a prompt has overspent multiplies its price by e^0.5)")
    if args.workers or args.ray_address:
        raise ReplayError("--budget-mode adaptive runs in one process; drop --workers/"
                          "--ray-address")
    executes = modes.get(args.mode).executes
    bad = [r for r in args.ranking if not index.adapts(r, executes=executes)]
    if bad:
        learns = [r for r in bad if index.adapts(r, executes=True)]
        why = (f"{', '.join(learns)} learn from the experts their own passes executed, which "
               "open loop does not run; use --mode closed" if learns else
               f"{', '.join(bad)} search a budget at a time; pick other rankings")
        raise ReplayError(f"--budget-mode adaptive ranks every budget B_min..N of a layer at "
                          f"once: {why}")
    args.gain_predictor = args.gain_predictor or "mass"
    args.budget_mode_name = index.budget_mode(
        args.gain_predictor, args.pass_cap is not None,
        None if args.pace is None else args.pace_over or "prompt")


def check_outputs(args) -> None:
    """Before any work: ``--out`` (a results root) is the traces root itself or outside it,
    never a folder inside it (its results would sit among the run's files); ``--output`` is a
    plain file outside both roots."""
    from moe_spec.catalog import atomic
    from moe_spec.replay.plan import ReplayError
    if args.out is not None and not location.is_remote(args.out) and \
            not location.is_remote(args.traces) and \
            os.path.realpath(args.out) != os.path.realpath(args.traces):
        try:
            atomic.check_outside(args.out, args.traces, "--out")
        except atomic.UnsafeTarget as exc:
            raise ReplayError(f"{exc} (or give --out {args.traces} itself)") from None
    console.check_output_option(args.output, ReplayError, traces=args.traces)
    console.check_output_option(args.output, ReplayError, traces=args.out)


def preflight(args):
    """Everything that can be refused before torch loads: the traces, the runs and their roles,
    the calibration runs (found, calibration role, other prompts), the options. Returns the
    catalog, the runs, the budgets (when the manifests name N), the layers and the calibration
    runs (resolved here, once for the command)."""
    from moe_spec.catalog import Catalog
    from moe_spec.replay.plan import ReplayError, parse_budgets
    args.traces = location.from_args(args.traces, args.storage_options)
    if args.out is not None:
        args.out = location.root(args.out)
    if args.old_batch is not None:
        raise ReplayError("--batch is now --chunk-tree-layers (tree-layers computed together; "
                          "--batch-size is sequences per verification pass)")
    for flag, value, low in (("--chunk-tree-layers", args.chunk_tree_layers, 1),
                             ("--workers", args.workers, 0),
                             ("--batch-size", args.batch_size, 1)):
        if value is not None and value < low:
            raise ReplayError(f"{flag} {value} must be at least {low}")
    try:
        modes.batched(args.mode, args.batch_size, args.batch_seed)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    if args.batch_size > 1 and (args.workers or args.ray_address):
        raise ReplayError("--batch-size with --workers/--ray-address is not supported: a batch's "
                          "prompts are replayed together in one process; drop --workers")
    check_outputs(args)
    check_budget_mode(args)
    try:
        layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    except ValueError:
        raise ReplayError(f"cannot read --layers {args.layers!r}; use decoder layer numbers "
                          "like 0,4,7") from None
    if layers and not modes.get(args.mode).per_layer:
        raise ReplayError("--layers is for open loop: closed loop re-verifies every tree with "
                          "the budget at every MoE layer; drop --layers")
    _, capped, paced = index.budget_mode_parts(args.budget_mode_name)
    if layers and (capped or paced):
        raise ReplayError("--layers with --pass-cap or --pace: a capped or paced adaptive budget "
                          "runs over a pass's MoE layers in order, so it is defined on the whole "
                          "pass; replay every stored layer (drop --layers)")
    offline = [r for r in args.ranking if not index.RANKINGS[r].runtime]
    if modes.get(args.mode).runtime_rankings_only and offline:
        raise ReplayError(f"closed loop takes runtime rankings only "
                          f"({', '.join(index.ranking_names(runtime=True))}), not "
                          f"{', '.join(offline)}")
    catalog = Catalog(args.traces)
    if not catalog.all_runs():  # (refuses a run folder whose manifest is gone)
        raise ReplayError(f"no captured runs under {args.traces}; run "
                          f"`{console.command('capture')}` first or point --traces at a traces "
                          "folder")
    runs = select_runs(catalog, args)
    captured = {r.name: int(r.settings.get("batch_size") or 1) for r in runs}
    other = [n for n, b in captured.items() if args.batch_size > 1 and b > 1 and b != args.batch_size]
    if other:
        raise ReplayError(f"run {other[0]} was captured with --batch-size {captured[other[0]]}; "
                          f"replay it with --batch-size {captured[other[0]]} (its real passes) "
                          "or 1 (each tree alone), or pick other runs with --run")
    if args.calibration:
        found = catalog.runs(model=runs[0].model, names=args.calibration)
        if not args.allow_evaluation_calibration and any(r.role == "evaluation" for r in found):
            from moe_spec.policy.calibration import evaluation_calibration
            raise ReplayError(evaluation_calibration(found))
    calibration = catalog.calibration_runs(args.calibration, runs[0].model, set().union(
        *(r.prompt_keys() for r in runs))) if args.calibration else []
    n = runs[0].manifest.get("num_experts")
    budgets = parse_budgets(args.budget, n) if isinstance(n, int) else None
    return catalog, runs, budgets, layers, calibration


# --- the summary -----------------------------------------------------------------------------

def _names(values) -> str:
    values = sorted(set(values))
    return values[0] if len(values) == 1 else "{" + ", ".join(values) + "}"


def summary_lines(frame, mode, runs: list, rankings: list[str],
                  coverages: list[str]) -> list[str]:
    """The summary as a few small pivots: one block per coverage policy, budget rows × ranking
    columns of the mean metric, and where router and oracle are both there, the share of their
    gap each other ranking closes: per budget as a column when there is one such ranking,
    ``(router − X) / (router − oracle)`` at that B; over all budgets as a last row,
    ``Σ_B (router − X) / Σ_B (router − oracle)`` over the budgets where all three were replayed;
    a footnote says which is which. Every metric of every cell: --output, or ``query``.
    ``mode``: a :class:`replay.modes.ReplayMode` or its name."""
    mode = modes.get(mode)
    metric, count = mode.headline, mode.counted
    if frame.is_empty():
        return ["nothing to replay: no verification pass in these runs (every prompt stopped "
                "before its first pass)"]
    counts = sorted(set(frame[count].to_list()))
    per = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    lines = [f"{_names(r.model for r in runs)} / {_names(r.bench for r in runs)} / run "
             f"{_names(r.name for r in runs)}: {mode.title()}, {mode.headline_text}; "
             f"{per} {mode.counted_unit} per cell{mode.summary_note(frame)}"]
    present = [r for r in rankings if r in set(frame["ranking"].to_list())]
    others = [r for r in present if r not in ("router", "oracle")] \
        if {"router", "oracle"} <= set(present) else []
    fmt = lambda v: "—" if v is None else f"{v:.{mode.digits}f}"  # noqa: E731
    pct = lambda v: "—" if v is None else f"{v:.0%}"  # noqa: E731
    for cov in [c for c in coverages if c in set(frame["coverage"].to_list())]:
        rows = frame.filter(frame["coverage"] == cov)
        value = {(r["ranking"], r["budget"]): r[metric] for r in rows.iter_rows(named=True)}
        budgets = sorted({b for _, b in value})
        head = ["budget", *present] + (["gap closed at B"] if len(others) == 1 else [])
        table = []
        for b in budgets:
            row = [str(b), *(fmt(value.get((r, b))) for r in present)]
            if len(others) == 1:
                row.append(pct(gap_closed(value.get(("router", b)), value.get(("oracle", b)),
                                    value.get((others[0], b)))))
            table.append(row)
        if others:  # over all budgets where the three are there: Σ(router − X) / Σ(router − oracle)
            row = ["gap closed, all B"]
            for r in present:
                both = [b for b in budgets if None not in (value.get(("router", b)),
                                                           value.get(("oracle", b)),
                                                           value.get((r, b)))]
                row.append(pct(gap_closed(sum(value[("router", b)] for b in both),
                                    sum(value[("oracle", b)] for b in both),
                                    sum(value[(r, b)] for b in both))) if both else "—")
            table.append(row + ([""] if len(others) == 1 else []))
        widths = [max(len(x) for x in col) for col in zip(head, *table)]
        lines.append(f"coverage {cov}:")
        for row in [head, *table]:
            lines.append("  " + "  ".join(x.rjust(w) for x, w in zip(row, widths)).rstrip())
    if others:
        m = mode.headline_text.split(" (")[0]
        if len(others) == 1:
            lines.append(f"gap closed at B: (router − X) / (router − oracle) of the {m} at that "
                         "one budget")
        lines += [f"gap closed, all B: Σ_B (router − X) / Σ_B (router − oracle) of the {m} over "
                  "the budgets above", "  where router, oracle and X were all replayed (one figure "
                  "for the sweep, not a per-budget value)"]
    return lines + surrogate_lines(frame, present, count, mode.counted_unit)


def _share(x: float) -> str:
    """A share strictly between 0 and 1 as a percentage that never reads 0% or 100%."""
    return "<1%" if x < 0.005 else ">99%" if x >= 0.995 else f"{x:.0%}"


def surrogate_lines(frame, rankings: list[str], count: str, unit: str) -> list[str]:
    """One line per token-aware ranking (``needs_hidden``) replayed: the share of its
    ``unit`` (tree-layers) whose shortlists its surrogate searched (the stored
    ``surrogate_ranked``), the rest coact-prior's — sketch-gated's input gate at work, or a
    sketch without a surrogate or MoE inputs, said in numbers."""
    if "surrogate_ranked" not in frame.columns:
        return []
    out = []
    for r in rankings:
        if r not in index.RANKINGS or not index.RANKINGS[r].needs_hidden:
            continue
        rows = frame.filter(frame["ranking"] == r)
        share = float((rows["surrogate_ranked"] * rows[count]).sum() / rows[count].sum())
        if share in (0, 1):
            out.append(f"{r}: its surrogate ranked every {unit[:-1]}" if share else
                       f"{r}: its surrogate ranked no {unit[:-1]} (coact-prior's shortlists "
                       "throughout)")
        else:
            out.append(f"{r}: its surrogate ranked {_share(share)} of the {unit}, "
                       f"coact-prior's shortlists the other {_share(1 - share)}")
    return out


def write_output(path: Path, payload: dict, frame) -> None:
    """``--output``: the summary rows as CSV or Parquet by the file's suffix, else JSON."""
    from moe_spec.catalog import atomic
    suffix = path.suffix.lower()
    if suffix in (".csv", ".parquet") and frame is None:
        raise OSError(f"nothing to write to {path}: no summary rows")
    if suffix == ".csv":
        atomic.write_bytes(path, frame.write_csv().encode("utf-8"))
    elif suffix == ".parquet":
        atomic.write_table(path, frame.to_arrow())
    else:
        console.write_json(path, payload)


def key_dtype(args, runs: list) -> str | None:
    """The dtype the model will be loaded in, as results are keyed (without torch): None when
    only loading can tell (``--dtype auto`` on a device that may be a GPU)."""
    dtype = load_dtype(args.dtype, runs)
    if dtype == "auto":
        return "float32" if args.device == "cpu" else None
    return dtype


def check_request(args, budgets: list[int] | None, coverages: tuple[str, ...],
                  k: int | None) -> None:
    """What the rankings and coverage policies refuse (from :mod:`policy.index`, without
    torch): a ranking that needs calibration without one; budgets all below what the coverage
    policies accept for top-k (once budgets and k are known: from the manifests, else from the
    loaded model)."""
    from moe_spec.replay.plan import ReplayError
    need_cal = [r for r in args.ranking if index.RANKINGS[r].needs_calibration]
    if need_cal and not args.calibration:
        raise ReplayError(f"--ranking {' '.join(need_cal)} needs --calibration RUN (captured "
                          "on other prompts)")
    if budgets is not None and k is not None and \
            all(b < index.min_budget(c, k) for c in coverages for b in budgets):
        raise ReplayError(f"substitution needs a budget ≥ k = {k}")


@dataclass
class Computed:
    """What :func:`compute` replayed: the outcome, the request it answered, its budgets (N known
    once the model is loaded) and the model."""

    outcome: object
    request: object
    budgets: list[int]
    loaded: object


def compute(args, planned: Planned, coverages) -> Computed:
    """Load the model and execute the replay's plan (a write that fails is a one-line
    :class:`UserError` naming where). The request was checked and planned before
    (:func:`plan_request`), the calibration runs resolved; only what the manifests could not
    tell is checked (and planned) here, against the loaded model."""
    console.threads.apply(args.threads)  # torch's pools
    from moe_spec.moe import models
    from moe_spec.moe.adapter import MoEAdapter
    from moe_spec.replay.run import (
        ReplayError,
        ReplayRequest,
        calibration_stats,
        parse_budgets,
        price_request,
        replay,
    )
    models.quiet_transformers()
    catalog, runs, layers = planned.catalog, planned.runs, planned.layers
    model = runs[0].model
    try:
        loaded = models.load(model, device=args.device, dtype=load_dtype(args.dtype, runs),
                             revision=runs[0].settings.get("revision"),
                             trust_remote_code=args.trust_remote_code)
        adapter = MoEAdapter(loaded.model)
        request = planned.request
        if planned.made_for(adapter.num_experts, adapter.top_k):
            budgets = planned.budgets
        else:  # the manifests could not tell N and k (or disagree with the model)
            budgets = parse_budgets(args.budget, adapter.num_experts)
            check_request(args, budgets, coverages, adapter.top_k)
            request = ReplayRequest(tuple(args.ranking), coverages, tuple(budgets), layers,
                                    args.mode, args.batch_size, args.batch_seed,
                                    args.budget_mode_name, args.pass_cap, args.pace)
        for layer in layers or ():
            adapter.layer(layer)
        stats, cal = None, []
        if args.calibration:
            stats, cal = calibration_stats(catalog, args.calibration, model, runs, adapter,
                                           progress=not args.no_progress,
                                           rankings_used=tuple(args.ranking),
                                           resolved=planned.calibration,
                                           prices=price_request(request))
        outcome = replay(catalog, runs, adapter, request, stats, cal, args.out or args.traces,
                         device=loaded.device, progress=not args.no_progress,
                         max_batch=args.chunk_tree_layers, workers=args.workers,
                         ray_address=args.ray_address, dtype=load_dtype(args.dtype, runs),
                         key_dtype=str(loaded.dtype), prepared=planned.plan)
    except OSError as exc:
        where = getattr(exc, "filename", None) or args.out or args.traces
        raise ReplayError(f"cannot write results to {where}: {exc.strerror or exc}; choose "
                          "a writable --out") from None
    return Computed(outcome, request, budgets, loaded)


@dataclass
class Planned:
    """What the command line asks, checked without the model: the runs, budgets (None until N
    is known), layers, the calibration runs (resolved once), N and k where the manifests name
    them, the request and its plan (:func:`replay.plan.manifest_plan`, None until the model
    tells what the manifests cannot), and the outcome when every cell is stored."""

    catalog: object
    runs: list
    budgets: list[int] | None
    layers: tuple[int, ...] | None
    calibration: list = field(default_factory=list)
    n: int | None = None
    k: int | None = None
    request: object = None
    plan: object = None
    outcome: object = None

    def made_for(self, n: int, k: int) -> bool:
        """Whether the budgets and request were parsed and checked for N = ``n``, top-``k``."""
        return self.request is not None and (self.n, self.k) == (n, k)


def plan_request(args, coverages: tuple[str, ...]) -> Planned:
    """Every check that needs no model, and where N, k and the dtype follow from the manifests
    the plan (once for the command: :func:`compute` executes this one); where every cell is
    stored already, the answer too (without the model or torch)."""
    from moe_spec.replay import plan
    catalog, runs, budgets, layers, calibration = preflight(args)
    n, k = runs[0].manifest.get("num_experts"), runs[0].manifest.get("top_k")
    k = k if isinstance(k, int) else None
    check_request(args, budgets, coverages, k)
    found = Planned(catalog, runs, budgets, layers, calibration)
    if budgets is not None and k is not None:  # N and k from the manifests
        found.n, found.k = n, k
        found.request = plan.ReplayRequest(tuple(args.ranking), coverages, tuple(budgets),
                                           layers, args.mode, args.batch_size, args.batch_seed,
                                           args.budget_mode_name, args.pass_cap, args.pace)
        dtype = key_dtype(args, runs)
        if dtype is not None:
            found.plan = plan.manifest_plan(catalog, runs, found.request, calibration,
                                            args.out or args.traces, dtype)
            if found.plan is not None and found.plan.complete:
                found.outcome = found.plan.stored()
    return found


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    coverages = tuple(index.COVERAGES) if args.coverage == "both" else (args.coverage,)
    threads = console.threads.apply(args.threads, torch=False)  # before any pool starts
    try:
        planned = plan_request(args, coverages)
        done = Computed(planned.outcome, planned.request, planned.budgets, None) \
            if planned.outcome is not None else \
            compute(args, planned, coverages)
    except UserError as exc:
        return fail("replay", exc)
    frame = print_outcome(args, planned, done, coverages)
    payload = result_payload(args, planned, done, coverages, frame, threads)
    try:
        if args.output is not None:
            write_output(args.output, payload, frame)
    except OSError as exc:
        return fail("replay", f"cannot write --output {args.output}: {exc.strerror or exc}", 1)
    return 0


def print_outcome(args, planned: Planned, done: Computed, coverages):
    """Skips, notes and reuse on stderr; per run the summary table, then variants, the rate and
    where the results are. Returns the summary frame (None when nothing was summarised)."""
    from moe_spec.replay import plan
    outcome, request = done.outcome, done.request
    for name, skipped in outcome.skipped.items():
        print(f"replay: {name} skipped budgets {', '.join(map(str, skipped))}: "
              f"{index.skip_reason(name, index.RANKINGS[name].subset_limit)}", file=sys.stderr)
    for note in outcome.notes:
        print(f"replay: {note}", file=sys.stderr)
    for name in outcome.reused:
        print(f"reused stored results for run {name}" +
              ("" if done.loaded else " (model not loaded)"), file=sys.stderr)
    frame = plan.summary_frame(outcome, request)
    for run in planned.runs if frame is not None else []:  # one block per run: never pooled
        mine = frame.filter(frame["run"] == run.name).drop("run")
        if mine.is_empty():
            continue
        print("\n".join(summary_lines(mine, request.mode, [run], list(args.ranking),
                                       list(coverages))))
    adaptive = frame is not None and request.budget_mode != index.FIXED
    if adaptive and "experts_loaded" in frame.columns:  # the achieved mean, held out
        for row in frame.sort("ranking", "coverage", "budget").to_dicts():
            print(f"{row['ranking']}, {row['coverage']}, B̄ {row['budget']}: mean experts loaded "
                  f"{row['experts_loaded']:.3f} per tree-layer")
    variants = sorted({plan.variant_text(u.unit) for u in outcome.units})
    if variants:
        print("variants: " + "; ".join(variants))
    if outcome.tree_layers:
        unit = request.mode.counted_unit
        rate = outcome.tree_layers / max(outcome.seconds, 1e-9)
        print(f"replayed {outcome.tree_layers} {unit} in {outcome.seconds:.1f} s "
              f"({rate:.3g} {unit}/s)")
    if outcome.trees:
        print(f"re-verified {outcome.trees} trees in {outcome.seconds:.1f} s "
              f"({outcome.trees / max(outcome.seconds, 1e-9):.3g} trees/s)")
    print(f"results: {', '.join(result_folders(outcome))}")
    if frame is not None:
        table = request.mode.table
        if args.out is None or str(args.out) == str(args.traces):
            print(f"every metric per cell: --output FILE.csv, or {console.command('query')} "
                  f"--traces {args.traces} \"SELECT * FROM {table}\"")
        else:  # query's views read results beside the committed runs they replay
            print("every metric per cell: --output FILE.csv (query reads results stored beside "
                  "their traces: replay without --out)")
    return frame


def result_folders(outcome) -> list[str]:
    return sorted({str(u.folder.parent) for u in outcome.units})


def result_payload(args, planned: Planned, done: Computed, coverages, frame, threads) -> dict:
    """The machine-readable result (``--output``)."""
    outcome, loaded = done.outcome, done.loaded
    return {"tool": "replay", "mode": args.mode, "batch_size": args.batch_size,
            "budget_mode": args.budget_mode_name, "pass_cap": args.pass_cap, "pace": args.pace,
            "batch_seed": args.batch_seed, "traces": str(args.traces),
            "model": planned.runs[0].model, "runs": [r.name for r in planned.runs],
            "calibration": list(args.calibration), "rankings": list(args.ranking),
            "coverages": list(coverages), "budgets": list(done.budgets),
            "tree_layers": outcome.tree_layers, "trees": outcome.trees,
            "seconds": outcome.seconds, "results": result_folders(outcome), "threads": threads,
            "model_loaded": loaded is not None,
            "model_dtype": None if loaded is None else str(loaded.dtype).removeprefix("torch."),
            "reused": list(outcome.reused), "notes": list(outcome.notes),
            "variants": [dict(u.unit, config=u.folder.name.split("=", 1)[1])
                         for u in outcome.units],
            "skipped": {name: list(b) for name, b in outcome.skipped.items()},
            "summary": frame.to_dicts() if frame is not None else []}


if __name__ == "__main__":
    sys.exit(main())
