"""``capture``: run EAGLE decoding over a benchmark and record every verification pass.

The parser imports nothing heavy (torch and transformers load once a run starts), so ``--help``
appears at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import console
from capture.settings import CaptureError, CaptureSettings
from capture.storage import DTYPES, OUTPUTS
from catalog import ROLES
from moe import models
from policy import index
from tasks import benchmarks

EXAMPLES = """
capture --model tiny-olmoe --bench mbpp --limit 8
capture --model tiny-olmoe --bench gsm8k --role calibration --run cal
capture --budget 32 --ranking router --coverage substitution     # MoE-Spec online mode
capture --model olmoe --bench mbpp --chat-template                # a real checkpoint, on a GPU
capture --config run.toml --output summary.json
"""


def parser() -> argparse.ArgumentParser:
    d = CaptureSettings()
    p = console.ArgumentParser(
        prog="capture", examples=EXAMPLES,
        description="Run real EAGLE tree drafting and verification on a Hugging Face MoE model "
                    "over a benchmark and write, per verification pass, tree node and MoE layer, "
                    "router probabilities, top-k and mixing weights, MoE input and output to "
                    "hive-partitioned Parquet. Interrupted runs resume where they stopped.")
    p.add_config_option()
    g = p.add_argument_group("what to run")
    g.add_argument("--model", default=d.model,
                   help=f"alias ({', '.join(models.ALIASES)}), hub id or local folder")
    g.add_argument("--draft", default=None,
                   help="EAGLE-3 or EAGLE-1 head folder or hub id (default: the model's own)")
    g.add_argument("--bench", default=d.bench, choices=benchmarks.BENCHMARKS)
    g.add_argument("--benchmarks", default=None,
                   help=f"benchmarks folder (default ${benchmarks.ENV_VAR} or "
                        "../shared/data/benchmarks)")
    g.add_argument("--offset", type=int, default=d.offset, help="first prompt")
    g.add_argument("--limit", type=int, default=d.limit, help="number of prompts (0: all)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="tokens generated per prompt")
    g.add_argument("--chat-template", action="store_true",
                   help="wrap each prompt in the tokenizer's chat template as one user turn "
                        "(instruction-tuned targets; their EAGLE heads were trained so)")
    g.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="decode this many prompts together: each keeps its own draft tree, one "
                        "target forward verifies all trees (continuous batching; a --budget caps "
                        "the union over the whole batch)")
    g = p.add_argument_group("draft tree (EAGLE-2)")
    g.add_argument("--total-tokens", type=int, default=d.total_tokens,
                   help="tokens per verification tree, root included")
    g.add_argument("--depth", type=int, default=d.depth, help="expansion steps")
    g.add_argument("--tree-top-k", type=int, default=d.tree_top_k, help="beams and children")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    g.add_argument("--seed", type=int, default=d.seed, help="prompt i uses seed + i")
    g = p.add_argument_group("device")
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default=d.dtype, help="auto (bf16 on CUDA, fp32 on CPU), float32, "
                                                    "bfloat16, float16")
    console.threads.add_argument(p, g, what="torch (with --workers: shared among the workers)")
    g = p.add_argument_group("scale-out on Ray (pip install -e .[ray])")
    g.add_argument("--workers", type=int, default=0,
                   help="capture with N Ray actors on a local cluster started for the run (one "
                        "per GPU, or per CPU slot with one torch thread each)")
    g.add_argument("--ray-address", default=None,
                   help="join an existing Ray cluster (e.g. auto, or ray://host:10001); --out "
                        "must be on storage every node sees")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("traces"), help="traces root")
    g.add_argument("--run", default=None,
                   help="run name (default: derived from the settings, so reruns resume)")
    g.add_argument("--role", default="evaluation", choices=ROLES,
                   help="what the run is for: replay evaluates evaluation runs and learns "
                        "static/coact statistics from calibration runs")
    g = p.add_argument_group("storage policy (routing, trees and nodes are always complete)")
    g.add_argument("--store-layers", default=d.store_layers,
                   help="MoE layers whose inputs/outputs are kept: auto (the smallest layer "
                        "stride under ~1.5 MB per tree), all, every:N or a list 0,4,8")
    g.add_argument("--store-passes", default=d.store_passes,
                   help="verification passes that keep them: all, every:N or fraction:F "
                        "(seeded by --seed)")
    g.add_argument("--hidden-dtype", default=d.hidden_dtype, choices=DTYPES,
                   help="storage dtype of MoE inputs/outputs (bfloat16 is stored losslessly)")
    g.add_argument("--store-output", default=d.store_output, choices=OUTPUTS,
                   help="store the MoE output, or recompute it at replay (per-token output "
                        "norms are kept to check the model)")
    g.add_argument("--store-expert-outputs", action="store_true",
                   help="also store each used expert's own output E_i(h_t)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_output_option()
    g = p.add_argument_group("MoE-Spec online mode (budget inside verification passes only)")
    g.add_argument("--budget", type=int, default=None, help="experts per layer per tree")
    g.add_argument("--ranking", default=d.ranking, choices=index.ranking_names(runtime=True),
                   help=index.ranking_help(runtime=True))
    g.add_argument("--coverage", default=d.coverage, choices=list(index.COVERAGES),
                   help=index.coverage_help())
    g.add_argument("--calibration", nargs="+", default=[],
                   help="captured runs under --out that static counts / coact statistics are "
                        "learned from (other prompts)")
    g.add_argument("--allow-evaluation-calibration", action="store_true",
                   help="accept --calibration runs captured with --role evaluation (refused "
                        "by default)")
    return p


def print_summary(s) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"capture {s.model} / {s.bench} / run={s.run}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("prompts", f"{s.prompts}" + (f" ({s.prompts_resumed} resumed)" if s.prompts_resumed else "")),
        ("verification trees", str(s.trees)),
        ("mean accepted length τ", f"{s.tau:.3f}"),
        ("unique experts / layer / tree", f"{s.unique_experts:.1f}"),
        ("experts loaded / layer / tree", f"{s.experts_loaded:.1f}"),
        ("bytes on disk", f"{s.bytes_written / 2**20:.1f} MiB"),
        ("wall time", f"{s.seconds:.1f} s"),
        ("data", str(s.root.resolve())),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    print("look at it:\n"
          f"  {console.command('query')} --traces {s.root.as_posix()} \"SELECT model, bench, run, "
          "count(*) AS trees, avg(accepted_length) AS tau FROM trees GROUP BY ALL\"\n"
          f"  {console.command('replay')} --traces {s.root.as_posix()} --ranking router oracle "
          "--budget 8,16,24,32")


def settings_from(args) -> CaptureSettings:
    """The capture settings the options describe (checked: one line for anything invalid)."""
    if args.limit is not None and args.limit < 0:
        raise CaptureError(f"--limit {args.limit} is out of range: it must be 0 (all) or more")
    return CaptureSettings(
        model=args.model, bench=args.bench, draft=args.draft, offset=args.offset,
        limit=args.limit or None, max_new_tokens=args.max_new_tokens,
        total_tokens=args.total_tokens, depth=args.depth, tree_top_k=args.tree_top_k,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        store_layers=args.store_layers, store_passes=args.store_passes,
        hidden_dtype=args.hidden_dtype, store_output=args.store_output,
        store_expert_outputs=args.store_expert_outputs,
        budget=args.budget, ranking=args.ranking, coverage=args.coverage,
        calibration=tuple(args.calibration), device=args.device, dtype=args.dtype,
        chat_template=args.chat_template, batch_size=args.batch_size)


def preflight(settings: CaptureSettings, args) -> None:
    """What can be refused before torch and transformers load (seconds): the run name, the
    model (an uncached hub model while offline), the prompts, the calibration runs' role."""
    from catalog import Catalog, CatalogError, InvalidName, check_name
    if args.workers < 0:
        raise CaptureError(f"--workers {args.workers} must be 0 (no Ray) or more")
    console.check_output_option(args.output, CaptureError)  # before any work, not after it
    try:
        check_name(settings.default_run_name() if args.run is None else args.run, "--run")
    except InvalidName as exc:
        raise CaptureError(str(exc)) from None
    source = models.check_available(settings.model)
    if not benchmarks.load(settings.bench, root=args.benchmarks, offset=settings.offset,
                           limit=settings.limit):
        raise CaptureError(f"no prompts in {settings.bench} at offset {settings.offset}")
    if settings.calibration and not args.allow_evaluation_calibration:
        try:
            found = Catalog(args.out).runs(model=source.name, names=list(settings.calibration))
        except CatalogError:
            return  # said in one line where the statistics are collected
        if any(r.role == "evaluation" for r in found):
            from policy.calibration import evaluation_calibration
            raise CaptureError(evaluation_calibration(found))


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = settings_from(args)
        preflight(settings, args)
    except (CaptureError, models.ModelError, benchmarks.BenchmarkError) as exc:
        print(f"capture: error: {exc}", file=sys.stderr)
        return 2
    threads = console.threads.apply(args.threads)  # before torch and transformers start pools

    from capture.run import capture_run
    from eagle.draft_head import DraftHeadError
    from moe.families import UnsupportedModelError
    from policy.rankings import RankingError
    models.quiet_transformers()
    try:
        summary = capture_run(settings, args.out, args.run, role=args.role,
                              benchmarks_root=args.benchmarks, progress=not args.no_progress,
                              workers=args.workers, ray_address=args.ray_address,
                              allow_evaluation_calibration=args.allow_evaluation_calibration)
    except (models.ModelError, benchmarks.BenchmarkError, CaptureError, DraftHeadError,
            UnsupportedModelError, RankingError, ValueError) as exc:
        print(f"capture: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capture: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    print_summary(summary)
    try:
        console.write_json(args.output, {"tool": "capture", **dataclasses.asdict(summary),
                                         "role": args.role, "threads": threads,
                                         "settings": dataclasses.asdict(settings)})
    except OSError as exc:
        print(f"capture: error: cannot write --output {args.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
