"""``capture``: run EAGLE decoding over a benchmark and record every verification pass.

The parser imports nothing heavy (torch and transformers load once a run starts), so ``--help``
appears at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import console
from capture.settings import CaptureError, CaptureSettings, option_flag
from catalog import ROLES, location
from errors import UserError, fail
from moe import models
from tasks import benchmarks

EXAMPLES = """
capture --model tiny-olmoe --bench mbpp --limit 8
capture --model tiny-olmoe --bench gsm8k --role calibration --run cal
capture --budget 32 --ranking router --coverage substitution     # MoE-Spec online mode
capture --model olmoe --bench mbpp --chat-template                # a real checkpoint, on a GPU
capture --config run.toml --output summary.json
"""


OPTION_TYPES = {"int": int, "float": float}  # a field's annotation's first word -> argparse type


def add_settings_option(group, field: dataclasses.Field) -> None:
    """One CaptureSettings field as an option, from its ``option`` metadata and its default."""
    spec = field.metadata["option"]
    flag = option_flag(field)
    help_text = spec["help"]() if callable(spec["help"]) else spec["help"]
    if spec["store_true"]:
        group.add_argument(flag, dest=field.name, action="store_true", help=help_text)
        return
    kwargs = {"dest": field.name, "default": field.default, "help": help_text or None}
    kind = OPTION_TYPES.get(str(field.type).split(" ")[0].split("[")[0])
    if kind is not None:
        kwargs["type"] = kind
    if spec["choices"] is not None:
        kwargs["choices"] = spec["choices"]()
    if spec["many"]:
        kwargs.update(nargs="+", default=list(field.default))
    group.add_argument(flag, **kwargs)


def parser() -> argparse.ArgumentParser:
    """The options: every CaptureSettings option (declared once, in capture/settings.py) and
    those of the run itself (where traces go, workers, role, output)."""
    from capture import settings as declared
    p = console.ArgumentParser(
        prog="capture", examples=EXAMPLES,
        description="Run real EAGLE tree drafting and verification on a Hugging Face MoE model "
                    "over a benchmark and write, per verification pass, tree node and MoE layer, "
                    "router probabilities, top-k and mixing weights, MoE input and output to "
                    "hive-partitioned Parquet. Interrupted runs resume where they stopped.")
    p.add_config_option()
    groups = {name: p.add_argument_group(name) for name in (
        declared.RUN, declared.TREE, declared.SAMPLING, declared.DEVICE,
        "scale-out on Ray (pip install -e .[ray])", "output", declared.STORAGE, declared.ONLINE)}
    for field in CaptureSettings.options():
        add_settings_option(groups[field.metadata["option"]["group"]], field)
    g = groups[declared.RUN]
    g.add_argument("--benchmarks", default=None,
                   help=f"benchmarks folder (default ${benchmarks.ENV_VAR} or "
                        "../shared/data/benchmarks)")
    console.threads.add_argument(p, groups[declared.DEVICE],
                                 what="torch (with --workers: shared among the workers)")
    g = groups["scale-out on Ray (pip install -e .[ray])"]
    g.add_argument("--workers", type=int, default=0,
                   help="capture with N Ray actors on a local cluster started for the run (one "
                        "per GPU, or per CPU slot with one torch thread each)")
    g.add_argument("--ray-address", default=None,
                   help="join an existing Ray cluster (e.g. auto, or ray://host:10001); --out "
                        "must be on storage every node sees")
    g = groups["output"]
    g.add_argument("--out", default="traces", help="traces root: a folder or s3://bucket/prefix")
    location.add_storage_options_argument(g)
    g.add_argument("--run", default=None,
                   help="run name (default: derived from the settings, so reruns resume)")
    g.add_argument("--role", default="evaluation", choices=ROLES,
                   help="what the run is for: replay evaluates evaluation runs and learns "
                        "static/coact statistics from calibration runs")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_output_option()
    groups[declared.ONLINE].add_argument(
        "--allow-evaluation-calibration", action="store_true",
        help="accept --calibration runs captured with --role evaluation (refused by default)")
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
        ("data", location.display(s.root) if location.is_remote(s.root)
         else str(s.root.resolve())),
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
    return CaptureSettings.from_options(vars(args))


def preflight(settings: CaptureSettings, args) -> None:
    """What can be refused before torch and transformers load (seconds): the run name, the
    model (an uncached hub model while offline), the prompts, the calibration runs' role."""
    from catalog import Catalog, CatalogError, InvalidName, check_name
    args.out = location.from_args(args.out, args.storage_options)
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
    except UserError as exc:
        return fail("capture", exc)
    threads = console.threads.apply(args.threads)  # before torch and transformers start pools

    from capture.run import capture_run
    models.quiet_transformers()
    try:
        summary = capture_run(settings, args.out, args.run, role=args.role,
                              benchmarks_root=args.benchmarks, progress=not args.no_progress,
                              workers=args.workers, ray_address=args.ray_address,
                              allow_evaluation_calibration=args.allow_evaluation_calibration)
    except (UserError, ValueError) as exc:  # ValueError: a library's refusal, in one line too
        return fail("capture", exc)
    except KeyboardInterrupt:
        print("capture: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    print_summary(summary)
    try:
        console.write_json(args.output, {"tool": "capture", **dataclasses.asdict(summary),
                                         "role": args.role, "threads": threads,
                                         "settings": dataclasses.asdict(settings)})
    except OSError as exc:
        return fail("capture", f"cannot write --output {args.output}: {exc.strerror or exc}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
