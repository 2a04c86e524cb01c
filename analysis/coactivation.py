"""Expert co-activation per MoE layer, in both conventions, with concentration and ordering.

* ``all_pairs`` (DESIGN.md): ``C[i, j]`` = tokens whose top-k holds both i and j (symmetric;
  the diagonal holds selection counts). Concentration = ``max_{i≠j} C[i, j] / expected``, with
  ``expected = M·k(k−1)/(N(N−1))`` the count under uniform independent routing of M tokens
  (≈ 1 for uniform random routing; MoE-Spec reports 10–33× on OLMoE).
* ``adjacent`` (OLMoE's own scripts): only pairs of experts at adjacent ranks of a token's
  top-k (rank r with r+1), counted both ways and row-normalised to ``P(b | a)``.

``lift`` (both conventions) is observed over expected under independent selection with the
measured marginals, off the diagonal only:

    lift[i, j] = C[i, j] / E[i, j],   E[i, j] = r_i · r_j · S / Σ_{a≠b} r_a · r_b,
    r_i = Σ_{j≠i} C[i, j],   S = Σ_i r_i

(``C`` the pair counts before row normalisation; under all pairs ``r_i = c_i·(k−1)`` with c_i
expert i's selections, so E ∝ c_i·c_j, and with uniform marginals E is the concentration's
``M·k(k−1)/(N(N−1))``). 1 = independent; the diagonal (selection counts) is NaN.

``cluster_order`` orders experts so that frequently co-activated ones sit together: average-link
hierarchical clustering of the distance ``1 − C[i,j]/sqrt(C[i,i]·C[j,j])`` (scipy), leaves in
dendrogram order.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np

from moe_spec.analysis.sql import matching


@dataclass
class Coactivation:
    layer: int
    matrix: np.ndarray  # [N, N]
    tokens: int
    top_k: int
    convention: str
    pair_counts: np.ndarray | None = None  # [N, N] counts before row normalisation (adjacent)

    @property
    def lift(self) -> np.ndarray:
        """Observed / expected under independent selection, NaN on the diagonal (:func:`lift`)."""
        return lift(self.matrix if self.pair_counts is None else self.pair_counts)

    @property
    def num_experts(self) -> int:
        return self.matrix.shape[0]

    @property
    def expected(self) -> float:
        n, k = self.num_experts, self.top_k
        return self.tokens * k * (k - 1) / (n * (n - 1))

    @property
    def concentration(self) -> float:
        """How far the strongest pair is above uniform independent routing, in the matrix's
        own convention: all pairs ``max_{i≠j} C[i, j] / (M·k(k−1)/(N(N−1)))``; adjacent ranks
        ``max_{a≠b} P(b | a) / (1/(N−1))``."""
        off = self.matrix - np.diag(np.diag(self.matrix))
        if self.convention == "adjacent":
            return float(off.max() * (self.num_experts - 1))
        return float(off.max() / self.expected)

    @property
    def concentration_rule(self) -> str:
        return ("max P(b|a) / uniform 1/(N−1)" if self.convention == "adjacent"
                else "max pair count / uniform expectation")


def topk_matrix(con: duckdb.DuckDBPyConnection, layer: int,
                match: dict | None = None) -> np.ndarray:
    """Top-k ids of every token in one layer as ``[M, k]`` (columnar, no Python rows), of the
    rows whose columns equal ``match`` (e.g. ``{"model": part, "bench": "mbpp"}``)."""
    cond, params = matching(match, f"layer = {int(layer)}")
    arr = con.sql(f"SELECT topk_ids FROM routing WHERE {cond}", params=params).to_arrow_table()
    arr = arr.column(0)
    arr = arr.combine_chunks()
    flat = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return flat.reshape(len(arr), -1)


def all_pairs(topk: np.ndarray, n: int) -> np.ndarray:
    """``C[i, j]``: tokens whose top-k holds both i and j; diagonal: selection counts."""
    m, k = topk.shape
    pairs = (topk[:, :, None] * n + topk[:, None, :]).reshape(-1)
    return np.bincount(pairs, minlength=n * n).reshape(n, n).astype(np.float64)


def adjacent_rank(topk: np.ndarray, n: int) -> np.ndarray:
    """OLMoE convention: adjacent-rank pairs, both directions, row-normalised to P(b | a)."""
    a, b = topk[:, :-1].reshape(-1), topk[:, 1:].reshape(-1)
    counts = np.bincount(np.r_[a * n + b, b * n + a], minlength=n * n).reshape(n, n)
    rows = counts.sum(1, keepdims=True)
    return np.divide(counts, rows, out=np.zeros((n, n)), where=rows > 0)


def lift(counts: np.ndarray) -> np.ndarray:
    """``C[i, j] / E[i, j]`` with ``E[i, j] = r_i·r_j·S / Σ_{a≠b} r_a·r_b`` (module docstring):
    pair counts over independent selection with the measured marginals; NaN on the diagonal and
    where E is 0 (an expert never in a pair)."""
    c = np.asarray(counts, dtype=np.float64)
    off = c - np.diag(np.diag(c))
    r = off.sum(1)
    s = r.sum()
    pairs = s * s - (r * r).sum()  # Σ_{a≠b} r_a r_b
    out = np.full(c.shape, np.nan)
    if pairs <= 0:
        return out
    expected = np.outer(r, r) * s / pairs
    np.divide(off, expected, out=out, where=expected > 0)
    np.fill_diagonal(out, np.nan)
    return out


def coactivation(con: duckdb.DuckDBPyConnection, layer: int, num_experts: int,
                 convention: str = "all_pairs", match: dict | None = None) -> Coactivation:
    """One layer's matrix in either convention over the runs whose columns equal ``match``
    (bound as parameters), summed from the runs' stored pair counts
    (:mod:`analysis.summaries`; :func:`all_pairs` and :func:`adjacent_rank` on the raw top-k are
    the definitions they reproduce)."""
    if convention not in ("all_pairs", "adjacent"):
        raise ValueError(f"unknown convention {convention!r}; use all_pairs or adjacent")
    from moe_spec.analysis.routing import require_summaries
    require_summaries(con)
    column = "coact_all" if convention == "all_pairs" else "coact_adjacent"
    cond, params = matching(match, f"layer = {int(layer)}")
    rows = con.execute(f"SELECT {column}, tokens, selections FROM summary_layers "
                       f"WHERE {cond}", params).fetchall()
    n = num_experts
    counts = np.zeros(n * n)
    tokens = selected = 0
    for values, tok, sel in rows:
        counts += np.asarray(values, dtype=np.float64)
        tokens += tok
        selected += sum(sel)
    counts = counts.reshape(n, n)
    top_k = round(selected / tokens) if tokens else 0
    matrix = counts
    if convention == "adjacent":
        per_row = counts.sum(1, keepdims=True)
        matrix = np.divide(counts, per_row, out=np.zeros((n, n)), where=per_row > 0)
    return Coactivation(layer, matrix, int(tokens), int(top_k), convention, counts)


def cluster_order(matrix: np.ndarray) -> np.ndarray:
    """Expert order that places co-activated experts next to each other."""
    from scipy.cluster.hierarchy import leaves_list, linkage
    from scipy.spatial.distance import squareform
    sym = (matrix + matrix.T) / 2
    diag = np.sqrt(np.clip(np.diag(sym), 1e-12, None))
    sim = sym / diag[:, None] / diag[None, :]
    if not np.isfinite(sim).all() or np.allclose(np.diag(matrix), 0):
        sim = sym / max(sym.max(), 1e-12)
    dist = np.clip(1 - sim, 0, None)
    np.fill_diagonal(dist, 0)
    return leaves_list(linkage(squareform(dist, checks=False), method="average"))
