"""Does an expert budget still pay at serving batch sizes? Measured with the product's commands.

    python bench/batch_regime.py                                   # tiny-olmoe and tiny-qwen3-moe
    python bench/batch_regime.py --models tiny-olmoe --batch-sizes 1 4 --prompts 8

For each model, on the same MBPP evaluation prompts (and disjoint calibration prompts for coact):

* **budgets across a batch** (``replay --batch-size b``, open loop, substitution): every
  verification pass of b trees has one shortlist per layer over all their tokens (b = 1 runs
  grouped into virtual batches, seed 0); mean RSE at each budget for router and coact, the
  unique experts a pass's trees route to per layer, and the replay's speed (tree tokens scored
  per second; every b replays the same trees, so the ratio to b = 1 is a ratio of times);
* **MoESD, measured** (``profile-batch``): tokens/s of autoregressive and of EAGLE decoding b at
  a time (continuous batching), without and with an online budget B over the batch's union;
  speedup = EAGLE ÷ AR at the same b; MoESD's pass-time model fitted to every measured
  verification pass (:func:`analysis.frames.batch_fit`, relative RMSE).

Prints a table per model and writes ``batch_regime.json`` (``--out``). Timings come from this
machine, one run each (noisy on a shared CPU); read ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
from pathlib import Path

from moe_spec.bench import pipeline

RANKINGS = ("router", "coact")


def budgets_across_batches(traces: Path, model: str, sizes: list[int], budgets: list[int]
                           ) -> dict[int, dict]:
    """Per b: mean RSE per ranking @ budget, unique experts per layer per pass, seconds."""
    from moe_spec.analysis.sql import connect
    found = {}
    for b in sizes:  # each b its own result units: computed now (timed) unless kept from before
        outcome = pipeline.replay_runs(
            traces, model, ["eval"], rankings=RANKINGS, coverages=("substitution",),
            budgets=",".join(map(str, budgets)), out=traces, calibration=("cal",),
            batch_size=b)
        table = "replay_open" if b == 1 else "replay_batch"
        where = f"model = '{model}'" + ("" if b == 1 else f" AND batch_size = {b}")
        con = connect(traces)
        rows = con.sql(f"SELECT ranking, budget, avg(rse) AS rse FROM {table} WHERE {where} "
                       "GROUP BY ALL").fetchall()
        unique = con.sql(f"SELECT avg(unique_experts) FROM {table} WHERE {where} AND "
                         f"ranking = 'router' AND budget = {budgets[0]}").fetchall()[0][0]
        found[b] = dict(rse={f"{r}@{budget}": v for r, budget, v in rows},
                        unique_experts=unique, replay_seconds=outcome.seconds,
                        cells=outcome.tree_layers)
    return found


def measured_speed(traces: Path, model: str, sizes: list[int], budget: int, prompts: int,
                   new_tokens: int, threads: int, repeats: int) -> tuple[dict, dict | None]:
    """profile-batch at every b (stored under ``traces``), and MoESD's fit to its passes."""
    from moe_spec.analysis import frames
    from moe_spec.analysis.sql import connect
    from moe_spec.profiling import profile_batch
    assert profile_batch.main([
        "--model", model, "--limit", str(prompts), "--max-new-tokens", str(new_tokens),
        "--batch-sizes", ",".join(map(str, sizes)), "--budget", str(budget), "--out",
        str(traces), "--no-progress", "--threads", str(threads), "--repeats", str(repeats)]) == 0
    con = connect(traces)
    from moe_spec.analysis import timing
    speed = timing.latest(frames.batch_speedup(con))  # this invocation's measurement
    speed = speed.filter(speed["model"] == model)
    fit = frames.batch_fit(con, model, "mbpp", speed["run"][0], speed)
    rows = {}
    for r in speed.iter_rows(named=True):
        entry = rows.setdefault(r["batch_size"], dict(tau=r["tau"]))
        key = "speedup" if r["budget"] is None else "speedup_budget"
        entry[key] = r["speedup"]
        entry[f"{key}_ci95"] = [r["speedup_low"], r["speedup_high"]]
        if r["budget"] is None:
            entry.update(ar_tokens_per_s=r["ar_tokens_per_s"],
                         eagle_tokens_per_s=r["eagle_tokens_per_s"])
    if fit is not None:
        for p in fit["predicted"].iter_rows(named=True):
            rows[p["batch_size"]]["moesd_verify_speedup"] = p["predicted"]
    return rows, (None if fit is None else dict(
        c0=fit["coef"]["c0"], c1=fit["coef"]["c1"], c2=fit["coef"]["c2"],
        relative_rmse=fit["coef"]["relative_rmse"], points=fit["points"].height,
        refused=fit["coef"].get("refused")))


def timing_repeats() -> int:
    from moe_spec.analysis.timing import DEFAULT_REPEATS
    return DEFAULT_REPEATS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny-olmoe", "tiny-qwen3-moe"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--budget", type=int, default=16, help="online budget for the speed column")
    p.add_argument("--rse-budgets", nargs="+", type=int, default=[16, 32])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--cal-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=timing_repeats(),
                   help="profile-batch's paired repeats per configuration (default: its own)")
    p.add_argument("--traces", type=Path, default=None, help="keep the traces here")
    p.add_argument("--out", type=Path, default=Path("batch_regime.json"))
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    traces = args.traces or Path(tempfile.mkdtemp(prefix="batch-regime-"))
    if args.traces is None:  # a scratch folder: gone when the bench ends, however it ends
        atexit.register(shutil.rmtree, traces, ignore_errors=True)
    report = {}
    for model in args.models:
        common = dict(model=model, bench="mbpp", max_new_tokens=args.new_tokens)
        pipeline.capture(traces, "eval", limit=args.prompts, **common)
        pipeline.capture(traces, "cal", role="calibration", offset=200, limit=args.cal_prompts,
                         **common)
        errors = budgets_across_batches(traces, model, args.batch_sizes, args.rse_budgets)
        speed, fit = measured_speed(traces, model, args.batch_sizes, args.budget, args.prompts,
                                    args.new_tokens, args.threads, args.repeats)
        base = errors[args.batch_sizes[0]]["replay_seconds"]
        rows = [dict(batch_size=b, **errors[b], **speed.get(b, {}),
                     replay_speed_vs_first=base / max(errors[b]["replay_seconds"], 1e-9))
                for b in args.batch_sizes]
        report[model] = dict(rows=rows, moesd_fit=fit)
        print(f"\n{model}: {args.prompts} prompts x {args.new_tokens} new tokens; RSE under "
              "substitution, one shortlist per pass of b trees (replay --batch-size b)")
        cols = [f"{r}@{b}" for b in args.rse_budgets for r in RANKINGS]
        print(f"{'b':>3} {'unique/layer':>13} " + " ".join(f"{'RSE ' + c:>14}" for c in cols)
              + f" {'AR tok/s':>9} {'EAGLE tok/s':>11} {'speedup':>8} "
                f"{'speedup B=' + str(args.budget):>13} {'tau':>5} {'MoESD verify':>13}"
                f" {'replay speed':>13}")
        for r in rows:
            print(f"{r['batch_size']:>3} {r['unique_experts']:>13.1f} "
                  + " ".join(f"{r['rse'].get(c, float('nan')):>14.4f}" for c in cols)
                  + f" {r.get('ar_tokens_per_s', float('nan')):>9.1f}"
                    f" {r.get('eagle_tokens_per_s', float('nan')):>11.1f}"
                    f" {r.get('speedup', float('nan')):>7.2f}x"
                    f" {r.get('speedup_budget', float('nan')):>12.2f}x"
                    f" {r.get('tau', float('nan')):>5.2f}"
                    f" {r.get('moesd_verify_speedup', float('nan')):>12.2f}x"
                    f" {r['replay_speed_vs_first']:>12.2f}x")
        if fit and fit.get("refused"):
            print(f"MoESD pass-time model {fit['refused']}")
        elif fit:
            print(f"MoESD pass-time fit T = {fit['c0'] * 1e3:.2f} ms + {fit['c1'] * 1e3:.3f} ms "
                  f"x E(b*gamma) + {fit['c2'] * 1e3:.4f} ms x b*gamma over {fit['points']} "
                  f"(sequences, gamma) points: relative RMSE {fit['relative_rmse']:.1%}")
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
