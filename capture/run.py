"""The driver of a capture run: one lifecycle, whoever decodes the prompts.

    prompts  = load the benchmark's prompts; refuse what can be refused before the model loads
    answer a run that is complete with these settings from disk (the model never loads)
    executor = this process (:class:`LocalExecutor`) or Ray actors
               (:class:`capture.distributed.RayExecutor`); it loads the target(s) and says the
               manifest's fields
    writer   = create or resume the run (the manifest says running; it locks the run)
    for each prompt not yet complete, as the executor finishes it:
        its tables are written (``sequences`` last), the manifest records the progress
    mark the run complete (the ``runs`` row, then the manifest), summarise what is on disk
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
from tqdm import tqdm

from moe_spec.capture.background import BackgroundWriter, WriterFailed
from moe_spec.capture.naming import default_run
from moe_spec.capture.settings import CaptureError, CaptureSettings
from moe_spec.capture.target import Target, prompt_ids
from moe_spec.catalog import Catalog, CatalogError, InvalidName, check_name, location, schema
from moe_spec.catalog.writer import RunWriter, as_stored
from moe_spec.moe import models
from moe_spec.policy import rankings
from moe_spec.policy.calibration import evaluation_calibration
from moe_spec.tasks import benchmarks


def load_prompts(settings: CaptureSettings, benchmarks_root) -> list:
    prompts = benchmarks.load(settings.bench, root=benchmarks_root, offset=settings.offset,
                              limit=settings.limit)
    if not prompts:
        raise CaptureError(f"no prompts in {settings.bench} at offset {settings.offset}")
    return prompts


def check_run(run: str | None, role: str, settings: CaptureSettings, out=None) -> str:
    if run is None:
        run = default_run(settings, out, models.check_available(settings.model).name)
    try:
        check_name(run, "--run")
    except InvalidName as exc:
        raise CaptureError(str(exc)) from None
    if role not in schema.ROLES:
        raise CaptureError(f"--role {role!r} is not a role; use one of {', '.join(schema.ROLES)}")
    return run


def write_errors(out: Path):
    """One line for a failed write (the run keeps its complete prompts). Only an OSError is
    a problem of the disk; anything else the writer raised is named as it is."""
    def wrap(exc: BaseException) -> CaptureError:
        cause = (exc.__cause__ or exc) if isinstance(exc, WriterFailed) else exc
        if isinstance(cause, OSError):
            reason = cause.strerror or cause
            return CaptureError(f"cannot write to {out}: {reason}; the run keeps its complete "
                                "prompts: free space or choose another --out, then rerun to "
                                "resume")
        first = (str(cause).strip().splitlines() or [""])[0]
        return CaptureError(f"writing a prompt's tables under {out} failed: "
                            f"{type(cause).__name__}: {first or '(no message)'} (an error in "
                            "capture, not the disk); the run keeps its complete prompts, "
                            "rerun to resume")
    return wrap


def already_complete(settings: CaptureSettings, out: Path, run: str, role: str, prompts: list,
                     start: float) -> CaptureSummary | None:
    """The summary of a run that is complete with these settings, role and prompts (a rerun
    has nothing to do), read from disk without loading the model; else None."""
    try:
        model = models.resolve(settings.model).name
    except models.ModelError:
        return None  # said in one line where the model loads
    writer = RunWriter(out, model, settings.bench, run)
    try:
        old = writer.read_manifest()
    except CatalogError as exc:
        raise CaptureError(str(exc)) from exc
    if old is None or old.get("status") != "complete" or old.get("role") != role \
            or old.get("settings") != as_stored(settings.identity()) \
            or old.get("prompt_ids") != [p.prompt_id for p in prompts] \
            or len(writer.completed()) < len(prompts):
        return None
    return summarise(writer, model, settings.bench, run, len(prompts),
                     time.perf_counter() - start, 0.0)


def check_batching(settings: CaptureSettings, distributed) -> None:
    """What batched decoding does not do yet, refused in one line."""
    if settings.batch_size == 1:
        return
    if distributed:
        raise CaptureError("--batch-size with --workers/--ray-address is not supported yet; "
                           "batch within one process, or scale out with --batch-size 1")
    if settings.budget is not None and rankings.get(settings.ranking).stateful:
        raise CaptureError(f"--ranking {settings.ranking} keeps state per prompt, which a batch "
                           "of prompts does not have; use a stateless ranking with --batch-size")


def check_calibration_roles(settings: CaptureSettings, out: Path) -> None:
    """Refuse ``--calibration`` runs captured as evaluation runs (before the model loads);
    runs not found are reported where the statistics are collected."""
    if not settings.calibration:
        return
    try:
        model = models.resolve(settings.model).name
        found = Catalog(out).runs(model=model, names=list(settings.calibration))
    except (models.ModelError, CatalogError):
        return  # said in one line where the model loads / the statistics are collected
    problem = evaluation_calibration(found)
    if problem:
        raise CaptureError(problem)


def capture_run(settings: CaptureSettings, out: Path, run: str | None = None, *,
                role: str = "evaluation", benchmarks_root=None, progress: bool = True,
                record_tensors: bool = True, workers: int = 0,
                ray_address: str | None = None,
                allow_evaluation_calibration: bool = False) -> CaptureSummary:
    """Capture every prompt of the benchmark into ``out``/…/run=``run`` (resuming). With
    ``workers`` or ``ray_address`` the prompts are spread over Ray actors
    (:mod:`capture.distributed`). ``--calibration`` runs must have the calibration role
    unless ``allow_evaluation_calibration``."""
    start = time.perf_counter()
    run = check_run(run, role, settings, out)
    if not allow_evaluation_calibration:
        check_calibration_roles(settings, out)
    prompts = load_prompts(settings, benchmarks_root)
    check_batching(settings, workers or ray_address)
    done = already_complete(settings, out, run, role, prompts, start)
    if done is not None:  # nothing to capture: answered without loading the model
        return done
    if workers or ray_address:
        from moe_spec.capture.distributed import RayExecutor  # Ray is optional: loaded only for it
        executor = RayExecutor(settings, out, run, role, prompts, workers=workers,
                               ray_address=ray_address)
    else:
        executor = LocalExecutor(settings, out, run, role, prompts, record_tensors)
    return run_lifecycle(executor, settings, out, run, prompts, start, progress)


class Executor(Protocol):
    """Who decodes a run's prompts: this process or Ray actors."""

    label: str  # how the progress bar names it ("" for this process)

    def load(self) -> dict:
        """Load the target(s); the manifest's fields (:func:`capture.target.run_manifest`)."""

    def capture(self, todo: list[tuple[int, object]], writer: RunWriter,
                on_complete: Callable[[], None]) -> Iterator[tuple[int, int]]:
        """Decode and write every ``(index, prompt)`` of ``todo``; yields (trees, accepted
        tokens) of each prompt once its tables are written or queued. ``on_complete`` records
        the run's progress after a prompt's ``sequences`` part exists (the executor calls it
        where that part is written, or after the prompt's result came back)."""

    def close(self) -> None:
        """Release what :meth:`load` started (idempotent)."""


class LocalExecutor:
    """Every prompt in this process: one :class:`Target`, its tables written by a background
    thread while decoding goes on."""

    label = ""

    def __init__(self, settings: CaptureSettings, out: Path, run: str, role: str, prompts: list,
                 record_tensors: bool = True):
        self.settings, self.out, self.run, self.role = settings, out, run, role
        self.prompts, self.record_tensors = prompts, record_tensors

    def load(self) -> dict:
        self.target = Target.load(self.settings, self.out, self.prompts, self.record_tensors)
        prompt_ids(self.target.loaded.tokenizer, self.prompts[0].text,  # refused before writing
                   self.settings.chat_template)
        return self.target.manifest(self.run, self.role, self.prompts)

    def capture(self, todo, writer, on_complete):
        background = BackgroundWriter()
        try:
            if self.settings.batch_size > 1:
                finished = self.target.capture_batch(todo, writer, background, on_complete)
            else:
                finished = ((index, self.target.capture_prompt(index, prompt, writer, background,
                                                               on_complete))
                            for index, prompt in todo)
            for _, gen in finished:
                yield len(gen.steps), sum(s.accepted_length for s in gen.steps)
            background.drain()
        finally:
            background.close()

    def close(self) -> None:
        pass


def run_lifecycle(executor: Executor, settings: CaptureSettings, out: Path, run: str,
                  prompts: list, start: float, progress: bool) -> CaptureSummary:
    """Load, start or resume the run, capture what is not complete, commit, summarise: the one
    lifecycle of a run, for every executor. A failed write leaves the run resumable
    (:func:`write_errors`)."""
    try:
        fields = executor.load()
        load_seconds = time.perf_counter() - start
        writer = RunWriter(out, fields["model"], settings.bench, run)
        results = None
        try:
            manifest, done = writer.start(fields)
            resumed = len(done)
            todo = [(settings.offset + i, p) for i, p in enumerate(prompts)
                    if settings.offset + i not in done]
            bar = tqdm(total=len(prompts), initial=resumed, unit="prompt",
                       disable=True if not progress else None,  # None: only on a terminal
                       desc=f"capture {fields['model']}/{settings.bench}{executor.label}")
            trees = accepted = 0
            results = executor.capture(todo, writer, lambda: writer.record_progress(manifest))
            for t, a in results:
                trees, accepted = trees + t, accepted + a
                bar.update(1)
                bar.set_postfix(tau=f"{accepted / max(1, trees):.2f}")
            bar.close()
            if manifest.get("status") != "complete":  # a complete run captured again stays
                writer.finish({**manifest, "prompts_done": len(prompts)})
        except CatalogError as exc:  # the run's lock, folders or manifest
            raise CaptureError(str(exc)) from exc
        except (OSError, WriterFailed) as exc:
            raise write_errors(out)(exc) from exc
        finally:
            if results is not None:
                results.close()
            writer.close()
    finally:
        executor.close()
    return summarise(writer, fields["model"], settings.bench, run, resumed,
                     time.perf_counter() - start, load_seconds)


# --- what the run produced ---------------------------------------------------------------------
@dataclass
class CaptureSummary:
    root: Path
    model: str
    bench: str
    run: str
    prompts: int
    prompts_resumed: int  # already complete before this invocation
    trees: int
    tau: float
    unique_experts: float  # mean over trees and layers
    experts_loaded: float
    bytes_written: int
    seconds: float  # wall time of this invocation
    load_seconds: float = 0.0  # of which: loading model and draft
    prompts_with_trees: int | None = None  # prompts with at least one verification pass
    batch_size: int = 1  # b, sequences a verification pass holds (capture --batch-size)
    passes: int = 0  # verification passes (b = 1: one a tree)
    pass_unique_experts: float = 0.0  # |∪ of a pass's trees' experts| per layer, mean over passes


def summarise(writer: RunWriter, model: str, bench: str, run: str, resumed: int,
              seconds: float, load_seconds: float) -> CaptureSummary:
    """Figures of the whole run, read back from what is on disk (resumed prompts included):
    per tree (τ, unique experts and experts loaded, mean over trees of the mean over layers),
    prompts with at least one tree, and per verification pass: ``passes`` = distinct
    ``batch_pass`` (b = 1: one pass a tree) and the per-pass union, the mean over passes of
    ``mean over layers of batch_unique_experts`` (b = 1: the per-tree unique experts)."""
    import pyarrow as pa
    columns = ["prompt_index", "accepted_length", "unique_experts", "experts_loaded"]
    try:
        trees = location.read_table(writer.table_dir("trees"),
                                    columns=columns + ["batch_pass", "batch_unique_experts"])
    except (KeyError, pa.ArrowInvalid):  # a schema without batched passes: b = 1
        trees = location.read_table(writer.table_dir("trees"), columns=columns)
    seqs = location.read_table(writer.table_dir("sequences"), columns=["prompt_index"])
    mean_of = lambda col: float(np.mean([np.mean(v) for v in trees[col].to_pylist()])) \
        if trees.num_rows else 0.0  # noqa: E731
    unique = mean_of("unique_experts")
    try:
        manifest = writer.read_manifest() or {}
    except CatalogError:  # unreadable now: the run's b from its passes instead
        manifest = {"settings": {"batch_size": 2 if "batch_pass" in trees.column_names
                                 and trees["batch_pass"].null_count < trees.num_rows else 1}}
    b = int((manifest.get("settings") or {}).get("batch_size") or 1)
    passes, per_pass = trees.num_rows, unique
    if b > 1 and "batch_pass" in trees.column_names and trees.num_rows:
        union = {}  # every tree of a pass carries the pass's union: one per pass
        for p, u in zip(trees["batch_pass"].to_pylist(), trees["batch_unique_experts"].to_pylist()):
            if p is not None and u:
                union.setdefault(p, float(np.mean(u)))
        if union:
            passes, per_pass = len(union), float(np.mean(list(union.values())))
    with_trees = len(set(trees["prompt_index"].to_pylist()))
    return CaptureSummary(writer.root, model, bench, run, seqs.num_rows, resumed, trees.num_rows,
                          float(np.mean(trees["accepted_length"].to_numpy())) if trees.num_rows
                          else 0.0, unique, mean_of("experts_loaded"),
                          writer.bytes_written(), seconds, load_seconds, with_trees, b, passes,
                          per_pass)
