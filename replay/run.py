"""The replay driver: from a request (rankings × coverages × budgets × layers) to result units.

    runs         = complete evaluation runs that match (the catalog; calibration runs never)
    calibration  = statistics from the --calibration runs (disjoint prompts), if a ranking needs it
    plan         = per run × ranking × coverage its unit and what is stored (replay.plan, no torch)
    execute, for each run with pending units:
        lock them, drop superseded results, compute the blocks still missing
        open loop:   the engine streams the run once and scores every pending block
        closed loop: each tree is re-verified once per pending ranking × coverage × budget
    summary      = the requested cells, read back from complete blocks

A finished sweep answers any subset: ``--budget 24`` after a sweep recomputes nothing.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from moe_spec import cluster, console
from moe_spec.catalog import Catalog, CatalogError, Run, atomic, location, reader
from moe_spec.catalog.results import UnitResults
from moe_spec.cluster import ClusterError, actor_failure, cap_workers, count_workers, init_ray, worker_options
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.policy import coverage, index, rankings
from moe_spec.policy.calibration import CalibrationStats, calibrate
from moe_spec.policy.prices import PriceRequest, prices_for
from moe_spec.replay import distributed  # (closed_loop, which imports transformers: when replaying)
from moe_spec.replay.engine import OpenLoopEngine
from moe_spec.replay.plan import (  # noqa: F401 - (re-exported: what a replay asks, decided without torch)
    SIDE_BY_SIDE,
    SWEEPS,
    TABLES,
    UNIT_IDENTITY,
    ReplayError,
    ReplayOutcome,
    ReplayPlan,
    ReplayRequest,
    RunPlan,
    manifest_plan,
    parse_budgets,
    plan,
    run_layers_noted,
    storage_note,
    stored_layers,
    stored_variants,
    summary_frame,
    unit_key,
)


def expert_weights_digest(adapter: MoEAdapter) -> str:
    """A digest of the model's MoE layout, dtype and a sample of every expert tensor (the first
    64 values of its first row, never a copy of the tensor): what tells a retrained model."""
    import hashlib
    h = hashlib.sha256(json.dumps([list(adapter.moe_layers), adapter.num_experts,
                                   str(next(adapter.model.parameters()).dtype)]).encode())
    for name, tensor in adapter.model.state_dict().items():
        if "expert" in name:
            row = tensor.detach()[(0,) * (tensor.dim() - 1)] if tensor.dim() else tensor.detach()
            h.update(name.encode())
            h.update(row.reshape(-1)[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


def saved_stats_path(catalog: Catalog, run: Run, weights: str):
    """Where a calibration run's statistics are kept for reuse (local traces roots only):
    ``<traces>/calibration_stats/model=…/bench=…/run=…/<key>.safetensors``, the key a digest of
    the run's commit and the model's :func:`expert_weights_digest` ``weights``, so a recapture
    or a retrained model never reads stale ones."""
    if location.is_remote(catalog.root):
        return None
    import hashlib
    key = hashlib.sha256(json.dumps([run.run_id, run.manifest.get("commit_digest"),
                                     weights]).encode()).hexdigest()[:16]
    where = Path(run.root)
    return where / "calibration_stats" / run.dir("runs").relative_to(where / "runs") / \
        f"{key}.safetensors"


def price_request(request: ReplayRequest) -> PriceRequest | None:
    """What an adaptive ``request`` asks of the calibration step (None: fixed budgets): the
    price λ of each mean budget it replays, per coverage."""
    predictor, _, paced = index.budget_mode_parts(request.budget_mode)
    if predictor is None:
        return None
    return PriceRequest(predictor, tuple(request.budgets), tuple(request.coverages),
                        request.pass_cap, pace=request.pace, pace_over=paced or "prompt")


def calibration_stats(catalog: Catalog, names: list[str], model: str, evaluated: list[Run],
                      adapter: MoEAdapter, progress: bool, rankings_used: tuple[str, ...] = (),
                      resolved: list[Run] | None = None,
                      prices: PriceRequest | None = None) -> tuple[CalibrationStats, list[Run]]:
    """Statistics from the named calibration runs (never sharing a prompt with ``evaluated``),
    each run collected once per process (:func:`policy.calibration.collect_runs`); ``resolved``:
    those runs, already found and checked by the caller (the CLI resolves them once);
    ``prices``: adaptive budgets' price λ calibrated on them too."""
    cal = resolved if resolved is not None else catalog.calibration_runs(
        names, model, set().union(*(r.prompt_keys() for r in evaluated)))
    read = lambda run: tqdm(reader.tree_layers([run]), desc=f"calibration {run.name}",  # noqa: E731
                            unit="tree-layer", disable=True if not progress else None)
    weights = expert_weights_digest(adapter)  # once for every calibration run
    stats = calibrate(cal, read, adapter, rankings_used,
                      saved=lambda run: saved_stats_path(catalog, run, weights), prices=prices)
    return stats, cal


def replay(catalog: Catalog, runs: list[Run], adapter: MoEAdapter, request: ReplayRequest,
           stats: CalibrationStats | None, calibration: list[Run], out: Path, *,
           device: torch.device, progress: bool = True,
           max_batch: int | None = None, workers: int = 0,
           ray_address: str | None = None, dtype: str = "auto",
           key_dtype: str = "float32", prepared: ReplayPlan | None = None) -> ReplayOutcome:
    """Execute the plan of ``request``: ``prepared`` (made before the model loaded, from the
    manifests: :func:`replay.plan.manifest_plan`) where it fits the loaded model, else
    :func:`replay.plan.plan` with N, k and the layers of the loaded model; per run, lock its
    pending units and compute their missing blocks; with ``workers`` or ``ray_address`` the
    prompts are spread over Ray actors (:mod:`replay.distributed`), each loading the model once.
    ``key_dtype``: the dtype the model is loaded in (part of the results' key)."""
    mode = request.mode
    if mode.key() and (workers or ray_address):
        raise ReplayError(f"{mode.title()} runs in one process; drop --workers/--ray-address")
    layers = list(request.layers) if request.layers else [layer.index for layer in adapter]
    if prepared is not None and prepared.request == request and \
            prepared.fits(adapter.num_experts, adapter.top_k, layers, key_dtype):
        planned = prepared
    else:
        planned = plan(catalog, runs, request, calibration, out, n=adapter.num_experts,
                       k=adapter.top_k, layers=layers, dtype=key_dtype)
    outcome = planned.outcome
    start = time.perf_counter()
    if workers or ray_address:
        executor = RayExecutor(mode, runs[0].model, str(device), workers, ray_address, dtype,
                               out, stats, max_batch,
                               items=sum(len(r.prompt_indices()) for r in runs))
    else:
        executor = LocalExecutor(mode, OpenLoopEngine(adapter, device, progress=progress,
                                                      max_batch=max_batch), adapter)
    try:
        for run_plan in planned.runs:
            with ExitStack() as locks:
                tasks = run_tasks(planned, run_plan, stats, locks)
                if not tasks:
                    outcome.reused.append(run_plan.run.name)
                    continue
                work = executor.compute(run_plan.run, tasks, progress)
                setattr(outcome, mode.counted, getattr(outcome, mode.counted) + work)
    finally:
        executor.close()
    outcome.start_seconds = executor.start_seconds
    outcome.seconds = time.perf_counter() - start
    return outcome


class Executor(cluster.Executor, Protocol):
    """Who computes a run's pending blocks: this process (:class:`LocalExecutor`) or Ray actors
    (:class:`RayExecutor`)."""

    start_seconds: float  # spent starting workers and loading their models

    def compute(self, run: Run, tasks: list, progress: bool) -> int:
        """Score ``tasks`` of ``run`` (their results written); what was computed, counted in the
        mode's unit (tree-layers or trees)."""


class LocalExecutor:
    """Every task in this process, by the mode's engine on the model already loaded."""

    label, start_seconds = "", 0.0

    def __init__(self, mode, engine: OpenLoopEngine, adapter: MoEAdapter):
        self.mode, self.engine, self.adapter = mode, engine, adapter

    def compute(self, run: Run, tasks: list, progress: bool) -> int:
        return self.mode.compute(run, tasks, self.engine, self.adapter, progress)

    def close(self) -> None:
        pass


class RayExecutor:
    """Replay actors (:mod:`replay.distributed`), started on the first run with work (never more
    than the ``items`` prompts), each loading the model once; a prompt's tasks go to one actor."""

    start_seconds = 0.0

    def __init__(self, mode, model: str, device: str, workers: int, ray_address: str | None,
                 dtype: str, out: Path, stats, max_batch: int | None, items: int):
        self.mode, self.model, self.device = mode, model, device
        self.workers, self.ray_address = workers, ray_address
        self.dtype, self.out, self.stats, self.max_batch, self.items = dtype, out, stats, max_batch, items
        self.ray, self.actors = None, None

    @property
    def label(self) -> str:
        return f" ({len(self.actors)} workers)" if self.actors else ""

    def compute(self, run: Run, tasks: list, progress: bool) -> int:
        if self.actors is None:
            t0 = time.perf_counter()
            self.ray, self.actors = actors_for(self.model, self.device, self.workers,
                                               self.ray_address, items=self.items,
                                               dtype=self.dtype)
            self.start_seconds = time.perf_counter() - t0
        specs = [distributed.TaskSpec(self.mode.table, t.unit.unit, t.block, t.ranking.name,
                                      t.coverage.name) for t in tasks]
        bar = tqdm(total=len(run.prompt_indices()), desc=f"replay {run.name}{self.label}",
                   unit="prompt", disable=True if not progress else None)
        try:
            return distributed.replay_distributed(self.ray, self.actors, self.out, run, specs,
                                                  self.stats, self.max_batch, bar)
        finally:
            bar.close()

    def close(self) -> None:
        for actor in self.actors or []:
            self.ray.kill(actor)
        self.actors = None


def run_tasks(planned: ReplayPlan, run_plan: RunPlan, stats, locks: ExitStack) -> list:
    """Execute one run's plan up to its tasks: a unit answered by a stored calibrated variant is
    that variant; every other unit is locked for the rest of the replay (``locks``), its
    superseded results dropped, a learned ranking's model saved beside its results, and its
    blocks still missing (checked again under the lock: another replay may have written them
    since planning) become tasks."""
    request, outcome = planned.request, planned.outcome
    mode = request.mode
    tasks = []
    prices = price_request(request)
    for unit_plan in run_plan.units:
        if unit_plan.answered_by is not None:
            outcome.units.append(unit_plan.answered_by)
            continue
        unit, cls = unit_plan.unit, rankings.get(unit_plan.ranking)
        check_starts(unit, cls, stats)
        cover = coverage.get(unit_plan.coverage)
        locks.enter_context(unit.locked())
        unit.drop_superseded(UNIT_IDENTITY, SIDE_BY_SIDE)
        outcome.units.append(unit)
        saved = unit.folder / cls.artifact if cls.artifact else None
        if saved and not saved.exists():  # what it learned, beside its results
            # (a unit names its calibration runs, so a saved model is this one)
            location.mkdir(unit.folder)
            atomic.write_via(saved, cls().fit(stats).save)
        todo = unit.plan(mode.cell_layers(run_plan.layers), unit_plan.budgets)
        if index.carries_across_prompts(request.budget_mode):  # paced over the run: a prompt's
            for block in todo:  # budgets depend on the prompts before it, so no resuming
                unit.restart(block)
        for block in todo:
            task = mode.task(unit, block, cls, cover, stats)
            if prices is not None:  # adaptive: budgets are means B̄, each with its price λ
                task.budget_mode = request.budget_mode
                task.prices = prices_for(stats, unit_plan.ranking, unit_plan.coverage,
                                         prices).for_layers(run_plan.layers)
            tasks.append(task)
        if todo:
            outcome.notes += new_variant_notes(planned.out, run_plan.run, unit, cls,
                                               planned.calibration)
            if prices is not None:
                outcome.notes.append(price_note(unit_plan, tasks[-1].prices))
    return tasks


def price_note(unit_plan, prices) -> str:
    """One line: the calibrated price λ of each mean budget and the mean B the rule gave on the
    calibration run itself (the held-out mean is the rows' ``experts_loaded``)."""
    cells = ", ".join(f"B̄ {m}: λ {prices.prices[m]:.4g} (mean {prices.achieved[m]:.2f})"
                      for m in sorted(prices.prices) if m in unit_plan.budgets)
    paced = "" if prices.pace is None else \
        f"; paced, η {prices.pace:g}, over each {prices.pace_over}"
    return (f"{unit_plan.ranking}, {unit_plan.coverage}: price per mean budget, calibrated on "
            f"the calibration run: {cells}{paced}")


def check_starts(unit: UnitResults, cls, stats) -> None:
    """A ranking with ``token_aware_starts`` (the oracle) starts from the token-aware rankings
    exactly when its calibration carries the surrogate's sums; its key must say which
    (:func:`replay.plan.unit_key`), or a weaker cell would be stored as a stronger one. A caller
    whose statistics were collected for other rankings than the plan's is refused."""
    if not cls.token_aware_starts:
        return
    from moe_spec.policy.surrogate import MOMENTS
    attached = stats is not None and MOMENTS in stats.fitted
    if attached != bool(unit.unit.get("token_aware_starts")):
        raise ReplayError(f"{cls.name}: the calibration statistics {'carry' if attached else 'lack'}"
                          " the surrogate's sums but the plan says otherwise; collect them with "
                          "calibration_stats(..., rankings_used=the rankings replayed)")


def new_variant_notes(out: Path, run: Run, unit: UnitResults, cls,
                      calibration: list[Run]) -> list[str]:
    """One line when an uncalibrated variant is computed beside stored calibrated ones of the
    same ranking: which, and how to reuse them instead."""
    if calibration or cls.needs_calibration or not cls.uses_calibration:
        return []
    cals = sorted({",".join(c[0] for c in key["calibration"])
                   for key, _ in stored_variants(out, unit.table, run)
                   if key.get("ranking") == cls.name and key.get("calibration")})
    if not cals:
        return []
    return [f"{cls.name}, {unit.unit['coverage']}, run {run.name}: adds a variant without "
            "calibration (its searches start from the uncalibrated rankings' shortlists only) "
            f"beside the stored one(s) calibrated on {'; '.join(cals)}; pass --calibration "
            f"{cals[0].replace(',', ' ')} to reuse those instead"]


def actors_for(model: str, device: str, workers: int, ray_address: str | None,
               items: int | None = None, dtype: str = "auto"):
    """The Ray module and the replay actors (started once per replay, never more than the
    ``items`` prompts), each with its model loaded: a model that cannot load fails here, in one
    line, before any work is handed out."""
    if items is not None:
        workers = cap_workers(workers, items, device, local=not ray_address)
    try:
        ray = init_ray(workers, ray_address)
    except ClusterError as exc:
        raise ReplayError(str(exc)) from None
    n = count_workers(ray, workers, device, items=items)
    cls = ray.remote(**worker_options(device))(distributed.ReplayWorker)
    # a local cluster shares this process's --threads; a joined one gives each actor its slot
    threads = 1 if ray_address else console.threads.share(n)
    actors = [cls.remote(model, device, threads, dtype) for _ in range(n)]
    try:
        ray.get([a.ready.remote() for a in actors])
    except ray.exceptions.RayActorError as exc:
        for a in actors:
            ray.kill(a)
        raise ReplayError(f"a replay worker could not load {model} ({actor_failure(exc)}); "
                          "check --model") from None
    return ray, actors


__all__ = ["CatalogError", "ReplayError", "ReplayRequest", "calibration_stats", "parse_budgets",
           "replay", "manifest_plan", "summary_frame"]
