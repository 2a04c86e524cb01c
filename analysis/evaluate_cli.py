"""``evaluate``: score the outputs of captured runs on their benchmark's task.

    evaluate --traces traces                       # every complete run
    evaluate --run B16-router --output quality.json
    query "SELECT prompt_id, score, answer FROM quality WHERE score = 0"   # why each failed

Writes the ``quality`` table (one row per prompt, beside the traces; ``query`` shows it), says
in which folder (one per run), and prints per run the metric with a 95% bootstrap interval; a
run captured under a budget is compared with its unbudgeted twin (same prompts and decoding):
identical outputs, first divergence, and the score difference with a paired bootstrap interval.
Code runs only in a sandboxed subprocess (tasks/sandbox.py); a program that fails keeps its
exception's class and message in the ``answer`` column (``failed: NameError: name 'x' is not defined``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_spec import console
from moe_spec.analysis import quality
from moe_spec.catalog import Catalog, CatalogError, location
from moe_spec.errors import UserError, fail
from moe_spec.tasks import benchmarks


def parser() -> argparse.ArgumentParser:
    p = console.ArgumentParser(prog="evaluate", description=__doc__.split("\n\n")[2],
                               examples=__doc__.split("\n\n")[1])
    p.add_argument("--traces", default="traces", help="traces root: a folder or "
                                                      "s3://bucket/prefix")
    location.add_storage_options_argument(p)
    p.add_argument("--run", nargs="+", default=None, help="only these runs")
    p.add_argument("--model", default=None, help="only runs of this model")
    p.add_argument("--bench", default=None, help="only runs of this benchmark")
    p.add_argument("--benchmarks", default=None, help="benchmarks folder (references, tests)")
    p.add_argument("--output", type=Path, default=None, help="also write the summary as JSON")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    console.threads.add_argument(p, what="the tokenizer and numeric libraries")
    return p


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console.threads.apply(args.threads, torch=False)
    try:  # the runs, benchmarks and --output are checked before transformers loads
        if args.output is not None and str(args.output) != "-":
            console.check_output(args.output)
        args.traces = location.from_args(args.traces, args.storage_options)
        catalog = Catalog(args.traces)
        everything = catalog.runs()
        runs = catalog.runs(model=args.model, bench=args.bench, names=args.run)
        if not runs:
            raise CatalogError(f"no complete runs match under {args.traces}")
        prompt_sets = {b: {p.prompt_id: p for p in benchmarks.load(b, root=args.benchmarks)}
                       for b in sorted({r.bench for r in runs})}
    except (UserError, OSError) as exc:
        return fail("evaluate", exc)
    from transformers import AutoTokenizer
    try:
        # unbudgeted runs first, so twins are scored before the runs compared with them
        runs.sort(key=lambda r: r.settings.get("budget") is not None)
        scored: dict[str, dict[int, float | None]] = {}
        results = {}
        written = []  # each run's quality folder, said at the end
        for run in runs:
            prompts = prompt_sets[run.bench]
            tokenizer = AutoTokenizer.from_pretrained(run.manifest["model_location"])
            twin = quality.find_twin(run, everything)
            if twin is not None and twin.name not in scored:
                scored[twin.name] = {r["prompt_index"]: r["score"] for r in quality.evaluate_run(
                    twin, tokenizer, prompts).to_pylist()}
            table = quality.evaluate_run(run, tokenizer, prompts, twin,
                                         scored.get(twin.name) if twin else None)
            quality.write(run, table)
            written.append(run.dir("quality"))
            scored[run.name] = dict(zip(table["prompt_index"].to_pylist(),
                                        table["score"].to_pylist()))
            results[run.name] = dict(model=run.model, bench=run.bench,
                                     **quality.summary(table, seed=args.seed),
                                     failures=dict(quality.failures(table)))
    except (UserError, OSError) as exc:
        return fail("evaluate", exc)
    for name, r in results.items():
        mean = "—" if r["mean"] is None else f"{r['mean']:.3f} [{r['ci95'][0]:.3f}, " \
            f"{r['ci95'][1]:.3f}]"
        line = f"{name} ({r['model']} / {r['bench']}, {r['prompts']} prompts): {r['metric']} {mean}"
        if "twin" in r:
            diff = "—" if r["score_difference"] is None else \
                f"{r['score_difference']:+.3f} [{r['difference_ci95'][0]:+.3f}, " \
                f"{r['difference_ci95'][1]:+.3f}]"
            line += (f"; vs {r['twin']}: identical outputs {r['exact_match']:.0%}, score "
                     f"difference {diff}")
        if r["failures"]:
            line += "; failed: " + ", ".join(f"{why} ×{count}" for why, count in
                                            r["failures"].items())
        print(line)
    print(f"quality table written (one folder per run; {console.command('query')} --traces "
          f"{location.display(args.traces)} \"SELECT * FROM quality\" reads it):")
    for folder in written:
        print("  " + location.display(folder if location.is_remote(folder)
                                      else Path(folder).resolve()))
    if args.output:
        try:
            console.write_json(args.output, results)
        except OSError as exc:
            return fail("evaluate", f"cannot write --output {args.output}: "
                        f"{exc.strerror or exc}; the quality table is written, choose a writable "
                        "--output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
