"""The plan of a capture run: every check and every name resolved before torch loads.

    plan(settings, out, run, ...)  →  CapturePlan
        the output root usable, the model reachable (its name as traces key it) and the budget
        its config admits, the run name (derived from the settings when not given) and role, the
        prompts loaded, the Ray cluster answering, the calibration runs complete and of the
        calibration role, batching limits, no other capture writing the run; and, when the run
        is complete with these settings, role and prompts, its summary read from disk
    CapturePlan.complete   → the answer without the model
    otherwise              → :func:`capture.run.execute` runs the plan with an executor

Importing this module imports neither torch nor transformers: the CLI, the Python API
(:func:`capture.run.capture_run`) and the benches plan through it, so each refusal is written
once and said in about a second.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from moe_spec.capture.naming import default_run
from moe_spec.capture.settings import CaptureError, CaptureSettings
from moe_spec.capture.summary import CaptureSummary, summarise
from moe_spec.catalog import Catalog, CatalogError, InvalidName, check_name, location, schema
from moe_spec.catalog.writer import RunWriter, as_stored
from moe_spec.moe import models
from moe_spec.policy import index
from moe_spec.tasks import benchmarks


@dataclass
class CapturePlan:
    """What :func:`plan` decided: the run to write and how, its prompts, and ``complete``, the
    summary of a run already complete with these settings (then nothing is captured)."""

    settings: CaptureSettings
    out: Path
    run: str
    role: str
    model: str  # the model's name as traces are keyed (resolved once)
    prompts: list
    workers: int = 0
    ray_address: str | None = None
    record_tensors: bool = True
    complete: CaptureSummary | None = None
    started: float = field(default_factory=time.perf_counter)  # for the summary's wall time


def plan(settings: CaptureSettings, out, run: str | None = None, *, role: str = "evaluation",
         benchmarks_root=None, workers: int = 0, ray_address: str | None = None,
         allow_evaluation_calibration: bool = False, record_tensors: bool = True) -> CapturePlan:
    """Every check of the module docstring (``--workers`` ≥ 0 too), each a one-line
    :class:`CaptureError`; no model, no torch, nothing written."""
    started = time.perf_counter()
    check_out(out)
    if workers < 0:
        raise CaptureError(f"--workers {workers} must be 0 (no Ray) or more")
    model = models.check_available(settings.model).name
    run = default_run(settings, out, model) if run is None else run
    try:
        check_name(run, "--run")
    except InvalidName as exc:
        raise CaptureError(str(exc)) from None
    if role not in schema.ROLES:
        raise CaptureError(f"--role {role!r} is not a role; use one of {', '.join(schema.ROLES)}")
    check_budget(settings, model)
    prompts = benchmarks.load(settings.bench, root=benchmarks_root, offset=settings.offset,
                              limit=settings.limit)
    if not prompts:
        raise CaptureError(f"no prompts in {settings.bench} at offset {settings.offset}")
    if ray_address:
        check_cluster(ray_address)
    check_calibration(settings, out, model, allow_evaluation_calibration)
    check_batching(settings, workers or ray_address)
    check_not_being_written(out, model, settings.bench, run)
    found = CapturePlan(settings, out, run, role, model, prompts, workers, ray_address,
                        record_tensors, started=started)
    found.complete = already_complete(found)
    return found


def check_out(out) -> None:
    """A local ``--out`` must be a folder or a path where one can be made: never a regular
    file, a FIFO, a device or a socket, nor a symbolic link to nothing (or under one)."""
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
    check_budget_mode(settings)
    if settings.budget is None:
        return
    shape = models.expert_shape(models.read_config(settings.model))
    if shape is None:
        return
    n, k = shape
    low = index.min_budget(settings.coverage, k)
    if not low <= settings.budget <= n:
        raise CaptureError(f"--budget {settings.budget} is out of range for {model}: use "
                           f"{low}..{n} ({n} experts, top-{k}, {settings.coverage})")


def check_budget_mode(settings: CaptureSettings) -> None:
    """``--budget-mode adaptive`` needs ``--budget`` (its mean B̄) and ``--calibration`` (its
    price λ is calibrated there); ``--gain-predictor``, ``--pass-cap`` and ``--pace`` are
    adaptive's."""
    if settings.budget_mode != index.ADAPTIVE:
        for flag, value in (("--gain-predictor", settings.gain_predictor),
                            ("--pass-cap", settings.pass_cap), ("--pace", settings.pace)):
            if value is not None:
                raise CaptureError(f"{flag} is for adaptive budgets; add --budget-mode adaptive")
        return
    if settings.budget is None:
        raise CaptureError("--budget-mode adaptive needs --budget B̄ (the mean experts per layer)")
    if not settings.calibration:
        raise CaptureError("--budget-mode adaptive needs --calibration RUN: the price λ of the "
                           "mean budget is calibrated there (a capture of other prompts)")
    if not index.adapts(settings.ranking, executes=True):
        raise CaptureError(f"--budget-mode adaptive ranks every budget of a layer at once; "
                           f"--ranking {settings.ranking} cannot; pick another ranking")


def check_cluster(address: str) -> None:
    """``--ray-address``: Ray installed, and a Ray cluster answering there (within seconds)."""
    import importlib.util

    from moe_spec import cluster
    if importlib.util.find_spec("ray") is None:
        raise cluster.ClusterError("--workers / --ray-address need Ray: pip install -e .[ray]")
    cluster.check_reachable(address)


def check_calibration(settings: CaptureSettings, out, model: str, allow_evaluation: bool) -> None:
    """The ``--calibration`` runs (online mode's statistics) exist complete under ``out`` for
    the model, and were captured with the calibration role unless ``allow_evaluation``."""
    if not settings.calibration:
        return
    try:
        found = Catalog(out).runs(model=model, names=list(settings.calibration))
    except CatalogError as exc:
        found, why = [], f" ({exc})"
    else:
        why = ""
    missing = sorted(set(settings.calibration) - {r.name for r in found})
    if missing:
        raise CaptureError(f"--calibration run(s) {', '.join(missing)} not found complete "
                           f"under {location.display(out)} for {model}{why}; "
                           "capture them first (--role calibration) or name existing runs")
    if not allow_evaluation and any(r.role == "evaluation" for r in found):
        from moe_spec.policy.calibration import evaluation_calibration  # replay's wording (torch:
        raise CaptureError(evaluation_calibration(found))  # imported only to refuse)


def check_batching(settings: CaptureSettings, distributed) -> None:
    """What batched decoding does not do yet, refused in one line."""
    if settings.batch_size == 1:
        return
    if distributed:
        raise CaptureError("--batch-size with --workers/--ray-address is not supported yet; "
                           "batch within one process, or scale out with --batch-size 1")
    entry = index.RANKINGS.get(settings.ranking)  # (an unknown name: refused by the settings)
    if settings.budget is not None and entry is not None and entry.stateful:
        raise CaptureError(f"--ranking {settings.ranking} keeps state per prompt, which a batch "
                           "of prompts does not have; use a stateless ranking with --batch-size")


def check_not_being_written(out, model: str, bench: str, run: str) -> None:
    """Refuse a run whose lock another capture holds right now: take it without waiting and
    let it go (the run's writer takes it again once the model is loaded). A run with no folder
    (no lease object, on a store) has no writer. On a store, a well-formed lease that expires
    within one lease lifetime is watched until it does: renewed, its writer is alive (refused);
    not, it was a killed writer's (taken over, as the run's writer would)."""
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
    state = lease.state()
    if state is None or state[2] is not None or state[1] > time.time() + lease.seconds:
        return
    while time.time() < state[1]:
        time.sleep(poll)
        now = lease.state()
        if now is None or now[0] != state[0]:
            return


def already_complete(found: CapturePlan) -> CaptureSummary | None:
    """The summary of a run that is complete with these settings, role and prompts (a rerun
    has nothing to do), read from disk without loading the model; else None."""
    settings = found.settings
    writer = RunWriter(found.out, found.model, settings.bench, found.run)
    try:
        old = writer.read_manifest()
    except CatalogError as exc:
        raise CaptureError(str(exc)) from exc
    if old is None or old.get("status") != "complete" or old.get("role") != found.role \
            or old.get("settings") != as_stored(settings.identity()) \
            or old.get("prompt_ids") != [p.prompt_id for p in found.prompts] \
            or len(writer.completed()) < len(found.prompts):
        return None
    return summarise(writer, found.model, settings.bench, found.run, len(found.prompts),
                     time.perf_counter() - found.started, 0.0)
