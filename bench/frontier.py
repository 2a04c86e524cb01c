"""The frontier for every ranking: MoE-Spec's headline table — throughput gain over unbudgeted
EAGLE at matched quality — per replayed ranking, coverage and model family, on the family's
real shape and on A100, H100, H200 and this CPU (issue 59.3).

    python bench/frontier.py --traces /tmp/fr --output docs/results/frontier/tiny-olmoe.json
    python bench/frontier.py --render docs/results/frontier/*.json --readme docs/results.md

For each model it captures a small evaluation run and a disjoint calibration run (skipped when
``--traces`` already holds them), replays them open loop under ``--rankings`` over the budget
sweep and closed loop under ``--closed-rankings`` (τ, path and KL under each budget), then
reads every replayed ranking and coverage back and projects it with the cost model
(:func:`analysis.frames.frontier_table`: the budget at matched quality, :data:`MATCHED_QUALITY`,
and its throughput over B = N on the same shape and hardware). "This CPU" is a roofline profile
measured here (:func:`analysis.cost.measure_cpu`; on a shared machine it varies with the load).
``--render`` computes nothing: it prints, and with ``--readme`` writes, the block between the
``frontier`` marker lines of docs/results.md from earlier ``--output`` files.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from moe_spec.analysis.results_doc import add_table_options, write_block_or_exit
from moe_spec.console import threads

BLOCK = "frontier"
VERSION = 2  # of the --output layout (2: the rows' numbers, formatted by --render)


def prepare(traces: Path, model: str, bench: str, prompts: int, new_tokens: int,
            rankings: list[str], closed: list[str], budgets: str, nthreads: int) -> None:
    """Capture and replay what the table reads (each step answers from disk when done)."""
    from moe_spec.capture import cli as capture_cli
    from moe_spec.replay import cli as replay_cli
    common = ["--model", model, "--bench", bench, "--limit", str(prompts), "--max-new-tokens",
              str(new_tokens), "--out", str(traces), "--no-progress", "--threads", str(nthreads)]
    assert capture_cli.main([*common, "--run", f"{model}-eval"]) == 0
    assert capture_cli.main([*common, "--run", f"{model}-cal", "--role", "calibration",
                             "--offset", str(prompts + 40)]) == 0
    replay = ["--traces", str(traces), "--run", f"{model}-eval", "--calibration",
              f"{model}-cal", "--no-progress", "--threads", str(nthreads)]
    assert replay_cli.main([*replay, "--ranking", *rankings, "--budget", "sweep"]) == 0
    if closed:
        assert replay_cli.main([*replay, "--mode", "closed", "--ranking", *closed,
                                "--coverage", "substitution", "--budget", budgets]) == 0


def measure(traces: Path, model: str, bench: str, cpu) -> dict:
    """The frontier rows of one model and benchmark (:func:`frontier_table`) on its family's
    real shape, with what they rest on."""
    from moe_spec.analysis import cost, frames, summaries
    from moe_spec.analysis.sql import connect
    from moe_spec.catalog import partition_value
    summaries.ensure(traces, workers=1)  # the routing summaries the projection reads
    con = connect(traces)
    part = partition_value(model)
    location, trees, settings = con.execute(
        "SELECT any_value(r.model_location), count(*), any_value(r.settings) FROM trees t "
        "JOIN runs r USING (model, bench, run) WHERE t.model = ? AND t.bench = ? "
        "AND t.budget IS NULL AND r.role = 'evaluation'", [part, bench]).fetchall()[0]
    depth = json.loads(settings or "{}").get("depth") or 7  # the draft's depth
    real = frames.real_target(dict(model_location=location, model=model), model)
    name, target = real if real else (f"captured shape ({model})", frames.model_shape(location))
    hardware = [*cost.PROFILES.values(), cpu]
    table = frames.frontier_table(con, model, bench, target, hardware, int(depth or 7))
    return dict(model=model, bench=bench, target=name, trees=int(trees), rows=table.to_dicts())


def render(found: list[dict]) -> str:
    """The markdown block: what it measured, the rule, then one row per (model, ranking,
    coverage, hardware)."""
    import polars as pl

    from moe_spec.analysis.frames import MATCHED_QUALITY, frontier_markdown_rows
    for f in found:
        if f.get("version") != VERSION or f.get("tool") != "bench/frontier.py":
            raise SystemExit("frontier.py: --render: not an --output of this version")
    head = ["model", "bench", "ranking", "coverage", "quality from", "hardware",
            "budget at matched quality", "quality there", "τ there", "throughput gain over EAGLE"]
    lines = []
    for f in found:
        cpu = f["cpu"]
        lines.append(f"- **{f['model']}** on {f['bench']} ({f['trees']} unbudgeted trees of "
                     f"{f['prompts']} prompts × {f['max_new_tokens']} new tokens; projected on "
                     f"{f['target']}; this CPU measured at {cpu['bandwidth'] / 1e9:.1f} GB/s and "
                     f"{cpu['peak_flops'] / 1e9:.0f} GFLOP/s fp32, {f['date']}, a shared 2-core "
                     "machine: small size)")
    lines += ["", f"Rule: {MATCHED_QUALITY.replace(':func:', '').replace('`', '')}.", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in found:
        for r in frontier_markdown_rows(pl.DataFrame(f["rows"])):
            lines.append("| " + " | ".join(str(r[h]) for h in head) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-frontier"))
    p.add_argument("--models", nargs="+", default=["tiny-olmoe"])
    p.add_argument("--bench", default="mbpp")
    p.add_argument("--prompts", type=int, default=4, help="evaluation (and calibration) prompts")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rankings", nargs="+", default=["router", "oracle", "sqmass", "coact-prior"])
    p.add_argument("--closed-rankings", nargs="*", default=["router", "coact-prior"])
    p.add_argument("--closed-budgets", default="8,16,24,32,48")
    p.add_argument("--output", type=Path, default=None)
    add_table_options(p, BLOCK)
    threads.add_argument(p)
    args = p.parse_args()
    if args.render:
        table = render([json.loads(path.read_text()) for path in args.render])
        print(table)
        for readme in write_block_or_exit(args.readme, table, args.block, "frontier.py"):
            print(f"wrote the table into {readme}")
        return
    nthreads = threads.apply(args.threads)
    from moe_spec.analysis import cost
    cpu = cost.measure_cpu()
    for model in args.models:
        prepare(args.traces, model, args.bench, args.prompts, args.max_new_tokens, args.rankings,
                args.closed_rankings, args.closed_budgets, nthreads)
        found = dict(tool="bench/frontier.py", version=VERSION, prompts=args.prompts,
                     max_new_tokens=args.max_new_tokens,
                     date=datetime.date.today().isoformat(),
                     cpu=dict(bandwidth=cpu.bandwidth, peak_flops=cpu.peak_flops),
                     **measure(args.traces, model, args.bench, cpu))
        print(render([found]))
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(found, indent=1) + "\n")
            print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
