"""What the benches run, through the Python API the command-line tools share: a checked
:class:`capture.settings.CaptureSettings` and the capture driver (:func:`capture.run.capture_run`),
a :class:`replay.plan.ReplayRequest` and :func:`replay.run.replay`; runs found through the
catalog (:class:`catalog.Catalog`), never by globbing trace paths. A library, not a bench."""

from __future__ import annotations

import functools
from pathlib import Path

from moe_spec.capture.run import CaptureSettings, CaptureSummary, capture_run  # noqa: F401
from moe_spec.catalog import Catalog
from moe_spec.errors import UserError
from moe_spec.policy import index
from moe_spec.replay.run import (
    ReplayOutcome,
    ReplayRequest,
    calibration_stats,
    parse_budgets,
    price_request,
    replay,
)


def results_frame(out: Path, table: str = "replay_open", *, model: str | None = None,
                  bench: str | None = None):
    """The rows of ``table`` (replay_open, replay_closed, ...) under ``out`` that readers may
    treat as final: every complete block of the current metric layout, its committed files
    verified (:func:`catalog.results.complete_blocks`, :func:`~catalog.results.block_files`),
    with model, bench, run and config as columns; optionally one model's or bench's. What the
    benches read instead of globbing Parquet files, where a stray part, an interrupted block or
    another layout's file would enter the numbers."""
    import polars as pl

    from moe_spec.catalog import location
    from moe_spec.catalog.names import partition_value
    from moe_spec.catalog.results import block_files, complete_blocks
    frames = []
    for b in complete_blocks(out, table):
        if (model is not None and b["model"] != partition_value(model)) or \
                (bench is not None and b["bench"] != bench):
            continue
        files = block_files(b["folder"], b["files"], out)
        if files:
            frames.append(location.read_frame(files).with_columns(
                model=pl.lit(b["model"]), bench=pl.lit(b["bench"]), run=pl.lit(b["run"]),
                config=pl.lit(b["config"])))
    if not frames:
        raise SystemExit(f"no complete {table} results under {out}"
                         + (f" for {model}" if model else "") + (f" / {bench}" if bench else ""))
    return pl.concat(frames, how="diagonal_relaxed")


def capture(out: Path, run: str, *, role: str = "evaluation", benchmarks_root=None,
            **settings) -> CaptureSummary:
    """``capture --out OUT --run RUN --role ROLE --benchmarks DIR --no-progress`` with
    ``settings`` as options (resumes, so a finished run is not captured again). A problem the
    user can fix (a missing benchmarks folder, a bad setting) ends the bench with its one line,
    as the capture CLI does, not a traceback."""
    try:
        return capture_run(CaptureSettings(**settings), out, run, role=role,
                           benchmarks_root=benchmarks_root, progress=False)
    except UserError as exc:
        raise SystemExit(f"capture: error: {exc}") from None


@functools.cache
def loaded_model(model: str, device: str = "cpu"):
    """The model and its MoE adapter, loaded once per process."""
    from moe_spec.moe import models
    from moe_spec.moe.adapter import MoEAdapter
    models.quiet_transformers()
    loaded = models.load(model, device=device)
    return loaded, MoEAdapter(loaded.model)


def run_names(traces: Path, model: str, *, prefix: str = "", bench: str | None = None,
              roles: tuple[str, ...] | None = None) -> list[str]:
    """Names of the complete runs of ``model`` under ``traces`` starting with ``prefix``."""
    found = Catalog(traces).runs(model=model, bench=bench, roles=roles)
    return sorted({r.name for r in found if r.name.startswith(prefix)})


def replay_runs(traces: Path, model: str, runs: list[str], *, rankings: tuple[str, ...],
                coverages: tuple[str, ...], budgets: str, out: Path, bench: str | None = None,
                calibration: tuple[str, ...] = (), mode: str = "open",
                device: str = "cpu", batch_size: int = 1, batch_seed: int = 0,
                budget_mode: str = index.FIXED, pass_cap: float | None = None,
                pace: float | None = None) -> ReplayOutcome:
    """``replay --traces TRACES --model MODEL [--bench BENCH] --run RUNS --ranking RANKINGS
    --coverage COVERAGES --budget BUDGETS --calibration CALIBRATION --mode MODE --out OUT
    --batch-size B --batch-seed S`` (results already stored are reused); an adaptive
    ``budget_mode`` (``index.budget_mode``: ``--budget-mode adaptive --gain-predictor P``, with
    ``--pass-cap``, ``--pace``) makes BUDGETS mean budgets B̄, their price λ calibrated on
    CALIBRATION."""
    if budget_mode != index.FIXED and not calibration:
        raise ValueError(f"budget mode {budget_mode} needs calibration runs: its price λ")
    catalog = Catalog(traces)
    evaluated = catalog.runs(model=model, bench=bench, names=list(runs))
    if not evaluated:
        raise ValueError(f"no complete run {', '.join(runs)} of {model} under {traces}")
    loaded, adapter = loaded_model(model, device)
    request = ReplayRequest(tuple(rankings), tuple(coverages),
                            tuple(parse_budgets(budgets, adapter.num_experts)), None, mode,
                            batch_size, batch_seed, budget_mode, pass_cap, pace)
    stats, cal = None, []
    if calibration:
        stats, cal = calibration_stats(catalog, list(calibration), model, evaluated, adapter,
                                       progress=False, rankings_used=tuple(rankings),
                                       prices=price_request(request))
    return replay(catalog, evaluated, adapter, request, stats, cal, out, device=loaded.device,
                  progress=False)
