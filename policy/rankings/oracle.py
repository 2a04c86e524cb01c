"""``oracle``: greedy reconstruction with every expert's output known (an upper bound, offline).

From S = ∅ add the expert that most reduces ``Σ_t ||O*_t − MoE_S(h_t)||²`` under the coverage
policy, for every tree-layer of a batch at once (``max_budget`` steps per batch).

* Truncation has a closed form: with D the experts left out the error is ``Σ_{i,j∈D} A_ij``,
  ``A_ij = Σ_t ḡ_i(t) ḡ_j(t) ⟨E_i(h_t), E_j(h_t)⟩``, built from each token's k selected outputs
  only, and minimised by :func:`policy.greedy.greedy_quadratic`.
* Substitution re-routes tokens as S grows: :func:`policy.substitution.greedy_order` scores
  every candidate's new error incrementally from the exact per-token Gram terms
  (:class:`policy.substitution.ExactGram`), O(T·M·N) per step. Group-limited routing falls back
  to scoring every candidate shortlist through the coverage policy.

  Under substitution the error is not monotone in S (a new member can re-route a token to a
  worse mix, and renormalisation rescales whatever is left), and greedy from ∅ can lock in
  early picks that suit a tiny S: on tiny-qwen3-moe (renormalised top-8 of 128) its prefixes
  were 2–9× *worse* than router ranking's. So for substitution the oracle's shortlist at each
  budget and tree-layer is the exact best of four candidates: the substitution greedy's prefix,
  the truncation greedy's prefix, router ranking's and squared mixing mass's (ties to the
  greedy). It is then never worse than router or sqmass ranking, and shortlists need not be
  nested. (With three candidates a calibrated ranking choosing between sqmass and its own order
  beat the "oracle" on tiny-qwen3-moe: 103% of the gap at B = 32.) It remains a heuristic bound:
  the best shortlist of B experts under substitution is not searched exhaustively.
"""

from __future__ import annotations

import torch

from policy.coverage import COVERAGES, Truncation
from policy.greedy import greedy_quadratic, pair_sums
from policy.rankings.base import Ranking, RankingError, by_mass, by_squared_mass, register
from policy.substitution import ExactGram, best_prefixes, greedy_order


@register
class Oracle(Ranking):
    name = "oracle"
    runtime = False  # as listed in policy.index
    version = 3  # 2: substitution takes the best of three candidates, 3: of four (docstring)

    def shortlists(self, batch, coverage, budgets):
        if isinstance(coverage, Truncation):
            return super().shortlists(batch, coverage, budgets)  # the greedy's prefixes
        most = max(budgets)
        orders = [self.order(batch, coverage, most),  # the substitution greedy first: ties
                  self.order(batch, COVERAGES["truncation"], most), by_mass(batch.mass()),
                  by_squared_mass(batch)]
        return best_prefixes(batch, coverage, orders, budgets,
                             lambda keep, idx, w: coverage.sq_errors(batch, keep, idx, w)), list(budgets)

    def order(self, batch, coverage, max_budget):
        if batch.terms is None:
            raise RankingError("oracle needs every expert's output (open-loop replay only)")
        if isinstance(coverage, Truncation):
            return greedy_quadratic(truncation_matrix(batch), torch.zeros(
                batch.size, batch.n, dtype=torch.float64, device=batch.device), max_budget)
        if batch.rule.group_limited:
            return candidates_order(batch, coverage, max_budget)
        return greedy_order(batch, ExactGram(batch), max_budget)


def truncation_matrix(batch) -> torch.Tensor:
    """``A [T, N, N]``: ``A_ij = Σ_t ⟨ḡ_i E_i(h_t), ḡ_j E_j(h_t)⟩`` over tokens whose top-k holds
    both (k² dot products per token, scattered)."""
    return pair_sums(batch.idx, batch.terms.natural, batch.n)


def candidates_order(batch, coverage, max_budget) -> torch.Tensor:
    """Greedy by scoring every candidate shortlist S ∪ {c} through the coverage policy."""
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
