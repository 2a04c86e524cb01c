"""``capture``: run EAGLE decoding over a benchmark and record every verification pass.

The parser imports nothing heavy (torch and transformers load once a run starts), so ``--help``
appears at once.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time

from moe_spec import console
from moe_spec.capture.settings import CaptureError, CaptureSettings, option_flag
from moe_spec.catalog import ROLES, location
from moe_spec.errors import UserError, fail
from moe_spec.moe import models
from moe_spec.tasks import benchmarks

EXAMPLES = """
capture --model tiny-olmoe --bench mbpp --limit 8
capture --model tiny-olmoe --bench gsm8k --role calibration --run cal
capture --model tiny-olmoe --bench mbpp,gsm8k,humaneval --limit 4     # one run per benchmark
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
    from moe_spec.capture import settings as declared
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
    with_trees = getattr(s, "prompts_with_trees", None)
    said = ([f"{with_trees} with verification passes"] if with_trees is not None
            and with_trees < s.prompts else []) \
        + ([f"{s.prompts_resumed} resumed"] if s.prompts_resumed else [])
    b = getattr(s, "batch_size", 1) or 1
    rows = [
        ("prompts", f"{s.prompts}" + (f" ({'; '.join(said)})" if said else "")),
        ("verification trees", str(s.trees)),
        ("mean accepted length τ", f"{s.tau:.3f}"),
        ("unique experts / layer / tree", f"{s.unique_experts:.1f}"),
        ("experts loaded / layer / tree", f"{s.experts_loaded:.1f}"),
    ]
    if b > 1:  # what batching is about: a pass loads the union of its b trees' experts
        rows += [
            ("batch size b", f"{b} sequences a pass"),
            ("verification passes", f"{s.passes}" + (f" ({s.trees / s.passes:.1f} trees a pass)"
                                                     if s.passes else "")),
            ("unique experts / layer / pass", f"{s.pass_unique_experts:.1f} (union over the "
                                               "pass's trees)"),
        ]
    rows += [
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
    if b > 1:
        print(f"  {console.command('replay')} --traces {s.root.as_posix()} --run {s.run} "
              f"--ranking router oracle --budget 8,16,24,32 --batch-size {b}   # one shortlist "
              "per pass of its b trees")


def settings_from(args) -> CaptureSettings:
    """The capture settings the options describe (checked: one line for anything invalid)."""
    return CaptureSettings.from_options(vars(args))


def planned(args) -> list:
    """One plan (:func:`capture.plan.plan`: every check, the run's name resolved, a complete
    run answered) per benchmark of ``--bench a,b,…``, all made before any capture starts."""
    from moe_spec.capture.plan import plan
    names = [b.strip() for b in str(args.bench).split(",") if b.strip()]
    if not names or len(set(names)) < len(names):
        raise CaptureError(f"--bench {args.bench!r}: name each benchmark once, comma-separated")
    args.out = location.from_args(args.out, args.storage_options)
    console.check_output_option(args.output, CaptureError)  # before any work, not after it
    found = []
    for name in names:
        mine = copy.copy(args)
        mine.bench = name
        found.append(plan(settings_from(mine), args.out, args.run, role=args.role,
                          benchmarks_root=args.benchmarks, workers=args.workers,
                          ray_address=args.ray_address,
                          allow_evaluation_calibration=args.allow_evaluation_calibration))
    return found


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console.threads.apply(args.threads, torch=False)  # pyarrow's pool, before a plan reads
    try:
        plan = planned(args)
    except (UserError, ValueError) as exc:  # ValueError: a library's refusal (a complete run's
        return fail("capture", exc)  # tables read back), in one line
    threads = console.threads.apply(args.threads)  # before torch and transformers start pools

    from moe_spec.capture.run import execute
    models.quiet_transformers()
    done = []
    for one in plan:
        try:
            one.started = time.perf_counter()  # this run's wall time, not the plans'
            summary = execute(one, progress=not args.no_progress)
        except (UserError, ValueError) as exc:  # ValueError: a library's refusal, in one line
            return fail("capture", exc)
        except KeyboardInterrupt:
            print("capture: interrupted; rerun the same command to resume", file=sys.stderr)
            return 130
        print_summary(summary)
        done.append({"tool": "capture", **dataclasses.asdict(summary), "role": one.role,
                     "threads": threads, "settings": dataclasses.asdict(one.settings)})
    try:  # one capture: its summary; several: {"tool": "capture", "captures": [...]}
        console.write_json(args.output, done[0] if len(done) == 1 else
                           {"tool": "capture", "captures": done})
    except OSError as exc:
        return fail("capture", f"cannot write --output {args.output}: {exc.strerror or exc}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
