"""The two replay modes as objects: what each stores, scores and prints, asked instead of
testing a mode string (``--mode open|closed`` looks one up in :data:`MODES`).

* :class:`OpenLoop`: one MoE layer at a time on captured inputs, one row per tree-layer
  (per-layer cells; only the layers whose MoE tensors the storage policy kept);
* :class:`ClosedLoop`: the budget in every layer of a re-verified tree, one row per tree
  (cells per budget; runtime rankings only);
* over (virtual) batches of b trees (``--batch-size b``, :func:`batched`): one shortlist per pass
  and layer, :class:`BatchedOpenLoop` (one row per pass × layer) and :class:`BatchedClosedLoop`
  (the pass's trees re-verified in one batched forward, one row per tree).

Importing this module imports neither torch nor the model code (the planner uses it); running a
mode's tasks imports them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from moe_spec.catalog import replay_metrics
from moe_spec.catalog.replay_metrics import Metric, ReplayTable


def stored_layers(run, layers: list[int]) -> list[int]:
    """Of ``layers``, those whose MoE tensors the run's storage policy kept (open loop needs
    them; routing is always complete)."""
    kept = run.manifest.get("storage", {}).get("layers")
    return layers if kept is None else [x for x in layers if x in kept]


def storage_note(run) -> str | None:
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


class ReplayMode(ABC):
    name: str  # the --mode value, and the unit keys' "mode"
    record: ReplayTable  # the result table it writes (catalog.replay_metrics.TABLES)
    counted: str  # what a summary row counts (a column and a ReplayOutcome field)
    counted_unit: str  # its name in the summary's first line
    headline: str  # the metric the summary's pivots show
    headline_text: str
    digits: int  # of the headline in the summary
    runtime_rankings_only: bool  # offline rankings (needing the whole tree's routing) refused
    executes: bool  # runs the target's passes under the budget (a learning ranking's adaptive
    # state then observes what its own passes ran: policy.index.adapts)

    @property
    def table(self) -> str:
        """The result table's name."""
        return self.record.name

    @property
    def per_layer(self) -> bool:
        """Cells are layer × budget (else budget): the table's rows are tree-layers."""
        return self.record.per_layer

    @property
    def metrics(self) -> tuple[Metric, ...]:
        return self.record.metrics

    def summary_aggregates(self) -> list:
        """The run summary's polars aggregates: the mean of each declared summary metric and the
        rows counted."""
        import polars as pl
        return [pl.col(m.name).mean() for m in self.metrics if m.summary] + \
            [pl.len().alias(self.counted)]

    def cell_layers(self, run_layers: list[int]) -> list[int] | None:
        """The layers a unit's cells are keyed by (None: cells are budgets alone)."""
        return run_layers if self.per_layer else None

    def scored_layers(self, run, layers: list[int], notes: list[str]) -> list[int]:
        """The layers of ``run`` this mode can score, appending to ``notes`` what a partial
        storage policy left out."""
        return layers

    def summary_note(self, frame) -> str:
        """What the summary's first line adds after the cell counts."""
        return ""

    @abstractmethod
    def task(self, unit, block, ranking_cls, cover, stats):
        """One pending block as a task of this mode's engine."""

    @abstractmethod
    def compute(self, run, tasks: list, engine, adapter, progress: bool) -> int:
        """Score ``tasks`` of ``run`` in this process; returns what was computed, counted in
        :attr:`counted` (tree-layers or trees)."""

    def title(self) -> str:
        return f"{self.name}-loop replay"

    def key(self) -> dict:
        """What besides the name makes this mode's results comparable (a result unit's key)."""
        return {}

    def source(self, run):
        """The units of ``run`` this mode scores (None: each prompt alone; :class:`Batched`:
        each (virtual) batch)."""
        return None

    def constants(self) -> dict:
        """Key columns every result row gets besides its own keys (``batch_size``)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OpenLoop(ReplayMode):
    name, record = "open", replay_metrics.OPEN
    counted, counted_unit = "tree_layers", "tree-layers"
    headline, headline_text, digits = "rse", "mean RSE (lower is better)", 4
    runtime_rankings_only = False
    executes = False

    def scored_layers(self, run, layers: list[int], notes: list[str]) -> list[int]:
        note = storage_note(run)
        if note:
            notes.append(note)
        return stored_layers(run, layers)

    def task(self, unit, block, ranking_cls, cover, stats):
        from moe_spec.replay.engine import Task
        return Task(unit, block, ranking_cls().fit(stats), cover)

    def compute(self, run, tasks: list, engine, adapter, progress: bool) -> int:
        before = engine.tree_layers
        engine.run(run, tasks, source=self.source(run), constants=self.constants())
        return engine.tree_layers - before


class ClosedLoop(ReplayMode):
    name, record = "closed", replay_metrics.CLOSED
    counted, counted_unit = "trees", "trees"
    headline, headline_text, digits = \
        "accepted_length", "mean accepted length τ under the budget (higher is better)", 3
    runtime_rankings_only = True
    executes = True

    def summary_note(self, frame) -> str:
        if "captured_accepted_length" not in frame.columns:
            return ""
        return f"; captured τ {frame['captured_accepted_length'].mean():.3f}"

    def task(self, unit, block, ranking_cls, cover, stats):
        from moe_spec.replay.closed_loop import ClosedTask
        return ClosedTask(unit, block, ranking_cls, cover, stats)

    def compute(self, run, tasks: list, engine, adapter, progress: bool) -> int:
        from tqdm import tqdm

        from moe_spec.replay import closed_loop
        source = self.source(run)
        bar = lambda xs: tqdm(xs, desc=f"replay {run.name}", disable=not progress,  # noqa: E731
                              unit="prompt" if source is None else "batch")
        return closed_loop.replay_run(run, adapter, tasks, bar, source=source,
                                      constants=self.constants())


class Batched:
    """A mode over (virtual) batches of ``batch_size`` trees (:mod:`replay.virtual_batch`): one
    shortlist per pass and layer over all the pass's tree tokens. Not in :data:`MODES`:
    ``--mode open|closed --batch-size b`` makes one (:func:`batched`)."""

    def __init__(self, batch_size: int, seed: int = 0):
        self.batch_size, self.seed = batch_size, seed

    def key(self) -> dict:
        return dict(batch_size=self.batch_size, batch_seed=self.seed)

    def source(self, run):
        """The run's units: each (virtual) batch, with its passes."""
        from moe_spec.replay.virtual_batch import BatchSource
        return BatchSource(run, self.batch_size, self.seed)

    def constants(self) -> dict:
        return dict(batch_size=self.batch_size)

    def title(self) -> str:
        return (f"{self.record.loop}-loop replay over batches of {self.batch_size} (one "
                "shortlist per pass)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_size={self.batch_size}, seed={self.seed})"


class BatchedOpenLoop(Batched, OpenLoop):
    """Open loop over batches: a pass's trees merged into one tree-layer of all their tokens, one
    row per pass × layer (``replay_batch``)."""

    record = replay_metrics.BATCH
    counted, counted_unit = "tree_layers", "pass-layers"


class BatchedClosedLoop(Batched, ClosedLoop):
    """Closed loop over batches: each pass's trees re-verified in one batched target forward
    with the budget in every MoE layer (one shortlist per pass and layer), one row per tree with
    its pass (``replay_closed_batch``; :mod:`replay.closed_loop`)."""

    record = replay_metrics.CLOSED_BATCH


MODES: dict[str, ReplayMode] = {m.name: m for m in (OpenLoop(), ClosedLoop())}


def batched(mode: ReplayMode | str, batch_size: int, seed: int = 0) -> ReplayMode:
    """``mode`` over batches of ``batch_size`` (1: ``mode`` itself)."""
    mode = get(mode)
    if batch_size == 1:
        return mode
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size} must be at least 1")
    if isinstance(mode, Batched):
        raise ValueError(f"{mode!r} is over batches already")
    return (BatchedClosedLoop if isinstance(mode, ClosedLoop) else BatchedOpenLoop)(batch_size,
                                                                                  seed)


def get(mode: str | ReplayMode) -> ReplayMode:
    """The mode named by ``--mode`` (a mode object is returned as it is)."""
    if isinstance(mode, ReplayMode):
        return mode
    try:
        return MODES[mode]
    except KeyError:
        raise ValueError(f"unknown replay mode {mode!r}; use {' or '.join(MODES)}") from None
