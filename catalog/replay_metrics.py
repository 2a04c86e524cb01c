"""Replay metrics, declared once: each result table's metric columns (name, Arrow type, how the
run summary and the analysis views aggregate it, and what it measures).

Everything else derives from these lists: the stored schema (:data:`catalog.schema.REPLAY_TABLES`),
the open-loop engine's output columns, the replay summary (``replay.plan.summary_frame``) and the
SQL of ``analysis.replay_views``. The formulas' code lives in ``replay.open_loop.metrics`` (per
tree-layer) and ``replay.closed_loop.tree_metrics`` (per tree), keyed by these names.

Adding a metric: one line here and its formula there; bump :data:`LAYOUT_VERSION` of the table
and add the new layout's :data:`FINGERPRINTS` line (results stored under the older layout are then
recomputed, never read with NULL columns).
"""

from __future__ import annotations

import hashlib
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


OPEN_TABLE, CLOSED_TABLE = "replay_open", "replay_closed"
BATCH_TABLE = "replay_batch"  # open loop over (virtual) batches: one row per pass × layer
CLOSED_BATCH_TABLE = "replay_closed_batch"  # closed loop over batches: one row per tree

METRICS: dict[str, tuple[Metric, ...]] = {
    # per (tree, layer, ranking, coverage, budget)
    OPEN_TABLE: (
        Metric("rse", pa.float64(), "Σ_t ||O*_t − Ô_t||² / Σ_t ||O*_t||²",
               interval="nonnegative"),
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
    ),
    # per (tree, ranking, coverage, budget)
    CLOSED_TABLE: (
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
    ),
}
# a batch's pass is one merged tree-layer (replay.virtual_batch): the open-loop metrics, over
# all Σ M_i tokens of its trees
METRICS[BATCH_TABLE] = METRICS[OPEN_TABLE]
# closed loop over (virtual) batches: a pass's trees re-verified together under one shortlist per
# layer; the closed-loop metrics per tree (experts_loaded: the pass's, shared by its trees)
METRICS[CLOSED_BATCH_TABLE] = METRICS[CLOSED_TABLE]

# Bumped whenever a table's metric columns (names or types) change; part of every result unit's
# key (catalog.results), so blocks of an older layout are recomputed, never mixed with new ones.
# 2 (replay_open, replay_batch): surrogate_ranked, where the sketch family ran its surrogate
# 3 (replay_open, replay_batch): predicted_rse, the surrogate's own error curve (issue 63)
LAYOUT_VERSION: dict[str, int] = {OPEN_TABLE: 3, CLOSED_TABLE: 1, BATCH_TABLE: 3,
                                  CLOSED_BATCH_TABLE: 1}
# :func:`fingerprint` of each (table, version): tests/test_replay_metrics.py fails when the
# declared columns differ from their version's, so a layout never changes without a bump (a new
# version adds its line here)
FINGERPRINTS: dict[tuple[str, int], str] = {
    (OPEN_TABLE, 1): "8f953f9016955a70",
    (CLOSED_TABLE, 1): "5b7c7fb80a18f8ed",
    (BATCH_TABLE, 1): "8f953f9016955a70",
    (CLOSED_BATCH_TABLE, 1): "5b7c7fb80a18f8ed",
    (OPEN_TABLE, 2): "b25a0cbb1260cbd3",
    (BATCH_TABLE, 2): "b25a0cbb1260cbd3",
    (OPEN_TABLE, 3): "00ea52481e541a9b",
    (BATCH_TABLE, 3): "00ea52481e541a9b",
}


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
    text = ";".join(f"{m.name}:{m.type}" for m in METRICS[table])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def view_select(table: str) -> str:
    """The aggregate select list of a table's analysis view (comma separated)."""
    return ", ".join(e for m in METRICS[table] for e in m.view_sql())
