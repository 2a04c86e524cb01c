"""The driver of a capture run: one lifecycle, whoever decodes the prompts.

    plan     = every check and name resolved, the prompts loaded (capture.plan, no torch); a
               run complete with these settings is answered from disk (the model never loads)
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
from pathlib import Path
from typing import Callable, Iterator, Protocol

from tqdm import tqdm

from moe_spec import cluster
from moe_spec.capture.background import BackgroundWriter, WriterFailed
from moe_spec.capture.plan import CapturePlan, plan
from moe_spec.capture.settings import CaptureError, CaptureSettings
from moe_spec.capture.summary import CaptureSummary, summarise
from moe_spec.capture.target import Target, prompt_ids
from moe_spec.catalog import CatalogError
from moe_spec.catalog.writer import RunWriter


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


def capture_run(settings: CaptureSettings, out: Path, run: str | None = None, *,
                role: str = "evaluation", benchmarks_root=None, progress: bool = True,
                record_tensors: bool = True, workers: int = 0,
                ray_address: str | None = None,
                allow_evaluation_calibration: bool = False) -> CaptureSummary:
    """Capture every prompt of the benchmark into ``out``/…/run=``run`` (resuming): the plan
    (:func:`capture.plan.plan`), then :func:`execute`. With ``workers`` or ``ray_address`` the
    prompts are spread over Ray actors (:mod:`capture.distributed`). ``--calibration`` runs must
    have the calibration role unless ``allow_evaluation_calibration``."""
    return execute(plan(settings, out, run, role=role, benchmarks_root=benchmarks_root,
                        workers=workers, ray_address=ray_address,
                        allow_evaluation_calibration=allow_evaluation_calibration,
                        record_tensors=record_tensors), progress)


def execute(planned: CapturePlan, progress: bool = True) -> CaptureSummary:
    """Run a plan: a complete run's summary as planned; else its executor (this process, or Ray
    actors with ``workers``/``ray_address``) through the run's one lifecycle."""
    if planned.complete is not None:  # nothing to capture: answered without loading the model
        return planned.complete
    if planned.workers or planned.ray_address:
        from moe_spec.capture.distributed import RayExecutor  # Ray is optional: loaded only for it
        executor = RayExecutor(planned.settings, planned.out, planned.run, planned.role,
                               planned.prompts, workers=planned.workers,
                               ray_address=planned.ray_address)
    else:
        executor = LocalExecutor(planned.settings, planned.out, planned.run, planned.role,
                                 planned.prompts, planned.record_tensors)
    return run_lifecycle(executor, planned.settings, planned.out, planned.run, planned.prompts,
                         planned.started, progress)


class Executor(cluster.Executor, Protocol):
    """Who decodes a run's prompts: this process (:class:`LocalExecutor`) or Ray actors
    (:class:`capture.distributed.RayExecutor`)."""

    def load(self) -> dict:
        """Load the target(s); the manifest's fields (:func:`capture.target.run_manifest`)."""

    def capture(self, todo: list[tuple[int, object]], writer: RunWriter,
                on_complete: Callable[[], None]) -> Iterator[tuple[int, int]]:
        """Decode and write every ``(index, prompt)`` of ``todo``; yields (trees, accepted
        tokens) of each prompt once its tables are written or queued. ``on_complete`` records
        the run's progress after a prompt's ``sequences`` part exists (the executor calls it
        where that part is written, or after the prompt's result came back)."""


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
