"""Replay fanned out on Ray: actors that load the model once take one prompt's tree-layers at a
time (open loop: the engine's batches of them; closed loop: its trees) and write that prompt's
parts of every pending block. The driver plans the blocks (under the units' locks), hands
prompts out from one queue and marks the blocks complete once every prompt is written, so the
results equal a single-process replay's (stateful rankings restart at each prompt either way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moe_spec.catalog import location, replay_metrics
from moe_spec.catalog.results import Block, UnitResults
from moe_spec.catalog.runs import Run


@dataclass
class TaskSpec:
    """A pending block, as data an actor can rebuild the task from."""

    table: str
    unit: dict
    block: Block
    ranking: str
    coverage: str


class ReplayWorker:
    def __init__(self, model: str, device: str, threads: int = 1, dtype: str = "auto"):
        import torch

        from moe_spec.moe import models
        from moe_spec.moe.adapter import MoEAdapter
        torch.set_num_threads(threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        models.quiet_transformers()
        loaded = models.load(model, device=device, dtype=dtype)
        self.adapter = MoEAdapter(loaded.model)
        self.device = loaded.device

    def ready(self) -> bool:
        """Returns once the actor is constructed (its model loaded)."""
        return True

    def replay(self, out: Path, run: Run, specs: list[TaskSpec], stats, prompts: list[int],
               max_batch: int | None) -> tuple[list[int], int]:
        """Write ``prompts``' parts of every block; returns the prompts and the tree-layers
        (open) or trees (closed) replayed."""
        from moe_spec.policy import coverage, rankings
        from moe_spec.replay import closed_loop
        from moe_spec.replay.engine import OpenLoopEngine, Task
        units = [UnitResults(location.root(out), s.table, run, s.unit) for s in specs]
        if replay_metrics.TABLES[specs[0].table].loop == "open":
            engine = OpenLoopEngine(self.adapter, self.device, progress=False,
                                    max_batch=max_batch)
            engine.run(run, [Task(u, s.block, rankings.get(s.ranking)().fit(stats),
                                  coverage.get(s.coverage)) for u, s in zip(units, specs)],
                       prompts, finish=False)
            return prompts, engine.tree_layers
        tasks = [closed_loop.ClosedTask(u, s.block, rankings.get(s.ranking),
                                        coverage.get(s.coverage), stats)
                 for u, s in zip(units, specs)]
        return prompts, closed_loop.replay_run(run, self.adapter, tasks, lambda xs: xs,
                                               prompts, finish=False)


def prompt_chunks(prompts: list[int], actors: int, per_actor: int = 4) -> list[list[int]]:
    """``prompts`` in order, cut into calls of a few prompts each (fewer round trips and engine
    set-ups than one per call), about ``per_actor`` calls per actor so that the last calls still
    balance the actors' load."""
    size = max(1, len(prompts) // (per_actor * max(1, actors)))
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def replay_distributed(ray, actors: list, out: Path, run: Run, specs: list[TaskSpec], stats,
                       max_batch: int | None, bar) -> int:
    """Every pending prompt of ``run`` through the actors; returns the work done."""
    units = [UnitResults(out, s.table, run, s.unit) for s in specs]
    pending = [p for p in run.prompt_indices()
               if any(p not in u.done_prompts(s.block) for u, s in zip(units, specs))]
    stats_ref = ray.put(stats)
    pool = ray.util.ActorPool(actors)
    work = 0
    for chunk, done in pool.map_unordered(
            # the root itself, not its text: an s3:// root carries the driver's storage options
            lambda a, c: a.replay.remote(out, run, specs, stats_ref, c, max_batch),
            prompt_chunks(pending, len(actors))):
        work += done
        bar.update(len(chunk))
    for unit, spec in zip(units, specs):
        unit.finish(spec.block)
    return work
