"""The replay driver: from a request (rankings × coverages × budgets × layers) to result units.

    runs         = complete evaluation runs that match (the catalog; calibration runs never)
    calibration  = statistics from the --calibration runs (disjoint prompts), if a ranking needs it
    for each run:
        for each ranking × coverage: its unit (catalog.results) plans what is missing
        open loop:   the engine streams the run once and scores every pending block
        closed loop: each tree is re-verified once per pending ranking × coverage × budget
    summary      = the requested cells, read back from complete blocks

A finished sweep answers any subset: ``--budget 24`` after a sweep recomputes nothing.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import torch
from tqdm import tqdm

from catalog import Catalog, CatalogError, Run, reader
from catalog.results import UnitResults
from cluster import ClusterError, count_workers, init_ray, worker_options
from moe.adapter import MoEAdapter
from policy import coverage, rankings
from policy.calibration import (MEANS_VERSION, CalibrationStats, collect_runs, empty_calibration,
                                examples_for)
from replay import closed_loop, distributed
from replay.engine import OpenLoopEngine, Task

# the paper's budget grids (MoE-Spec, Fig. 5) by number of experts
SWEEPS = {64: list(range(8, 57, 8)), 128: [16, 24, 32, 48, 64], 8: list(range(2, 8))}
TABLES = {"open": "replay_open", "closed": "replay_closed"}


class ReplayError(RuntimeError):
    """Bad or missing input; the message is one line for the user."""


def parse_budgets(spec: str, n: int) -> list[int]:
    """``24``, ``8,16,32``, ``8:56:8`` (inclusive) or ``sweep`` (the paper's grid for N)."""
    if spec == "sweep":
        if n in SWEEPS:
            return SWEEPS[n]
        step = max(1, n // 8)
        return list(range(step, n, step))
    try:
        if ":" in spec:
            parts = [int(x) for x in spec.split(":")]
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] < 1):
                raise ValueError(spec)
            lo, hi, *st = parts
            values = list(range(lo, hi + 1, st[0] if st else 1))
        else:
            values = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ReplayError(f"cannot read --budget {spec!r}; use 24, 8,16,32, 8:56:8 or sweep") \
            from None
    bad = [b for b in values if not 1 <= b <= n]
    if bad or not values:
        raise ReplayError(f"--budget {spec!r} is out of range: budgets must be within 1..{n}")
    return sorted(set(values))


@dataclass(frozen=True)
class ReplayRequest:
    rankings: tuple[str, ...] = ("router", "oracle")
    coverages: tuple[str, ...] = ("truncation", "substitution")
    budgets: tuple[int, ...] = (24,)
    layers: tuple[int, ...] | None = None  # None: every MoE layer
    mode: str = "open"


def stored_layers(run: Run, layers: list[int]) -> list[int]:
    """Of ``layers``, those whose MoE tensors the run's storage policy kept (open loop needs
    them; routing is always complete)."""
    kept = run.manifest.get("storage", {}).get("layers")
    return layers if kept is None else [x for x in layers if x in kept]


def storage_note(run: Run) -> str | None:
    """One line saying what a partially stored run lacks, or None."""
    storage = run.manifest.get("storage")
    if not storage:
        return None
    moe = run.manifest.get("moe_layers", [])
    parts = []
    if storage["layers"] != moe:
        parts.append(f"MoE layers {','.join(map(str, storage['layers']))} of {len(moe)}")
    if storage["passes"] != "all":
        parts.append(f"passes {storage['passes']}")
    if not parts:
        return None
    return (f"run {run.name} keeps MoE tensors for {' and '.join(parts)} ({storage['dtype']}); "
            "open-loop replay covers those, closed loop and routing analyses everything")


@dataclass
class ReplayOutcome:
    units: list[UnitResults] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)  # runs answered entirely from stored results
    skipped: dict[str, list[int]] = field(default_factory=dict)  # ranking -> budgets it cannot do
    notes: list[str] = field(default_factory=list)  # what partially stored runs lack
    tree_layers: int = 0  # computed now (open loop)
    trees: int = 0  # re-verified now (closed loop)
    seconds: float = 0.0
    start_seconds: float = 0.0  # of which: starting Ray actors and loading their models


def calibration_stats(catalog: Catalog, names: list[str], model: str, evaluated: list[Run],
                      adapter: MoEAdapter, progress: bool, rankings_used: tuple[str, ...] = ()
                      ) -> tuple[CalibrationStats, list[Run]]:
    """Statistics from the named calibration runs (never sharing a prompt with ``evaluated``),
    each run collected once per process (:func:`policy.calibration.collect_runs`)."""
    cal = catalog.calibration_runs(names, model, set().union(*(r.prompt_keys() for r in evaluated)))
    read = lambda run: tqdm(reader.tree_layers([run]), desc=f"calibration {run.name}",  # noqa: E731
                            unit="tree-layer", disable=not progress)
    stats = collect_runs(cal, read, adapter, examples_for(rankings_used))
    problem = empty_calibration(stats, cal)
    if problem:
        raise ReplayError(problem)
    return stats, cal


UNIT_IDENTITY = ("mode", "ranking", "coverage", "calibration")  # the rest of a key is versions


def unit_key(mode: str, ranking: type[rankings.Ranking], cover: coverage.Coverage,
             calibration: list[Run]) -> dict:
    """What makes results comparable; calibration only where the ranking uses it, with the
    version of how statistics become means (results of an older definition are not reused)."""
    key = dict(mode=mode, ranking=ranking.name, coverage=cover.name, calibration=[])
    if ranking.version != 1:  # (version 1 is left out: keys of unchanged rankings stay as they were)
        key["version"] = ranking.version
    if ranking.needs_calibration or (ranking.uses_calibration and calibration):
        key.update(calibration=sorted([r.name, r.run_id] for r in calibration),
                   means=MEANS_VERSION)
    return key


def replay(catalog: Catalog, runs: list[Run], adapter: MoEAdapter, request: ReplayRequest,
           stats: CalibrationStats | None, calibration: list[Run], out: Path, *,
           device: torch.device, progress: bool = True,
           max_batch: int | None = None, workers: int = 0,
           ray_address: str | None = None) -> ReplayOutcome:
    """Replay ``runs`` for ``request``; with ``workers`` or ``ray_address`` the prompts are
    spread over Ray actors (:mod:`replay.distributed`), each loading the model once."""
    table = TABLES[request.mode]
    layers = list(request.layers) if request.layers else [layer.index for layer in adapter]
    outcome = ReplayOutcome()
    start = time.perf_counter()
    engine = OpenLoopEngine(adapter, device, progress=progress, max_batch=max_batch)
    actors = None
    for run in runs:
        tasks, closed = [], []
        run_layers = stored_layers(run, layers) if request.mode == "open" else layers
        note = storage_note(run) if request.mode == "open" else None
        if note:
            outcome.notes.append(note)
        if not run_layers:
            continue
        with ExitStack() as locks:
            for name in request.rankings:
                cls = rankings.get(name)
                for cov_name in request.coverages:
                    cover = coverage.get(cov_name)
                    budgets = [b for b in request.budgets if b >= cover.min_budget(adapter.top_k)]
                    skip = cls().skipped(adapter.num_experts, budgets)
                    if skip:
                        outcome.skipped.setdefault(name, sorted(set(skip)))
                    budgets = [b for b in budgets if b not in skip]
                    if not budgets:
                        continue
                    unit = UnitResults(out, table, run, unit_key(request.mode, cls, cover,
                                                                 calibration))
                    locks.enter_context(unit.locked())
                    unit.drop_superseded(UNIT_IDENTITY)
                    outcome.units.append(unit)
                    saved = unit.folder / cls.artifact if cls.artifact else None
                    if saved and not saved.exists():  # what it learned, beside its results
                        # (a unit names its calibration runs, so a saved model is this one)
                        unit.folder.mkdir(parents=True, exist_ok=True)
                        cls().fit(stats).save(saved)
                    for block in unit.plan(run_layers if request.mode == "open" else None,
                                           budgets):
                        if request.mode == "open":
                            tasks.append(Task(unit, block, cls().fit(stats), cover))
                        else:
                            closed.append(closed_loop.ClosedTask(unit, block, cls, cover, stats))
            if not tasks and not closed:
                outcome.reused.append(run.name)
                continue
            if workers or ray_address:
                if actors is None:
                    t0 = time.perf_counter()
                    ray, actors = actors_for(runs[0].model, str(device), workers, ray_address)
                    outcome.start_seconds = time.perf_counter() - t0
                specs = [distributed.TaskSpec(table, t.unit.unit, t.block, t.ranking.name,
                                              t.coverage.name) for t in tasks] + \
                    [distributed.TaskSpec(table, t.unit.unit, t.block, t.ranking.name,
                                          t.coverage.name) for t in closed]
                bar = tqdm(total=len(run.prompt_indices()), desc=f"replay {run.name} "
                           f"({len(actors)} workers)", unit="prompt", disable=not progress)
                work = distributed.replay_distributed(ray, actors, out, run, specs, stats,
                                                      max_batch, bar)
                bar.close()
                if request.mode == "open":
                    outcome.tree_layers += work
                else:
                    outcome.trees += work
                continue
            if request.mode == "open":
                before = engine.tree_layers
                engine.run(run, tasks)
                outcome.tree_layers += engine.tree_layers - before
            else:
                bar = lambda xs: tqdm(xs, desc=f"replay {run.name}", unit="prompt",  # noqa: E731
                                      disable=not progress)
                outcome.trees += closed_loop.replay_run(run, adapter, closed, bar)
    for actor in actors or []:
        ray.kill(actor)
    outcome.seconds = time.perf_counter() - start
    return outcome


def actors_for(model: str, device: str, workers: int, ray_address: str | None):
    """The Ray module and the replay actors (started once per replay), each with its model
    loaded: a model that cannot load fails here, in one line, before any work is handed out."""
    try:
        ray = init_ray(workers, ray_address)
    except ClusterError as exc:
        raise ReplayError(str(exc)) from None
    n = count_workers(ray, workers, device)
    cls = ray.remote(**worker_options(device))(distributed.ReplayWorker)
    actors = [cls.remote(model, device) for _ in range(n)]
    try:
        ray.get([a.ready.remote() for a in actors])
    except ray.exceptions.RayActorError as exc:
        for a in actors:
            ray.kill(a)
        raise ReplayError(f"a replay worker could not load {model} ({exc}); check --model") \
            from None
    return ray, actors


def summary_frame(outcome: ReplayOutcome, request: ReplayRequest) -> pl.DataFrame | None:
    """Mean metrics per ranking × coverage × budget over the requested cells."""
    files = [f for u in outcome.units for f in u.parts(
        list(request.layers) if request.layers else None, list(request.budgets))]
    if not files:
        return None
    df = pl.read_parquet(files)
    df = df.filter(pl.col("budget").is_in(list(request.budgets)))
    if request.layers and "layer" in df.columns:
        df = df.filter(pl.col("layer").is_in(list(request.layers)))
    keys = ["ranking", "coverage", "budget"]
    if request.mode == "open":
        aggs = [pl.col("rse").mean(), pl.col("token_error").mean(),
                pl.col("mass_excluded").mean(), pl.col("experts_loaded").mean(),
                pl.col("unique_experts").mean(), pl.len().alias("tree_layers")]
    else:
        aggs = [pl.col("accepted_length").mean(), pl.col("captured_accepted_length").mean(),
                pl.col("path_unchanged").mean(), pl.col("top1_agreement").mean(),
                pl.col("mean_kl").mean(), pl.len().alias("trees")]
    return df.group_by(keys).agg(aggs).sort(keys)


__all__ = ["CatalogError", "ReplayError", "ReplayRequest", "calibration_stats", "parse_budgets",
           "replay", "summary_frame"]
