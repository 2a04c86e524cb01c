"""Ids-only routing analyses: what the top-k expert ids of each token say on their own.

A routing-only run (``import-routing``: routing a serving engine returned, no router
probabilities) has nothing else; a capture's decode tokens (:mod:`catalog.tokens`) give the same
figures, so an imported run and the capture it was exported from agree exactly. Tokens are
grouped into *batch passes* (:func:`catalog.tokens.passes`): the source's recorded forward
passes, or virtual batches of b consecutive requests at the same decode step. Per pass and MoE
layer, with ``c_i`` the pass's tokens whose top-k holds expert i (its *routed-token count*;
``Σ_i c_i = m·k`` for m tokens):

* **heavy tails and coverage by counts**: shares ``c_i / (m·k)`` sorted descending, their
  cumulative ``C(B)``, experts for 50/90/99% of the assignments, Gini, top-N/2 share, and
  ``coverage_sum[B−1] = Σ_passes C(B)`` (MoE-Spec's coverage curve with counts for mass);
* **unions per batch**: ``|U|`` = experts with ``c_i > 0`` (what a pass must load);
* **activation growth**: ``U(t)`` = unique experts among the pass's first t tokens, summed over
  passes with ≥ t tokens (``growth_sum``, ``growth_count``), against MoESD's uniform
  ``N(t) = N·[1 − ((N−k)/N)^t]`` (:func:`analysis.routing.moesd_uniform`);
* **co-activation**: ``pairs[i, j]`` tokens holding i before j in their top-k, adjacent-rank pairs
  (both conventions of :mod:`analysis.coactivation`), selection counts;
* **truncation coverage** of expert budgets (:func:`truncation`): the share of token-expert
  assignments outside S, for ``static`` S (the top-B experts by selection count over a whole run:
  this one, or a calibration run) and ``frequency`` S (each pass's own top-B by count, what a
  runtime shortlist of counts keeps: ``1 − Σ_passes Σ_{r≤B} c_(r) / Σ m·k``).

Every per-layer sum is an integer (the coverage sum is kept per pass size and divided at the
end), so the figures do not depend on how passes were read in blocks: an import and its capture
give identical numbers. :func:`figures` returns them; :mod:`analysis.summaries` stores them as a
routing-only run's summary tables, so every routing page and the report draw it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from moe_spec.catalog import Run
from moe_spec.catalog import tokens as catalog_tokens

VERSION = 1  # of these definitions: a routing-only run's summaries are rebuilt when it changes
QUANTILES = (0.5, 0.9, 0.99)
ROW_COLUMNS = ("prompt_index", "step", "layer", "nodes", "unique_experts", "experts_50",
               "experts_90", "experts_99", "gini", "top_half_share")


@dataclass
class LayerSums:
    """One MoE layer's sums over every pass (all integers)."""

    n: int
    k: int
    passes: int = 0
    tokens: int = 0
    selections: np.ndarray = None  # [N]
    pairs: np.ndarray = None  # [N, N] tokens holding i at an earlier top-k position than j
    adjacent: np.ndarray = None  # [N, N] adjacent-rank pairs, both ways
    held: np.ndarray = None  # [N] Σ_passes Σ_{r≤B} c_(r)
    cover: dict = field(default_factory=dict)  # pass size m -> [N] Σ_passes Σ_{r≤B} c_(r)
    growth: np.ndarray = None  # difference array: Σ U(t) at t − 1
    counts: np.ndarray = None  # difference array: passes with ≥ t tokens at t − 1

    def __post_init__(self):
        n = self.n
        self.selections = np.zeros(n, np.int64)
        self.pairs = np.zeros((n, n), np.int64)
        self.adjacent = np.zeros((n, n), np.int64)
        self.held = np.zeros(n, np.int64)
        self.growth = np.zeros(2, np.int64)
        self.counts = np.zeros(2, np.int64)

    def _fit(self, size: int) -> None:
        if len(self.growth) < size + 1:
            grow = size + 1 - len(self.growth)
            self.growth = np.r_[self.growth, np.zeros(grow, np.int64)]
            self.counts = np.r_[self.counts, np.zeros(grow, np.int64)]

    @property
    def coverage_sum(self) -> np.ndarray:
        """Σ_passes C(B), B = 1..N (each pass's shares: its counts over m·k), float64."""
        total = np.zeros(self.n)
        for m in sorted(self.cover):  # a fixed order: the same sum however passes were read
            total += self.cover[m] / (m * self.k)
        return total

    @property
    def growth_sum(self) -> np.ndarray:
        return np.cumsum(self.growth)[:-1].astype(np.float64)

    @property
    def growth_count(self) -> np.ndarray:
        return np.cumsum(self.counts)[:-1]

    @property
    def coact_all(self) -> np.ndarray:
        coact = self.pairs + self.pairs.T
        np.fill_diagonal(coact, self.selections)
        return coact


@dataclass
class IdsFigures:
    """Every ids-only figure of one run (or a capture's decode tokens)."""

    run: str
    kind: str
    batching: str  # recorded | virtual
    batch_size: int | None  # b of virtual batches
    num_experts: int
    top_k: int
    layers: list[int]
    sums: dict[int, LayerSums]  # MoE layer -> its sums
    rows: dict[str, np.ndarray]  # one row per (pass, layer): ROW_COLUMNS

    @property
    def tokens(self) -> int:
        return next(iter(self.sums.values())).tokens if self.sums else 0

    @property
    def passes(self) -> int:
        return next(iter(self.sums.values())).passes if self.sums else 0


def reduce_block(block: catalog_tokens.Passes, li: int, sums: LayerSums) \
        -> dict[str, np.ndarray]:
    """Add one block of whole passes at MoE layer position ``li`` to ``sums``; its per-pass
    rows (without the pass keys and layer)."""
    n, k = sums.n, sums.k
    ids = block.ids[:, li, :].astype(np.int64)  # [R, k]
    sizes = np.diff(block.bounds).astype(np.int64)  # m per pass
    passes, rows = len(sizes), len(ids)
    g_of_row = np.repeat(np.arange(passes), sizes)
    counts = np.bincount((g_of_row[:, None] * n + ids).reshape(-1),
                         minlength=passes * n).reshape(passes, n)
    unique = (counts > 0).sum(1)
    desc = -np.sort(-counts, axis=1)
    cum = np.cumsum(desc, axis=1)  # [P, N] assignments held by the top-B
    total = sizes * k
    share = cum / total[:, None]
    experts = {q: (share < q - 1e-9).sum(1) + 1 for q in QUANTILES}
    r = np.arange(1, n + 1, dtype=np.int64)
    gini = ((2 * r - n - 1)[None, :] * desc[:, ::-1]).sum(1) / (n * total)
    top_half = cum[:, max(n // 2 - 1, 0)] / total
    # sums (integers)
    sums.passes += passes
    sums.tokens += rows
    sums.held += cum.sum(0)
    for m in np.unique(sizes).tolist():
        part = cum[sizes == m].sum(0)
        sums.cover[m] = sums.cover[m] + part if m in sums.cover else part
    # growth: the position at which each expert first appears in its pass
    pos = np.arange(rows) - np.repeat(block.bounds[:-1], sizes)
    big = np.iinfo(np.int64).max
    first = np.full(passes * n, big, np.int64)
    np.minimum.at(first, (g_of_row[:, None] * n + ids).reshape(-1), np.repeat(pos, k))
    seen = first < big
    f = first[seen]
    m_of = np.repeat(sizes, n)[seen]
    top = int(sizes.max()) if passes else 0
    sums._fit(top)
    width = len(sums.growth)
    sums.growth += np.bincount(f, minlength=width)[:width] - np.bincount(m_of, minlength=width)[:width]
    sums.counts[0] += passes
    sums.counts -= np.bincount(sizes, minlength=width)[:width]
    # token-level counts
    sums.selections += np.bincount(ids.reshape(-1), minlength=n)
    if k > 1:
        block_pairs = np.zeros(n * n, np.int64)
        block_adj = np.zeros(n * n, np.int64)
        for p, q in zip(*np.triu_indices(k, 1)):
            c = np.bincount(ids[:, p] * n + ids[:, q], minlength=n * n)
            block_pairs += c
            if q == p + 1:
                block_adj += c
        sums.pairs += block_pairs.reshape(n, n)
        adj = block_adj.reshape(n, n)
        sums.adjacent += adj + adj.T
    return dict(nodes=sizes, unique_experts=unique, experts_50=experts[0.5],
                experts_90=experts[0.9], experts_99=experts[0.99], gini=gini,
                top_half_share=top_half)


def figures(run: Run, *, batching: str = "auto", batch_size: int | None = None) -> IdsFigures:
    """Every ids-only figure of ``run`` (a routing-only run, or a capture's decode tokens),
    its tokens grouped into batch passes (:func:`catalog.tokens.passes`)."""
    kind, b = catalog_tokens.resolve_batching(run, batching, batch_size)
    n, k = int(run.manifest["num_experts"]), int(run.manifest["top_k"])
    layers = catalog_tokens.layers_of(run)
    sums = {layer: LayerSums(n, k) for layer in layers}
    chunks: dict[str, list] = {c: [] for c in ROW_COLUMNS}
    for block in catalog_tokens.passes(run, batching=kind, batch_size=b):
        for li, layer in enumerate(layers):
            found = reduce_block(block, li, sums[layer])
            chunks["prompt_index"].append(block.group)
            chunks["step"].append(block.step)
            chunks["layer"].append(np.full(len(block), layer, np.int64))
            for c, v in found.items():
                chunks[c].append(v)
    rows = {c: np.concatenate(v) if v else np.zeros(0) for c, v in chunks.items()}
    if len(rows["layer"]):  # by (pass, layer), as the summaries of a capture are ordered
        order = np.lexsort((rows["layer"], rows["step"], rows["prompt_index"]))
        rows = {c: v[order] for c, v in rows.items()}
    return IdsFigures(run.name, run.kind, kind, b, n, k, layers, sums, rows)


# --- what the figures say -------------------------------------------------------------------------
def top_b(counts: np.ndarray, budget: int) -> np.ndarray:
    """The ``budget`` experts with the most counts, ties to the lower id (DESIGN: ties)."""
    order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))
    return order[:budget]


def truncation(figs: IdsFigures, budgets: list[int] | None = None,
               calibration: IdsFigures | None = None) -> pl.DataFrame:
    """Per MoE layer and budget B: the share of token-expert assignments outside S.
    ``static``: S = the top-B experts by selection count of ``calibration`` (default: this run,
    in-sample); ``frequency``: S = each pass's own top-B by count."""
    n, k = figs.num_experts, figs.top_k
    budgets = budgets or sorted({max(1, n * q // 8) for q in range(1, 8)} | {k})
    rows = []
    for layer in figs.layers:
        s = figs.sums[layer]
        total = s.tokens * k
        if not total:
            continue
        source = (calibration.sums[layer] if calibration is not None else s).selections
        for budget in budgets:
            if not 1 <= budget <= n:
                raise ValueError(f"budget {budget} is outside 1..{n}")
            kept = s.selections[top_b(source, budget)].sum()
            rows.append(dict(layer=layer, budget=budget,
                             static_outside=1 - kept / total,
                             frequency_outside=1 - s.held[budget - 1] / total,
                             assignments=total))
    return pl.DataFrame(rows, schema=dict(layer=pl.Int64, budget=pl.Int64,
                                          static_outside=pl.Float64,
                                          frequency_outside=pl.Float64, assignments=pl.Int64))


def unions(figs: IdsFigures) -> pl.DataFrame:
    """Per MoE layer: experts a batch pass loads (its union), mean and percentiles, and its
    tokens."""
    frame = pl.DataFrame({c: figs.rows[c] for c in ("layer", "nodes", "unique_experts")})
    return frame.group_by("layer").agg(
        pl.len().alias("passes"), pl.col("nodes").mean().alias("tokens_per_pass"),
        pl.col("unique_experts").mean().alias("union_mean"),
        pl.col("unique_experts").quantile(0.5).alias("union_p50"),
        pl.col("unique_experts").quantile(0.9).alias("union_p90"),
        pl.col("unique_experts").max().alias("union_max")).sort("layer")


def growth(figs: IdsFigures) -> pl.DataFrame:
    """Measured unique experts among a pass's first t tokens (mean over passes with ≥ t
    tokens, then over layers) beside MoESD's uniform N(t) and the i.i.d. expectation with each
    layer's own marginals."""
    from moe_spec.analysis.routing import moesd_marginal, moesd_uniform
    n, k = figs.num_experts, figs.top_k
    frames = []
    for layer in figs.layers:
        s = figs.sums[layer]
        count = s.growth_count
        t = np.flatnonzero(count > 0) + 1
        if not len(t):
            continue
        q = s.selections / max(s.tokens, 1)
        frames.append(pl.DataFrame(dict(layer=np.full(len(t), layer), tokens=t,
                                        unique_experts=s.growth_sum[t - 1] / count[t - 1],
                                        passes=count[t - 1],
                                        marginal=moesd_marginal(q, t))))
    if not frames:
        return pl.DataFrame()
    per = pl.concat(frames)
    out = per.group_by("tokens").agg(pl.col("unique_experts").mean(), pl.col("passes").sum(),
                                     pl.col("marginal").mean()).sort("tokens")
    return out.with_columns(uniform=pl.Series(moesd_uniform(n, k, out["tokens"].to_numpy())))


def key_numbers(figs: IdsFigures) -> list[tuple[str, str]]:
    """The report's key numbers of a routing-only run (or group of them)."""
    n, k = figs.num_experts, figs.top_k
    u = unions(figs)
    trunc = truncation(figs, [max(k, n // 4), max(k, n // 2)])
    how = ("recorded forward passes of the source" if figs.batching == "recorded" else
           f"virtual batches of b = {figs.batch_size} consecutive requests at the same decode "
           "step")
    out = [("decode tokens", f"{figs.tokens:,} in {figs.passes:,} batch passes ({how})"),
           ("experts a batch pass loads per layer (union)",
            f"{u['union_mean'].mean():.1f} of {n} (mean over layers; "
            f"{u['tokens_per_pass'].mean():.1f} tokens a pass)" if u.height else "—")]
    for budget, g in trunc.group_by("budget", maintain_order=True):
        out.append((f"assignments outside a budget of B = {budget[0]} (static: the run's top-B "
                    "by count; frequency: each pass's top-B)",
                    f"static {g['static_outside'].mean():.1%}, frequency "
                    f"{g['frequency_outside'].mean():.1%} (mean over layers)"))
    return out
