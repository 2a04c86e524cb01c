"""``export-routing``: a run's decode-token routing in a serving engine's format.

Any complete run, captured or imported: its decode tokens (:mod:`catalog.tokens`: a capture's
accepted paths in output order) are written as vLLM or SGLang responses, a Megatron-LM router
trace or llama.cpp moe-trace CSVs, so a user can check ``import-routing`` against what their
engine writes, and a capture round-trips: capture → export → import gives the same ids and the
same ids-only figures (``tests/test_import_routing.py``).

Each format writes only fields its engine writes, with the values the run has (prompt lengths
included). A capture records no prefill routing: vLLM's and SGLang's records hold the generated
tokens' rows only, what a request whose prompt start (``routed_experts_prompt_start`` /
``routed_experts_start_len``, never echoed) was its prompt's length gets: import them with
``--prompt-start prompt``; llama.cpp's CSVs are one-token ubatches. Megatron's steps are the run's batch
passes: recorded ones where it has them, else virtual batches of ``--batch-size`` consecutive
requests at the same decode position.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from moe_spec import console
from moe_spec.capture.engines import FORMATS
from moe_spec.capture.engines.model import facts_of_run
from moe_spec.catalog import Catalog, CatalogError, atomic, location, tokens
from moe_spec.errors import UserError, fail

EXAMPLES = """
export-routing --format sglang --run demo-eval out.jsonl
export-routing --format vllm --run demo-eval --traces traces out.jsonl
export-routing --format megatron --run demo-eval trace_dir --batch-size 4
export-routing --format llamacpp --run demo-eval csv_dir --force
"""


class ExportRefused(UserError, ValueError):
    """An export refused; one line."""


@dataclass
class ExportSummary:
    run: str
    format: str
    dest: str
    files: list[str] = field(default_factory=list)
    records: int = 0
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0


def find_run(traces, name: str, model: str | None = None, bench: str | None = None):
    found = Catalog(traces).runs(model=model, bench=bench, names=[name], kinds=None)
    if not found:
        raise ExportRefused(f"no complete run {name!r} under {location.display(traces)}"
                            + (f" for {model}" if model else "") + (f" / {bench}" if bench else ""))
    if len(found) > 1:
        raise ExportRefused(f"{len(found)} runs are named {name!r} ("
                            + ", ".join(f"{r.model} / {r.bench}" for r in found)
                            + "); pick one with --model and --bench")
    return found[0]


def _counted(requests, summary: ExportSummary):
    for req in requests:
        t = req.tokens
        if len(t) and (t.token != np.arange(len(t))).any():
            raise ExportRefused(f"request {req.prompt_id} of run {summary.run}: its decode tokens "
                                "are not 0, 1, … (gaps): the formats hold consecutive tokens")
        summary.requests += 1
        summary.tokens += len(t)
        yield req


def _passes(run, batch_size: int | None, summary: ExportSummary):
    """(step, ids) of every batch pass, numbered 0, 1, … in order."""
    for block in tokens.passes(run, batch_size=batch_size):
        for p in range(len(block)):
            ids = block.ids[block.bounds[p]:block.bounds[p + 1]]
            summary.tokens += len(ids)
            summary.records += 1
            yield summary.records - 1, ids


MARKER = ".export-routing.json"  # in every folder export-routing writes: what --force may replace


def prepare_dest(dest: Path, folder: bool, force: bool, traces=None) -> Path:
    """A file or folder that may be written: never a link, device or FIFO, nor inside the
    traces root; an existing one only with ``force``, and then only one this command wrote: a
    folder holding :data:`MARKER` (never ``.``, ``..`` or a folder holding traces), a file of
    JSON lines (:func:`catalog.atomic.check_replaceable`)."""
    if dest.is_symlink():
        raise ExportRefused(f"DEST {dest} is a symbolic link; give a real path")
    atomic.check_outside(dest, traces, "DEST")
    if folder:
        if dest.exists() and not dest.is_dir():
            raise ExportRefused(f"DEST {dest} is a file; this format writes a folder")
        atomic.check_replaceable(dest, MARKER)  # before suggesting --force
        if dest.is_dir() and any(dest.iterdir()) and not force:
            raise ExportRefused(f"DEST {dest} is a folder that is not empty; pass --force to "
                                "replace it")
        return dest
    if dest.exists() and not dest.is_file():
        raise ExportRefused(f"DEST {dest} is not a regular file; this format writes one .jsonl")
    if dest.exists() and not force:
        raise ExportRefused(f"DEST {dest} exists; pass --force to replace it")
    if dest.exists() and not _json_lines(dest):
        raise ExportRefused(f"DEST {dest} is not a file this command wrote (not JSON lines); "
                            "--force replaces only its own output: give a new name")
    return dest


def _json_lines(path: Path) -> bool:
    """Whether ``path`` (a regular file) is empty or starts with a JSON object on one line, as
    every file export-routing writes does."""
    with open(path, "rb") as f:
        head = f.readline(1 << 20)
    if not head:
        return True
    try:
        return isinstance(json.loads(head), dict)
    except ValueError:
        return False


def export_routing(run, fmt_name: str, dest: Path, *, batch_size: int | None = None,
                   force: bool = False, traces=None) -> ExportSummary:
    fmt = FORMATS[fmt_name]
    start = time.perf_counter()
    dest = prepare_dest(Path(dest), fmt.dest_is_folder, force, traces)
    facts = facts_of_run(run.manifest)
    summary = ExportSummary(run.name, fmt.name, str(dest))
    with atomic.staged(dest) as target:  # a fresh private folder beside DEST, then renamed
        if fmt.writes_passes:
            files, _ = fmt.write(_passes(run, batch_size, summary), target, facts)
            summary.requests = run.manifest.get("prompts_total", 0)
        else:
            files, summary.records = fmt.write(_counted(tokens.requests(run), summary), target,
                                               facts)
        if fmt.dest_is_folder:
            (target / MARKER).write_text(json.dumps({"tool": "export-routing",
                                                     "format": fmt.name, "run": run.name}) + "\n")
            files = [dest / f.relative_to(target) for f in files]
        else:
            files = [dest]
    summary.files = [str(f) for f in files]
    summary.seconds = time.perf_counter() - start
    return summary


def parser() -> console.ArgumentParser:
    p = console.ArgumentParser(
        prog="export-routing", examples=EXAMPLES,
        description="Write a run's decode-token routing (a capture's accepted tokens, or an "
                    "imported run's) in a serving engine's format, to check import-routing "
                    "against an engine or round-trip a capture. Formats: "
                    + "; ".join(f"{f.name}: {f.engine}" for f in FORMATS.values()))
    p.add_argument("dest", type=Path, metavar="DEST",
                   help="vllm, sglang: a .jsonl file; megatron, llamacpp: a folder")
    p.add_argument("--format", required=True, choices=list(FORMATS), help="the engine format")
    p.add_argument("--run", required=True, help="the run to export")
    p.add_argument("--model", default=None, help="the run's model, where two runs share its name")
    p.add_argument("--bench", default=None, help="the run's benchmark, likewise")
    p.add_argument("--traces", default="traces", help="traces root: a folder or "
                                                      "s3://bucket/prefix")
    location.add_storage_options_argument(p)
    p.add_argument("--batch-size", type=int, default=None,
                   help="megatron: b of the virtual batches its steps are made of (runs without "
                        "recorded passes; default: the run's, else 8)")
    p.add_argument("--force", action="store_true", help="replace an existing DEST")
    p.add_output_option()
    return p


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.batch_size is not None and args.batch_size < 1:
            raise ExportRefused(f"--batch-size {args.batch_size} must be at least 1")
        traces = location.from_args(args.traces, args.storage_options)
        console.check_output_option(args.output, ExportRefused, traces=traces,
                                    differs={"DEST": args.dest})
        run = find_run(traces, args.run, args.model, args.bench)
        summary = export_routing(run, args.format, args.dest, batch_size=args.batch_size,
                                 force=args.force, traces=traces)
    except (UserError, ValueError) as exc:
        return fail("export-routing", exc)
    except CatalogError as exc:
        return fail("export-routing", exc)
    except OSError as exc:
        return fail("export-routing", f"{exc.filename or args.dest}: {exc.strerror or exc}")
    unit = "batch pass(es), a record per MoE layer each" if FORMATS[args.format].writes_passes \
        else "request record(s)"
    print(f"export-routing: {summary.requests} request(s), {summary.tokens} decode token(s) of "
          f"run {summary.run} as {summary.format}: {summary.records} {unit} in "
          f"{summary.dest} ({summary.seconds:.1f} s)")
    try:
        console.write_json(args.output, {"tool": "export-routing", **asdict(summary)})
    except OSError as exc:
        return fail("export-routing", f"cannot write --output {args.output}: "
                    f"{exc.strerror or exc}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
