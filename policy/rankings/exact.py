"""``exact``: the B-subset with the least reconstruction error, by exhaustive search.

Every one of the C(N, B) subsets is scored from the Gram terms (the ground truth oracle and coact
are checked against); only where C(N, B) ≤ 5000 (every budget of an 8-expert model; its
``subset_limit`` in :mod:`policy.index`). Budgets beyond the limit are reported by
:meth:`skipped`, never silently dropped.
"""

from __future__ import annotations

import itertools

import torch

from moe_spec.policy.rankings.base import Ranking, RankingError, register


@register
class Exact(Ranking):
    name = "exact"

    def order(self, batch, coverage, max_budget):
        raise RankingError("exact search gives a best subset per budget, not an order")

    def shortlists(self, batch, coverage, budgets):
        if batch.terms is None:
            raise RankingError("exact needs every expert's output (open-loop replay only)")
        valid = [b for b in budgets if b not in self.skipped(batch.n, budgets)]
        masks = [exhaustive_best(batch, coverage, b) for b in valid]
        if not masks:
            return torch.zeros(batch.size, 0, batch.n, dtype=torch.bool, device=batch.device), []
        return torch.stack(masks, 1), valid



def exhaustive_best(batch, coverage, budget: int) -> torch.Tensor:
    """``[T, N]``: each tree-layer's best B-subset over all C(N, B), scored from the Gram terms
    (ties to the first subset in lexicographic order)."""
    n, t = batch.n, batch.size
    subsets = torch.tensor(list(itertools.combinations(range(n), budget)), device=batch.device)
    keep = torch.zeros(len(subsets), n, dtype=torch.bool, device=batch.device)
    keep.scatter_(1, subsets, True)
    best = torch.zeros(t, n, dtype=torch.bool, device=batch.device)
    best_err = torch.full((t,), float("inf"), dtype=torch.float64, device=batch.device)
    for chunk in keep.split(512):
        cand = chunk.expand(t, *chunk.shape)
        idx, w = coverage.apply(batch, cand)
        err = batch.token_sq_errors(idx, w).sum(-1)  # [T, chunk]
        low, i = err.min(-1)
        better = low < best_err
        best = torch.where(better[:, None], chunk[i], best)
        best_err = torch.where(better, low, best_err)
    return best
