"""``capture``: run EAGLE decoding over a benchmark and record every verification pass.

The parser imports nothing heavy (torch and transformers load once a run starts), so ``--help``
appears at once.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys

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


def preflight(settings: CaptureSettings, args) -> None:
    """What can be refused before torch and transformers load (seconds): the run name, the
    output root, the model (an uncached hub model while offline) and the budget its config
    admits, the prompts, the Ray cluster, the calibration runs (that they exist, and their
    role), and a run another capture is writing right now."""
    from moe_spec.catalog import Catalog, CatalogError, InvalidName, check_name
    args.out = location.from_args(args.out, args.storage_options)
    check_out(args.out)
    if args.workers < 0:
        raise CaptureError(f"--workers {args.workers} must be 0 (no Ray) or more")
    console.check_output_option(args.output, CaptureError)  # before any work, not after it
    from moe_spec.capture.naming import default_run
    source = models.check_available(settings.model)
    run = args.run = default_run(settings, args.out, source.name) if args.run is None else args.run
    try:
        check_name(run, "--run")
    except InvalidName as exc:
        raise CaptureError(str(exc)) from None
    check_budget(settings, source.name)
    if not benchmarks.load(settings.bench, root=args.benchmarks, offset=settings.offset,
                           limit=settings.limit):
        raise CaptureError(f"no prompts in {settings.bench} at offset {settings.offset}")
    if args.ray_address:
        check_cluster(args.ray_address)
    if settings.calibration:
        try:
            found = Catalog(args.out).runs(model=source.name, names=list(settings.calibration))
        except CatalogError as exc:
            found, why = [], f" ({exc})"
        else:
            why = ""
        missing = sorted(set(settings.calibration) - {r.name for r in found})
        if missing:
            raise CaptureError(f"--calibration run(s) {', '.join(missing)} not found complete "
                               f"under {location.display(args.out)} for {source.name}{why}; "
                               "capture them first (--role calibration) or name existing runs")
        if not args.allow_evaluation_calibration and any(r.role == "evaluation" for r in found):
            from moe_spec.policy.calibration import evaluation_calibration
            raise CaptureError(evaluation_calibration(found))
    check_not_being_written(args.out, source.name, settings.bench, run)


def check_out(out) -> None:
    """A local ``--out`` must be a folder or a path where one can be made: never a regular
    file, a FIFO, a device or a socket, nor a symbolic link to nothing (or under one)."""
    import os
    import stat
    from pathlib import Path
    if location.is_remote(out):
        return
    path = Path(out)
    for at in (path, *path.absolute().parents):
        if at.is_symlink() and not at.exists():
            raise CaptureError(f"--out {path}: {at} is a symbolic link to {os.readlink(at)}, "
                               "which does not exist; create the link's target or choose a "
                               "writable --out")
        try:
            mode = at.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # made by the run (or under a file: said where that file is found)
        except OSError as exc:
            raise CaptureError(f"--out {path}: cannot use {at} ({exc.strerror or exc}); "
                               "choose another --out") from None
        if stat.S_ISDIR(mode):
            return
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or \
            stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "a file"
        where = "" if at == path or at == path.absolute() else f" ({at} is {kind})"
        raise CaptureError(f"--out {path} is {'under ' if where else ''}{kind}, not a folder"
                           f"{where}; choose a writable --out (a folder for the traces)")


def check_budget(settings: CaptureSettings, model: str) -> None:
    """``--budget`` within the model's N routed experts (and at least its top-k under
    substitution), read from its config.json without loading it; a model whose config is not
    at hand is checked where it loads."""
    if settings.budget is None:
        return
    shape = models.expert_shape(models.read_config(settings.model))
    if shape is None:
        return
    n, k = shape
    low = k if settings.coverage == "substitution" else 1
    if not low <= settings.budget <= n:
        raise CaptureError(f"--budget {settings.budget} is out of range for {model}: use "
                           f"{low}..{n} ({n} experts, top-{k}, {settings.coverage})")


def check_cluster(address: str) -> None:
    """``--ray-address``: Ray installed, and a Ray cluster answering there (within seconds)."""
    import importlib.util

    from moe_spec import cluster
    if importlib.util.find_spec("ray") is None:
        raise cluster.ClusterError("--workers / --ray-address need Ray: pip install -e .[ray]")
    cluster.check_reachable(address)


def check_not_being_written(out, model: str, bench: str, run: str) -> None:
    """Refuse a run whose lock another capture holds right now: take it without waiting and
    let it go (the run's writer takes it again once the model is loaded). A run with no folder
    (no lease object, on a store) has no writer. On a store, a well-formed lease that expires
    within one lease lifetime is watched until it does: renewed, its writer is alive (refused);
    not, it was a killed writer's (taken over, as the run's writer would)."""
    from moe_spec.catalog import CatalogError
    from moe_spec.catalog.writer import RunWriter
    writer = RunWriter(out, model, bench, run)
    folder = writer.table_dir("runs")
    try:
        if location.is_remote(folder):
            if not (folder / ".lock").exists():
                return
            _watch_lease(location.Lease(folder / ".lock"))
        elif not folder.is_dir():
            return
        writer.lock()
    except CatalogError as exc:
        raise CaptureError(str(exc)) from None
    except OSError:
        return  # an unreadable folder or store: said where the run is written
    finally:
        writer.close()


def _watch_lease(lease, poll: float = 0.25) -> None:
    """Return once the lease object is renewed, gone, or expired; at once where it is
    malformed or expires later than one lease lifetime from now."""
    import time
    state = lease.state()
    if state is None or state[2] is not None or state[1] > time.time() + lease.seconds:
        return
    while time.time() < state[1]:
        time.sleep(poll)
        now = lease.state()
        if now is None or now[0] != state[0]:
            return


def planned(args) -> list[tuple[CaptureSettings, argparse.Namespace]]:
    """One (settings, options) per benchmark of ``--bench a,b,…``, each checked before any
    capture starts (:func:`preflight`)."""
    names = [b.strip() for b in str(args.bench).split(",") if b.strip()]
    if not names or len(set(names)) < len(names):
        raise CaptureError(f"--bench {args.bench!r}: name each benchmark once, comma-separated")
    found = []
    for name in names:
        mine = copy.copy(args)
        mine.bench = name
        settings = settings_from(mine)
        preflight(settings, mine)
        found.append((settings, mine))
    return found


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        plan = planned(args)
    except UserError as exc:
        return fail("capture", exc)
    threads = console.threads.apply(args.threads)  # before torch and transformers start pools

    from moe_spec.capture.run import capture_run
    models.quiet_transformers()
    done = []
    for settings, mine in plan:
        try:
            summary = capture_run(settings, mine.out, mine.run, role=mine.role,
                                  benchmarks_root=mine.benchmarks, progress=not mine.no_progress,
                                  workers=mine.workers, ray_address=mine.ray_address,
                                  allow_evaluation_calibration=mine.allow_evaluation_calibration)
        except (UserError, ValueError) as exc:  # ValueError: a library's refusal, in one line
            return fail("capture", exc)
        except KeyboardInterrupt:
            print("capture: interrupted; rerun the same command to resume", file=sys.stderr)
            return 130
        print_summary(summary)
        done.append({"tool": "capture", **dataclasses.asdict(summary), "role": mine.role,
                     "threads": threads, "settings": dataclasses.asdict(settings)})
    try:  # one capture: its summary; several: {"tool": "capture", "captures": [...]}
        console.write_json(args.output, done[0] if len(done) == 1 else
                           {"tool": "capture", "captures": done})
    except OSError as exc:
        return fail("capture", f"cannot write --output {args.output}: {exc.strerror or exc}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
