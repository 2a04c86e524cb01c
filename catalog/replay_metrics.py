"""Replay result tables, declared once: one :class:`ReplayTable` record per table in
:data:`TABLES` (its metric columns: name, Arrow type, how the run summary and the analysis views
aggregate it, what it measures; its own key columns; whether rows are per tree-layer; its layout
versions; the frame the analysis draws from it).

Everything else derives from these records: the stored schema (:func:`catalog.schema.replay_schema`,
:data:`catalog.schema.REPLAY_TABLES`), the result writer and readers (:mod:`catalog.results`: the
tables, their layout keys), the SQL views ``<table>`` (one variant per curve) and ``<table>_all``
(:mod:`analysis.sql`), the curves frame (:func:`analysis.replay_views.curves`,
:data:`analysis.frames.ANALYSES`), the open-loop engine's output columns, the replay modes
(``replay.modes``: a mode names its record) and their summary (``replay.plan.summary_frame``).
The formulas' code lives in ``replay.open_loop.metrics`` (per tree-layer) and
``replay.closed_loop.tree_metrics`` (per tree), keyed by these names.

Adding a metric: one line in its table's list here and its formula there; add the new layout's
fingerprint to the record's ``layouts`` (results stored under the older layout are then
recomputed, never read with NULL columns). Adding a table: one :func:`register` call here (and
a mode in ``replay/modes.py`` naming it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

import pyarrow as pa


class Metric(NamedTuple):
    name: str  # the column
    type: pa.DataType
    description: str  # its formula (DESIGN.md)
    summary: bool = True  # averaged per ranking × coverage × budget in the replay summary
    view: str | None = ""  # its column in the analysis view ("": the name; None: left out)
    interval: str | None = None  # view adds a 95% interval of the mean: "plain" or "nonnegative"

    @property
    def view_name(self) -> str | None:
        return self.name if self.view == "" else self.view

    def view_mean(self) -> str:
        """SQL mean of the column over a group (a list column: the mean of its means)."""
        if pa.types.is_list(self.type):
            return f"avg(list_avg({self.name}))"
        if pa.types.is_boolean(self.type):
            return f"avg({self.name}::DOUBLE)"
        return f"avg({self.name})"

    def view_sql(self) -> list[str]:
        """The view's select expressions for this metric: its mean and, with ``interval``,
        ``mean ± 1.96 · sd / √n`` (floored at 0 for a nonnegative metric)."""
        if self.view_name is None:
            return []
        mean = self.view_mean()
        out = [f"{mean} AS {self.view_name}"]
        if self.interval:
            half = f"1.96 * coalesce(stddev_samp({self.name}), 0) / sqrt(count(*))"
            low = f"{mean} - {half}"
            if self.interval == "nonnegative":
                low = f"greatest({low}, 0)"
            out += [f"{low} AS {self.view_name}_lo", f"{mean} + {half} AS {self.view_name}_hi"]
        return out


def metrics_fingerprint(metrics: tuple[Metric, ...]) -> str:
    """Digest of metric columns' names and types, in order (a layout's fingerprint)."""
    text = ";".join(f"{m.name}:{m.type}" for m in metrics)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ReplayTable:
    """One replay result table, the one place it is declared (:func:`register`).

    Its stored schema is the replay key (``catalog.schema.REPLAY_KEY``: prompt, step; then
    ``layer`` where ``per_layer``; then :attr:`columns`; then ranking, coverage, budget) followed
    by :attr:`metrics`. A result unit's key carries the current layout version (the number of
    :attr:`layouts`), so results of an older layout are recomputed, never read with NULLs
    (those of a layout :attr:`reads` names are read meanwhile, their renamed columns renamed)."""

    name: str  # the folder under --out, and the SQL views <name> and <name>_all
    metrics: tuple[Metric, ...]
    per_layer: bool  # one row per tree-layer (cells: layer × budget), else per tree (budget)
    layouts: tuple[str, ...]  # :func:`metrics_fingerprint` of each layout version 1, 2, … (never
    # edited: a change of its columns appends the new version's; a change of key columns alone
    # appends the same fingerprint again)
    loop: str  # "open" (one MoE layer on captured inputs) or "closed" (a re-verified tree)
    counted: str  # what a row is, counted per cell by its curves frame (tree_layers, trees, …)
    columns: tuple[pa.Field, ...] = ()  # its own key columns, after the replay key's first ones
    frame: str | None = None  # its curves frame's name in analysis.frames.ANALYSES (None: none)
    reads: dict = field(default_factory=dict)  # older layout versions readers still read: version
    # → its key columns' renames (old name → current), applied by every reader (schema.RENAMED)

    @property
    def layout(self) -> int:
        """The current layout version."""
        return len(self.layouts)

    @property
    def views(self) -> tuple[str, str]:
        """Its SQL views: the default one (one variant per curve) and every variant's."""
        return self.name, f"{self.name}_all"


TABLES: dict[str, ReplayTable] = {}


def register(table: ReplayTable) -> ReplayTable:
    """Add ``table`` to :data:`TABLES` (its layouts checked: the last is its metrics')."""
    if table.name in TABLES:
        raise ValueError(f"replay table {table.name!r} is declared twice")
    if not table.layouts or table.layouts[-1] != metrics_fingerprint(table.metrics):
        raise ValueError(f"the metric columns of {table.name} are not its last layout's "
                         f"({metrics_fingerprint(table.metrics)}): append that fingerprint to "
                         "its layouts")
    TABLES[table.name] = table
    return table


OPEN_METRICS = (  # per (tree, layer, ranking, coverage, budget)
    Metric("rse", pa.float64(), "Σ_t ||O*_t − Ô_t||² / Σ_t ||O*_t||²", interval="nonnegative"),
    Metric("token_error", pa.float64(), "mean_t ||O*_t − Ô_t|| / ||O*_t||"),
    Metric("mass_excluded", pa.float64(), "Σ_{i∉S} s_i / Σ_i s_i, s_i = Σ_t g_i(t)"),
    Metric("experts_loaded", pa.int16(), "#{i : w_i(t) ≠ 0 for some t}"),
    Metric("unique_experts", pa.int16(), "|∪_t T_k(t)| without a budget", view=None),
    Metric("surrogate_ranked", pa.bool_(), "S searched on a surrogate's predicted outputs "
           "Ê_i(h_t) (the sketch family where it ran it; sketch-gated: novelty ≤ its "
           "threshold); the view's mean: the share of tree-layers", view="surrogate_share"),
    Metric("predicted_rse", pa.float64(), "ê = Σ_t ||Ô_t − Ô_t(S)||² / Σ_t ||Ô_t||² on the "
           "surrogate's predicted outputs Ê_i(h_t) (null where none ran)", summary=False,
           view=None),
)
CLOSED_METRICS = (  # per (tree, ranking, coverage, budget)
    Metric("accepted_length", pa.int16(), "τ under the budget (drafts + bonus)",
           view="tau", interval="plain"),
    Metric("captured_accepted_length", pa.int16(), "τ of the captured pass",
           view="tau_captured"),
    Metric("path_unchanged", pa.bool_(), "same accepted path and bonus token"),
    Metric("top1_agreement", pa.float64(), "share of nodes whose argmax is unchanged",
           view="top1"),
    Metric("mean_kl", pa.float64(), "mean_t KL(p_t ‖ p_t^B) over nodes, nats", view="kl"),
    Metric("experts_loaded", pa.list_(pa.int16()), "experts loaded, per MoE layer",
           summary=False),
)
# layout 2 of the open-loop tables: surrogate_ranked, where the sketch family ran its surrogate;
# 3: predicted_rse, the surrogate's own error curve (issue 63)
OPEN_LAYOUTS = ("8f953f9016955a70", "b25a0cbb1260cbd3", "00ea52481e541a9b")
CLOSED_LAYOUTS = ("5b7c7fb80a18f8ed",)
_BATCH_SIZE = pa.field("batch_size", pa.int16())  # b asked (virtual or captured)
_TREES = pa.field("trees", pa.int16())  # trees verified in the pass (≤ b)

OPEN = register(ReplayTable(
    "replay_open", OPEN_METRICS, per_layer=True, layouts=OPEN_LAYOUTS, loop="open",
    counted="tree_layers", frame="errors"))  # per (tree, layer)
CLOSED = register(ReplayTable(
    "replay_closed", CLOSED_METRICS, per_layer=False, layouts=CLOSED_LAYOUTS, loop="closed",
    counted="trees", frame="closed"))  # per tree
# open loop over (virtual) batches: a batch's pass is one merged tree-layer
# (replay.virtual_batch), the open-loop metrics over all Σ M_i tokens of its trees; one row per
# (batch, pass, layer, ranking, coverage, budget): prompt_index numbers the batch, prompt_id
# joins its prompts' ids with "+", step is the pass
BATCH = register(ReplayTable(
    "replay_batch", OPEN_METRICS, per_layer=True, layouts=OPEN_LAYOUTS, loop="open",
    counted="pass_layers", columns=(_BATCH_SIZE, _TREES), frame="batch_errors"))
# closed loop over (virtual) batches: a pass's trees re-verified together under one shortlist
# per layer; the closed-loop metrics per tree (experts_loaded: the pass's, shared by its trees),
# with the tree's own prompt and step and the pass that verified it (replay/closed_loop.py)
# (layout 2: the batch's number is batch_index, was batch; layout 1 results read renamed)
CLOSED_BATCH = register(ReplayTable(
    "replay_closed_batch", CLOSED_METRICS, per_layer=False, layouts=CLOSED_LAYOUTS * 2,
    loop="closed", counted="trees", columns=(
        _BATCH_SIZE,
        pa.field("batch_index", pa.int32()),  # the (virtual) batch: its number
        pa.field("batch_pass", pa.int32()),  # the pass (virtual: the step)
        _TREES), reads={1: {"batch": "batch_index"}}))

OPEN_TABLE, CLOSED_TABLE = OPEN.name, CLOSED.name
BATCH_TABLE, CLOSED_BATCH_TABLE = BATCH.name, CLOSED_BATCH.name

# (a new table: its register call above this line)
# Derived from the records, for readers (tests may patch a copy; declare nothing here)
METRICS: dict[str, tuple[Metric, ...]] = {t.name: t.metrics for t in TABLES.values()}
# part of every result unit's key (catalog.results), so blocks of an older layout are
# recomputed, never mixed with new ones
LAYOUT_VERSION: dict[str, int] = {t.name: t.layout for t in TABLES.values()}
# the fingerprint of each (table, version): tests/test_replay_metrics.py fails when the declared
# columns differ from their version's, so a layout never changes without a new version
FINGERPRINTS: dict[tuple[str, int], str] = {
    (t.name, v): f for t in TABLES.values() for v, f in enumerate(t.layouts, 1)}


def gap_closed(router, oracle, other):
    """Share of the router → oracle gap a ranking X closes:
    ``(RSE_router − RSE_X) / (RSE_router − RSE_oracle)``; None (null) where there is no gap
    (router ≤ oracle). The one definition: ``router``/``oracle``/``other`` are numbers (None
    allowed) or polars expressions (a column of the share), for every table and figure."""
    if type(router).__module__.startswith("polars"):
        import polars as pl
        gap = router - oracle
        return pl.when(gap > 0).then((router - other) / gap)
    if None in (router, oracle, other) or router - oracle <= 0:
        return None
    return (router - other) / (router - oracle)


def fields(table: str) -> list[pa.Field]:
    return [pa.field(m.name, m.type) for m in METRICS[table]]


def names(table: str) -> list[str]:
    return [m.name for m in METRICS[table]]


def fingerprint(table: str) -> str:
    """Digest of a table's metric names and types, in order."""
    return metrics_fingerprint(METRICS[table])


def view_select(table: str) -> str:
    """The aggregate select list of a table's analysis view (comma separated)."""
    return ", ".join(e for m in METRICS[table] for e in m.view_sql())
