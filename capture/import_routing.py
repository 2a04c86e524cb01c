"""``import-routing``: routing collected by a serving engine (vLLM, SGLang, Megatron-LM,
llama.cpp) as a routing-only run of the catalog.

    facts   = the model's N, k, layer map, shared experts (its config.json alone)
    refuse what can be refused before reading (names, the run, the source, the output)
    for each piece the format's reader streams (ids checked: shape, range, sentinels, layers):
        buffer its rows; every --part-rows token-layers: a routing_ids part (and the sequences
        rows of the requests completed so far)
    commit the run (the manifest lists every part), or, on any fault, remove all of it

Memory is bounded by one part and one source record, whatever the source's size. The run holds
ids per (request, token, MoE layer) and what the source says beside them (request ids, token
ids, timestamps, steps); its manifest says ``kind: routing-only`` and the source's format and
version. Replay refuses it; the ids-only analyses read it (:mod:`analysis.ids`).
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moe_spec import console
from moe_spec.capture.engines import FORMATS, Format
from moe_spec.capture.engines.base import ModelFacts, Piece, ReadOptions, SourceError
from moe_spec.catalog import CatalogError, InvalidName, check_name, location, schema
from moe_spec.catalog.tokens import BATCHINGS, DEFAULT_BATCH
from moe_spec.catalog.writer import RunWriter, list_column
from moe_spec.errors import UserError, fail

EXAMPLES = """
import-routing --format sglang responses.jsonl --model Qwen/Qwen3-30B-A3B --bench chat
import-routing --format vllm out.jsonl --model data/models/tiny-olmoe --bench mbpp --run vllm-a
import-routing --format megatron trace_dir --model deepseek-v3 --bench train --tokens all
import-routing --format megatron trace_dir --model olmoe --bench train --microbatches-per-step 4 --merge-ranks
import-routing --format vllm turn2.jsonl --model olmoe --bench agent --prompt-start 812
import-routing --format sglang exported.jsonl --model olmoe --bench rt --prompt-start prompt
import-routing --format llamacpp moe_trace.csv --model tiny-qwen3-moe --bench demo --batching virtual
import-routing --format sglang big.jsonl --model olmoe --bench prod --out s3://bucket/traces
"""
PART_ROWS = 1_000_000  # token-layers a routing_ids part holds (~16 MB of ids at k = 8)


class ImportRefused(UserError, ValueError):
    """An import refused before or while reading; one line."""


@dataclass
class ImportSummary:
    run: str
    model: str
    bench: str
    format: str
    source: str
    requests: int = 0
    tokens: int = 0  # decode tokens
    prompt_rows: int = 0  # prompt tokens kept (--tokens all)
    token_layers: int = 0
    parts: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time (both threads) during the import
    token_layers_per_s: float = 0.0
    token_layers_per_cpu_s: float = 0.0  # what a free core does (wall time shares the CPU)
    peak_rss_mib: float = 0.0
    skipped: dict = field(default_factory=dict)
    root: str = ""


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


class _Parts:
    """The rows waiting for the next part, and the parts written so far: each part is encoded
    and written on a background thread (Parquet encoding releases the GIL) while the source is
    parsed, at most two parts in flight (bounded memory)."""

    def __init__(self, writer: RunWriter, facts: ModelFacts, part_rows: int):
        from moe_spec.capture.background import BackgroundWriter
        self.writer, self.facts, self.part_rows = writer, facts, part_rows
        self.background = BackgroundWriter(max_pending=2)
        self.layers = np.asarray(facts.moe_layers, np.int16)
        self.tokens: list[tuple] = []  # (prompt_index, request id, Piece)
        self.rows = 0  # token-layers waiting
        self.sequences: list[dict] = []
        self.chunks: dict[int, int] = {}  # first request of a part -> parts named by it
        self.parts = 0

    def add(self, index: int, rid: str, piece: Piece) -> None:
        if len(piece.token):
            self.tokens.append((index, rid, piece))
            self.rows += len(piece.token) * len(self.layers)
        if self.rows >= self.part_rows:
            self.flush()

    def done(self, row: dict) -> None:
        self.sequences.append(row)

    def flush(self) -> None:
        if self.tokens:
            self._routing()
        if self.sequences:
            first = self.sequences[0]["prompt_index"]
            self.background.submit(self.writer.write_part, "sequences", first, 0,
                                   pa.Table.from_pylist(self.sequences,
                                                        schema=schema.TABLES["sequences"]))
            self.sequences = []
            self.parts += 1

    def finish(self) -> None:
        """Every part written (a failure on the writer raised here, its cause named)."""
        from moe_spec.capture.background import WriterFailed
        try:
            self.background.drain()
        except WriterFailed as exc:
            raise exc.__cause__ from None
        finally:
            self.background.close()

    def abort(self) -> None:
        """Stop writing (what was queued still lands: the caller removes the run after)."""
        self.background.close()

    def _routing(self) -> None:
        L, k = len(self.layers), self.facts.top_k
        pieces = self.tokens
        sizes = np.array([len(p.token) for _, _, p in pieces])
        t = int(sizes.sum())
        index = np.repeat(np.array([i for i, _, _ in pieces], np.int32), sizes)
        names = pa.array([r for _, r, _ in pieces], pa.string())
        which = np.repeat(np.arange(len(pieces), dtype=np.int32), sizes * L)
        ids = np.concatenate([p.ids for _, _, p in pieces]).reshape(t * L, k)
        token = np.concatenate([p.token for _, _, p in pieces]).astype(np.int32)
        steps = [p.step for _, _, p in pieces]
        step = None if all(s is None for s in steps) else np.concatenate(
            [s if s is not None else np.full(len(p.token), -1) for s, (_, _, p)
             in zip(steps, pieces)])
        stamps = [p.timestamp for _, _, p in pieces]
        table = pa.Table.from_arrays([
            pa.array(np.repeat(index, L)),
            pc.take(names, pa.array(which)),
            pa.array(np.repeat(token, L)),
            pa.array(np.tile(self.layers, t)),
            list_column(ids, pa.int16()),
            pa.nulls(t * L, pa.int32()) if step is None else
            pa.array(np.repeat(step.astype(np.int32), L), mask=np.repeat(step < 0, L)),
            pa.nulls(t * L, pa.float64()) if all(s is None for s in stamps) else
            pa.array(np.repeat(np.array([np.nan if s is None else s for s in stamps]),
                               sizes * L), mask=np.repeat(np.array([s is None for s in stamps]),
                                                          sizes * L)),
        ], schema=schema.ROUTING_IDS_SCHEMA)
        first = int(index[0])
        chunk = self.chunks.get(first, 0)
        if chunk > 9999:
            raise ImportRefused(f"request {first} spans more than 10,000 parts; raise "
                                "--part-rows")
        self.chunks[first] = chunk + 1
        self.background.submit(self.writer.write_part, schema.ROUTING_IDS, first, chunk, table)
        self.tokens, self.rows = [], 0
        self.parts += 1


def read_facts(model: str) -> ModelFacts:
    from moe_spec.capture.engines.model import ModelFactsError, model_facts
    try:
        return model_facts(model)
    except ModelFactsError as exc:
        raise ImportRefused(str(exc)) from None


def manifest_of(fmt: Format, source: Path, facts: ModelFacts, bench: str, run: str, role: str,
                options: ReadOptions, batching: str, batch_size: int) -> dict:
    import numpy
    return dict(
        model=facts.name, model_location=facts.location, model_type=facts.model_type,
        bench=bench, run=run, role=role, kind=schema.ROUTING_ONLY,
        source=dict(format=fmt.name, engine=fmt.engine, version=fmt.version,
                    path=str(source), bytes=source_bytes(source)),
        settings=dict(kind=schema.ROUTING_ONLY, source_format=fmt.name, source_version=fmt.version,
                      tokens=options.tokens, batching=batching, virtual_batch_size=batch_size,
                      recorded_passes=fmt.recorded_passes,
                      drop_shared_slot=options.drop_shared_slot,
                      prompt_start=options.prompt_start,
                      microbatches_per_step=options.microbatches,
                      layer_base=options.layer_base, merge_ranks=options.merge_ranks),
        num_experts=facts.num_experts, top_k=facts.top_k, num_layers=facts.num_layers,
        moe_layers=list(facts.moe_layers), shared_experts=facts.shared_experts,
        hidden_size=facts.hidden_size, draft=None, dtype=None, device=None,
        versions=dict(pyarrow=pa.__version__, numpy=numpy.__version__),
        schema_version=schema.SCHEMA_VERSION)


def source_bytes(source: Path) -> int:
    if source.is_dir():
        return sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    return source.stat().st_size


def check_source(source: Path, fmt: Format) -> None:
    if not source.exists():
        raise ImportRefused(f"SOURCE {source} does not exist")
    if not (source.is_file() or source.is_dir()):
        raise ImportRefused(f"SOURCE {source} is not a file or a folder")
    try:
        if source.is_file():
            with open(source, "rb") as f:
                f.read(1)
    except OSError as exc:
        raise ImportRefused(f"cannot read SOURCE {source}: {exc.strerror or exc}") from None
    if source.is_file() and source.stat().st_size == 0:
        raise ImportRefused(f"SOURCE {source} is empty")


def check_run_free(out, model: str, bench: str, run: str) -> None:
    """An import never writes over a run: a committed one, or a capture, is refused; a killed
    import's leftovers (a routing-only run still running) are replaced."""
    writer = RunWriter(out, model, bench, run, kind=schema.ROUTING_ONLY)
    try:
        old = writer.read_manifest()
    except CatalogError as exc:
        raise ImportRefused(str(exc)) from None
    if old is None:
        return
    if old.get("status") == "complete":
        raise ImportRefused(f"run {run!r} of {model} / {bench} exists under "
                            f"{location.display(writer.root)}; pass another --run (an import "
                            "never replaces a committed run)")
    if old.get("kind") != schema.ROUTING_ONLY:
        raise ImportRefused(f"run {run!r} of {model} / {bench} is a capture in progress; pass "
                            "another --run")


def import_routing(fmt: Format, source: Path, facts: ModelFacts, out, bench: str, run: str, *,
                   role: str = "evaluation", options: ReadOptions = ReadOptions(),
                   batching: str = "auto", batch_size: int = DEFAULT_BATCH,
                   part_rows: int = PART_ROWS, progress: bool = True) -> ImportSummary:
    """Stream ``source`` into the routing-only run ``run``; commit it, or leave nothing."""
    start, cpu_start = time.perf_counter(), cpu_seconds()
    out = location.root(out)
    check_run_free(out, facts.name, bench, run)
    kind = "recorded" if batching == "recorded" or (batching == "auto" and
                                                    fmt.recorded_passes) else "virtual"
    if kind == "recorded" and not fmt.recorded_passes:
        raise ImportRefused(f"--batching recorded: {fmt.engine}'s format records no forward "
                            "passes; use virtual (b requests at the same decode step)")
    summary = ImportSummary(run, facts.name, bench, fmt.name, str(source), root=str(out))
    total = source_bytes(source)
    writer = RunWriter(out, facts.name, bench, run, kind=schema.ROUTING_ONLY)
    bar = parts = None
    try:
        manifest, _ = writer.start(manifest_of(fmt, source, facts, bench, run, role, options,
                                               kind, batch_size))
        parts = _Parts(writer, facts, part_rows)
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"import {fmt.name}",
                       file=sys.stderr, dynamic_ncols=True)

        def advance(n: int) -> None:
            summary.bytes_read += n
            if bar is not None:
                bar.update(n)

        index = _stream(fmt, source, facts, options, parts, summary, advance)
        if index < 0:
            raise SourceError(f"{source} holds no routing record")
        if not summary.token_layers:
            raise SourceError(f"{source} routes no token (every request empty"
                              + (f"; {', '.join(f'{v} {k}' for k, v in summary.skipped.items())}"
                                 if summary.skipped else "") + "): nothing to import")
        parts.flush()
        parts.finish()
        summary.requests = index + 1
        summary.parts = parts.parts
        writer.finish({**manifest, "prompts_total": summary.requests,
                       "prompts_done": summary.requests, "tokens": summary.tokens,
                       "token_layers": summary.token_layers, "skipped": summary.skipped})
        summary.bytes_written = writer.bytes_written()
    except BaseException:
        if bar is not None:
            bar.close()
            bar = None
        if parts is not None:
            parts.abort()
        writer.close()
        writer.abandon()
        raise
    finally:
        if bar is not None:
            bar.close()
        writer.close()
    summary.seconds = time.perf_counter() - start
    summary.cpu_seconds = cpu_seconds() - cpu_start
    summary.token_layers_per_s = summary.token_layers / max(summary.seconds, 1e-9)
    summary.token_layers_per_cpu_s = summary.token_layers / max(summary.cpu_seconds, 1e-9)
    summary.peak_rss_mib = peak_rss_mib()
    return summary


def _stream(fmt: Format, source: Path, facts: ModelFacts, options: ReadOptions, parts: _Parts,
            summary: ImportSummary, advance) -> int:
    """Every record of ``source`` into ``parts``, request by request (one ``sequences`` row per
    request when its last piece arrives); the last prompt index (−1: none)."""
    index, current, row = -1, None, None
    for piece in fmt.read(source, facts, options, advance, skipped=summary.skipped):
        if current is None or current != piece.request:  # a new request
            if current is not None:
                raise SourceError(f"{source}: the routing of request {current} stops before "
                                  "its end")
            index += 1
            current = piece.request
            row = dict(prompt_index=index, prompt_id=current,
                       prompt_token_ids=piece.prompt_token_ids,
                       prompt_tokens=piece.prompt_tokens
                       if piece.prompt_token_ids is None else None,
                       output_token_ids=piece.output_token_ids, steps=None,
                       mean_accepted_length=None, wall_seconds=piece.seconds,
                       stop_reason=piece.finish_reason)
        decode = int((piece.token >= 0).sum())
        summary.tokens += decode
        summary.prompt_rows += len(piece.token) - decode
        summary.token_layers += len(piece.token) * len(facts.moe_layers)
        parts.add(index, current, piece)
        if piece.last:
            parts.done(row)
            current = None
    return index


# --- the command line ---------------------------------------------------------------------------
def parser() -> console.ArgumentParser:
    p = console.ArgumentParser(
        prog="import-routing", examples=EXAMPLES,
        description="Import per-token expert routing collected by a serving engine (vLLM, "
                    "SGLang, Megatron-LM, llama.cpp) as a routing-only run: top-k ids per "
                    "(request, token, MoE layer), checked against the model's config, streamed "
                    "(bounded memory), committed like a capture. The ids-only analyses (heavy "
                    "tails and coverage by routed-token counts, co-activation, activation "
                    "growth, unions per batch, truncation coverage) read it; replay refuses it. "
                    "Formats: " + "; ".join(f"{f.name}: {f.engine} {f.flag}"
                                            for f in FORMATS.values()))
    p.add_argument("source", type=Path, metavar="SOURCE",
                   help="the engine's output: " + "; ".join(f"{f.name}: {f.source}"
                                                           for f in FORMATS.values()))
    p.add_argument("--format", required=True, choices=list(FORMATS),
                   help="the engine that wrote SOURCE")
    p.add_argument("--model", required=True,
                   help="the served model: an alias, a hub id in the local cache or a folder "
                        "with its config.json (N, k, layer map and shared experts come from it; "
                        "no weights are read)")
    p.add_argument("--bench", required=True, help="a name for the workload (a path component)")
    p.add_argument("--run", default=None,
                   help="run name (default: <format>-<source name>)")
    p.add_argument("--out", default="traces", help="traces root: a folder or s3://bucket/prefix")
    location.add_storage_options_argument(p)
    p.add_argument("--role", default="evaluation", choices=schema.ROLES,
                   help="what the run is for (calibration: the static ranking's counts)")
    p.add_argument("--tokens", default="decode", choices=("decode", "all"),
                   help="decode: the generated tokens' forwards; all: the prompt's rows too "
                        "(token < 0), where the source has them")
    p.add_argument("--batching", default="auto", choices=BATCHINGS,
                   help="batch passes the analyses use: recorded (the source's forward passes: "
                        "Megatron steps, llama.cpp ubatches), virtual (--batch-size consecutive "
                        "requests at the same decode step), auto (recorded where the format has "
                        "them)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help="b of virtual batches")
    p.add_argument("--drop-shared-slot", action="store_true",
                   help="drop fused shared-expert slots (ids N…N+s−1, SGLang "
                        "--enable-shared-experts-fusion) instead of refusing them")
    p.add_argument("--prompt-start", default="0", metavar="N|prompt|auto",
                   help="vllm, sglang: where each response's rows start (vLLM's request field "
                        "routed_experts_prompt_start, SGLang's routed_experts_start_len; no "
                        "response echoes it): N, 'prompt' (decode rows only, what "
                        "export-routing writes) or 'auto' (from each response's row count); "
                        "default 0")
    p.add_argument("--microbatches-per-step", type=int, default=1, metavar="M",
                   help="megatron: microbatches per training iteration (every microbatch's "
                        "router call is stamped with the iteration); default 1")
    p.add_argument("--layer-base", type=int, default=0, choices=(0, 1),
                   help="megatron: 0 = the hook path (decoder.layers.<i>), 1 = record_indices "
                        "(inference with --moe-enable-routing-replay: layer_number, 1-based, "
                        "global across pipeline stages); default 0")
    p.add_argument("--merge-ranks", action="store_true",
                   help="megatron: read a folder's rank files as one stream, each step's "
                        "records concatenated in rank order (tensor-parallel ranks under "
                        "sequence parallelism; pipeline stages with global layer numbers)")
    p.add_argument("--part-rows", type=int, default=PART_ROWS,
                   help="token-layers per routing_ids part (bounds memory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_output_option()
    return p


def default_run(fmt: str, source: Path) -> str:
    import re
    stem = source.name.split(".")[0] if source.name else "source"
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{fmt}-{stem}")[:80].strip("-.") or fmt


def preflight(args) -> tuple[Format, ModelFacts]:
    """Everything refusable before a byte of the source is read."""
    fmt = FORMATS[args.format]
    args.out = location.from_args(args.out, args.storage_options)
    if args.batch_size < 1:
        raise ImportRefused(f"--batch-size {args.batch_size} must be at least 1")
    if not 1_000 <= args.part_rows <= 100_000_000:
        raise ImportRefused(f"--part-rows {args.part_rows} must be within 1000..100000000")
    console.check_output_option(args.output, ImportRefused)
    args.run = args.run or default_run(fmt.name, args.source)
    try:
        check_name(args.run, "--run")
        check_name(args.bench, "--bench")
    except InvalidName as exc:
        raise ImportRefused(str(exc)) from None
    args.read_options = read_options(args, fmt)
    check_source(args.source, fmt)
    if args.batching == "recorded" and not fmt.recorded_passes:
        raise ImportRefused(f"--batching recorded: {fmt.engine}'s format records no forward "
                            "passes; use virtual (b requests at the same decode step) or auto")
    if not location.is_remote(args.out):
        from moe_spec.capture.plan import check_out
        try:
            check_out(args.out)
        except UserError as exc:
            raise ImportRefused(str(exc)) from None
    facts = read_facts(args.model)
    check_run_free(args.out, facts.name, args.bench, args.run)
    return fmt, facts


def read_options(args, fmt: Format) -> ReadOptions:
    """The reading options as given, each refused in one line where the format does not read
    it or its value is out of range."""
    from moe_spec.capture.engines.base import parse_prompt_start
    try:
        start = parse_prompt_start(args.prompt_start)
    except ValueError as exc:
        raise ImportRefused(str(exc)) from None
    if not 1 <= args.microbatches_per_step <= 4096:
        raise ImportRefused(f"--microbatches-per-step {args.microbatches_per_step} must be "
                            "within 1 … 4096")
    options = ReadOptions(tokens=args.tokens, drop_shared_slot=args.drop_shared_slot,
                          prompt_start=start, microbatches=args.microbatches_per_step,
                          layer_base=args.layer_base, merge_ranks=args.merge_ranks)
    flags = dict(prompt_start="--prompt-start", microbatches="--microbatches-per-step",
                 layer_base="--layer-base", merge_ranks="--merge-ranks")
    for name, flag in flags.items():
        if getattr(options, name) != getattr(ReadOptions(), name) and name not in fmt.options:
            readers = [f.name for f in FORMATS.values() if name in f.options]
            raise ImportRefused(f"{flag} applies to {', '.join(readers)}, not {fmt.name}")
    return options


def print_summary(s: ImportSummary, facts: ModelFacts) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"import-routing {s.format} → {s.model} / {s.bench} / run={s.run}",
              show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = [("kind", "routing-only (top-k ids; replay refuses it)"),
            ("model", facts.describe()),
            ("requests", str(s.requests)),
            ("decode tokens", str(s.tokens) + (f" (+ {s.prompt_rows} prompt rows)"
                                               if s.prompt_rows else "")),
            ("token-layers", f"{s.token_layers:,}"),
            ("throughput", f"{s.token_layers_per_s:,.0f} token-layers/s "
                           f"({s.bytes_read / 2**20 / max(s.seconds, 1e-9):.1f} MiB/s of source; "
                           f"{s.token_layers_per_cpu_s:,.0f} per CPU-second)"),
            ("peak RSS", f"{s.peak_rss_mib:.0f} MiB"),
            ("written", f"{s.parts} part(s), {s.bytes_written / 2**20:.1f} MiB"),
            ("wall time", f"{s.seconds:.1f} s")]
    rows += [(k, str(v)) for k, v in s.skipped.items()]
    for k, v in rows:
        t.add_row(k, v)
    Console(stderr=False).print(t)
    print("look at it:\n"
          f"  {console.command('query')} --traces {s.root} \"SELECT run, kind, source_format, "
          "prompts FROM runs\"\n"
          f"  {console.command('report')} --traces {s.root} --out reports")


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        fmt, facts = preflight(args)
        summary = import_routing(
            fmt, args.source, facts, args.out, args.bench, args.run, role=args.role,
            options=args.read_options,
            batching=args.batching, batch_size=args.batch_size, part_rows=args.part_rows,
            progress=not args.no_progress)
    except (UserError, ValueError) as exc:  # ValueError: a library's refusal, in one line too
        return fail("import-routing", exc)
    except OSError as exc:
        where = exc.filename or location.display(args.out)
        return fail("import-routing", f"{where}: {exc.strerror or exc}; nothing was committed")
    except KeyboardInterrupt:
        print("import-routing: interrupted; nothing was committed", file=sys.stderr)
        return 130
    print_summary(summary, facts)
    try:
        console.write_json(args.output, {"tool": "import-routing",
                                         **dataclasses.asdict(summary),
                                         "model_facts": dataclasses.asdict(facts)})
    except OSError as exc:
        return fail("import-routing", f"cannot write --output {args.output}: "
                    f"{exc.strerror or exc}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
