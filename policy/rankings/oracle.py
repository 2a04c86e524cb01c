"""``oracle``: greedy reconstruction with every expert's output known (an upper bound, offline).

From S = ∅ add the expert that most reduces ``Σ_t ||O*_t − MoE_S(h_t)||²`` under the coverage
policy. Truncation has a closed form: with D the experts left out the error is
``Σ_{i,j∈D} A_ij``, ``A_ij = Σ_t ḡ_i(t) ḡ_j(t) Q_t[i, j]``, so it is
:func:`policy.greedy.greedy_quadratic`. Substitution re-routes tokens as S grows, so each step
scores all N candidates S ∪ {c} of every tree-layer in one batched call.
"""

from __future__ import annotations

import torch

from policy.coverage import Truncation
from policy.greedy import greedy_quadratic
from policy.rankings.base import Ranking, RankingError, register


@register
class Oracle(Ranking):
    name = "oracle"
    summary = "greedy reconstruction with every expert's output (upper bound, offline only)"
    runtime = False

    def order(self, batch, coverage, max_budget):
        if batch.terms is None:
            raise RankingError("oracle needs every expert's output (open-loop replay only)")
        if isinstance(coverage, Truncation):
            w = batch.dense_weights().double()
            a = torch.einsum("tmi,tmj,tmij->tij", w, w, batch.terms.q)
            return greedy_quadratic(a, torch.zeros(batch.size, batch.n, dtype=torch.float64,
                                                   device=batch.device), max_budget)
        t, n = batch.size, batch.n
        rows = torch.arange(t, device=batch.device)
        keep = torch.zeros(t, n, dtype=torch.bool, device=batch.device)
        eye = torch.eye(n, dtype=torch.bool, device=batch.device)
        steps = min(max_budget, n)
        order = torch.empty(t, steps, dtype=torch.long, device=batch.device)
        for s in range(steps):
            idx, w = coverage.apply(batch, keep[:, None, :] | eye)  # S ∪ {c}: [T, N, M, k]
            err = batch.token_sq_errors(idx, w).sum(-1).masked_fill(keep, float("inf"))
            best = err.argmin(-1)
            order[:, s] = best
            keep[rows, best] = True
        return order
