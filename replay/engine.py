"""The open-loop replay engine: stream a run's tree-layers in batches, score every pending task.

    for each prompt (one in memory at a time), tree-layers in (step, layer) order:
        fill a batch of up to T tree-layers (T from the memory budget), pad to a common M
        E = every expert's output for the whole batch       one call per MoE layer present
        Gram terms q, b, ||O*||²                             one einsum
        for each task (ranking × coverage × block of layers × budgets):
            shortlists = ranking over the batch              greedy loops: N steps per batch
            metrics for all budgets                          one tensor op
        write each finished prompt's rows per task, columnar

A *task* is one pending block of one result unit (:mod:`catalog.results`); prompts a task already
wrote (an interrupted replay) are skipped for that task.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from moe_spec.catalog import location, replay_metrics, schema
from moe_spec.catalog.results import Block, UnitResults
from moe_spec.catalog.runs import Run
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.policy import index
from moe_spec.policy.coverage import Coverage
from moe_spec.policy.prices import Prices
from moe_spec.policy.rankings import Ranking
from moe_spec.replay import open_loop
from moe_spec.replay.open_loop import Slice, Stream

WORK_BYTES = 256 * 2**20  # target size of a batch's expert outputs and Gram terms


@dataclass
class Task:
    unit: UnitResults
    block: Block
    ranking: Ranking
    coverage: Coverage
    done: set[int] = field(default_factory=set)  # prompts already written
    stream: Stream = field(default_factory=Stream)
    rows: dict[int, list[dict]] = field(default_factory=dict)  # prompt -> column blocks
    budget_mode: str = index.FIXED  # every row's budget_mode (policy.index.budget_mode)
    prices: Prices | None = None  # adaptive: the calibrated price rule; budgets are means B̄


def chunk_size(m: int, n: int, h: int, budget_bytes: int = WORK_BYTES) -> int:
    """Tree-layers per compute chunk (scored together, one call per MoE layer) so that
    ``E [T, M, N, H]`` (fp32 and its fp64 copy) and the Gram ``q [T, M, N, N]`` (fp64) together
    stay near ``budget_bytes``."""
    per_tree_layer = m * n * (12 * h + 8 * n + 16)
    return max(1, min(1024, budget_bytes // per_tree_layer))


OPEN_TABLE = replay_metrics.OPEN_TABLE
OPEN_METRICS = replay_metrics.names(OPEN_TABLE)


def columns(keys: dict, task: Task, budgets: list[int], m: dict, table: str = OPEN_TABLE,
            constants: dict | None = None) -> dict:
    """One columnar block of ``table``'s rows (``replay_open``, ``replay_batch`` whose tree-
    layers are merged passes, or any open-loop table its record declares): the tree-layers of
    ``keys`` × ``budgets``, with those of the metrics ``m`` (``[T, B]`` each, exactly the
    open-loop ones) the table declares; key columns the schema has beyond the open-loop ones
    come from ``keys`` (per tree-layer) or ``constants``."""
    if sorted(m) != sorted(OPEN_METRICS):
        raise ValueError(f"open-loop metrics {sorted(m)} differ from the declared "
                         f"{sorted(OPEN_METRICS)} (catalog/replay_metrics.py)")
    unknown = set(replay_metrics.names(table)) - set(m)
    if unknown:
        raise ValueError(f"{table} declares metrics open loop does not compute: "
                         f"{sorted(unknown)} (catalog/replay_metrics.py)")
    t, nb = len(keys["step"]), len(budgets)
    rep = lambda a: np.repeat(np.asarray(a), nb)  # noqa: E731
    sch = schema.REPLAY_TABLES[table]
    metric_columns = {k: v.detach().cpu().numpy().reshape(-1).astype(
        sch.field(k).type.to_pandas_dtype()) for k, v in m.items() if k in sch.names}
    out = dict(
        prompt_index=rep(keys["prompt_index"]).astype(np.int32),
        prompt_id=list(rep(keys["prompt_id"])),
        step=rep(keys["step"]).astype(np.int32), layer=rep(keys["layer"]).astype(np.int16),
        ranking=[task.ranking.name] * (t * nb), coverage=[task.coverage.name] * (t * nb),
        budget=np.tile(np.asarray(budgets, np.int16), t), **metric_columns,
        price=list(np.tile(np.asarray(price_column(task, budgets), dtype=object), t)))
    for name in sch.names:
        if name not in out:
            given = {"budget_mode": getattr(task, "budget_mode", index.FIXED), **(constants or {})}
            value = rep(keys[name]) if name in keys else np.full(t * nb, given[name])
            out[name] = value.astype(sch.field(name).type.to_pandas_dtype())
    return out


def price_column(task, budgets: list[int]) -> list[float | None]:
    """The ``price`` of each budget's rows: an adaptive task's calibrated λ of that mean budget,
    None (null) for fixed budgets."""
    prices = getattr(task, "prices", None)
    return [None if prices is None else prices.prices[b] for b in budgets]


def blocks_to_table(blocks: list[dict], table: str) -> pa.Table:
    sch = schema.REPLAY_TABLES[table]
    if not blocks:
        return sch.empty_table()
    cols = {name: np.concatenate([np.asarray(b[name], dtype=object if isinstance(b[name], list)
                                             else None) for b in blocks])
            for name in sch.names}
    return pa.Table.from_pydict({k: pa.array(v, type=sch.field(k).type, from_pandas=True)
                                 for k, v in cols.items()}, schema=sch)  # NaN: null


class OpenLoopEngine:
    def __init__(self, adapter: MoEAdapter, device: torch.device, *, progress: bool = True,
                 max_batch: int | None = None):
        self.adapter = adapter
        self.device = device
        self.progress = progress
        self.max_batch = max_batch
        self.tree_layers = 0  # processed, for throughput
        self.seconds = 0.0

    def run(self, run: Run, tasks: list[Task], prompts: list[int] | None = None,
            finish: bool = True, source=None, constants: dict | None = None) -> None:
        """Score every pending prompt (or only ``prompts``) of ``run`` for every task; with
        ``finish`` mark the tasks' blocks complete afterwards (a Ray driver does that itself).
        ``source`` gives the units scored and their tree-layers (default: the run's prompts,
        :class:`replay.virtual_batch.PromptSource`; batches: ``BatchSource``), ``constants``
        the key columns every row of this run gets (``batch_size``)."""
        from moe_spec.replay.virtual_batch import PromptSource
        if not tasks:
            return
        source = source or PromptSource(run)
        self.constants = constants or {}
        start = time.perf_counter()
        for task in tasks:
            task.done = task.unit.done_prompts(task.block)
        layers = sorted({x for t in tasks for x in t.block.layers})
        prompts = [p for p in (source.keys() if prompts is None else prompts)
                   if any(p not in t.done for t in tasks)]
        tolerance = open_loop.gold_tolerance(run.manifest)
        self.weight_dtype = open_loop.captured_weight_dtype(run.manifest)
        total = len(prompts) * len(layers) * _steps_hint(run)
        bar = tqdm(total=total or None, desc=f"replay {run.name}", unit="tree-layer",
                   disable=True if not self.progress else None, smoothing=0.1)
        pending: list[Slice] = []
        left: dict[int, int] = {}  # prompt -> tree-layers read but not yet scored
        size = None
        for prompt in prompts:
            left[prompt] = 1  # held open until the prompt's last chunk is read
            for data in source.chunks(prompt):
                rows = data.select(layers)
                left[prompt] += len(rows)
                if size is None and rows:
                    size = self.max_batch or chunk_size(int(np.diff(data.bounds).max()),
                                                        data.probs.shape[1], data.hidden.shape[1])
                while rows:
                    room = size - sum(len(s.rows) for s in pending)
                    pending.append(Slice(data, rows[:room]))
                    rows = rows[room:]
                    if sum(len(s.rows) for s in pending) >= size:
                        self._score(pending, tasks, left, tolerance, run.name, bar)
                        pending = []
            left[prompt] -= 1
            if left[prompt] == 0:  # every tree-layer of it scored already
                self._flush(prompt, tasks)
        if pending:
            self._score(pending, tasks, left, tolerance, run.name, bar)
        bar.total = bar.n  # ends at n/n whatever the estimate (stored passes, batches)
        bar.refresh()
        bar.close()
        if finish:
            for task in tasks:
                task.unit.finish(task.block)
        self.seconds += time.perf_counter() - start

    def _score(self, slices: list[Slice], tasks: list[Task], left: dict, tolerance: float,
               run: str, bar) -> None:
        batch = open_loop.load_batch(slices, self.adapter, self.device, tolerance, run,
                                     self.weight_dtype)
        keys = dict(
            prompt_index=np.array([s.data.prompt_index for s in slices for _ in s.rows]),
            prompt_id=np.array([s.data.prompt_id for s in slices for _ in s.rows], dtype=object),
            step=np.array([int(s.data.step[r]) for s in slices for r in s.rows]),
            layer=np.array([int(s.data.layer[r]) for s in slices for r in s.rows]),
            trees=np.array([1 if s.data.trees is None else int(s.data.trees[r])
                            for s in slices for r in s.rows]))
        prompts_t = torch.as_tensor(keys["prompt_index"], device=self.device)
        steps_t = torch.as_tensor(keys["step"], device=self.device)
        for task in tasks:
            want = np.isin(keys["layer"], task.block.layers) & \
                ~np.isin(keys["prompt_index"], list(task.done))
            if not want.any():
                continue
            rows = torch.as_tensor(np.flatnonzero(want), device=self.device)
            sub = batch if bool(want.all()) else batch.take(rows)
            if task.prices is None:
                keep, budgets = open_loop.shortlists(task.ranking, sub, task.coverage,
                                                     task.block.budgets, prompts_t[rows],
                                                     steps_t[rows], task.stream)
            else:  # the price rule's shortlist per tree-layer; rows keyed by the mean B̄
                budgets = task.block.budgets
                keep = open_loop.adaptive_shortlists(task.ranking, sub, task.coverage, budgets,
                                                     task.prices, prompts_t[rows],
                                                     steps_t[rows], task.stream)
            m = open_loop.metrics(sub, keep, task.coverage, task.ranking.surrogate_ranked(sub),
                                  task.ranking.predicted)
            sel = {k: v[want] for k, v in keys.items()}
            for prompt in np.unique(sel["prompt_index"]).tolist():
                at = sel["prompt_index"] == prompt
                block = columns({k: v[at] for k, v in sel.items()}, task, budgets,
                                {k: v[torch.as_tensor(at, device=v.device)] for k, v in m.items()},
                                task.unit.table, self.constants)
                task.rows.setdefault(prompt, []).append(block)
        for s in slices:
            left[s.data.prompt_index] -= len(s.rows)
            if left[s.data.prompt_index] == 0:
                self._flush(s.data.prompt_index, tasks)
        self.tree_layers += batch.size
        if bar.total is not None and bar.n + batch.size > bar.total:
            bar.total = bar.n + batch.size  # the total was an estimate: never n above it
        bar.update(batch.size)

    @staticmethod
    def _flush(prompt: int, tasks: list[Task]) -> None:
        for task in tasks:
            if prompt in task.done:
                continue
            task.unit.write_part(task.block, prompt,
                                 blocks_to_table(task.rows.pop(prompt, []), task.unit.table))
            task.done.add(prompt)


def _steps_hint(run: Run) -> int:
    """Verification passes per prompt, for the progress bar's total (from the trees table)."""
    try:
        trees = location.read_table(run.files("trees"), columns=["step"]).num_rows
        return max(1, -(-trees // max(1, len(run.prompt_indices()))))  # rounded up
    except (OSError, pa.ArrowInvalid):
        return 1
