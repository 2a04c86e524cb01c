"""``coact``: a co-activation-aware expert selector that needs no expert outputs at run time.

The oracle picks S to minimise the truncation error Σ_t ||Σ_{i∈D} ḡ_i(t) E_i(h_t)||², D the
experts left out. Expanding the square,

    err(D) = Σ_{i,j∈D} Σ_t ḡ_i(t) ḡ_j(t) ⟨E_i(h_t), E_j(h_t)⟩.

At verification time the tree's router gives ``A_ij = Σ_t ḡ_i(t) ḡ_j(t)`` exactly — the tree's
co-activation matrix weighted by mixing weights — but not the expert outputs. coact replaces the
unknown inner products by their calibration averages ``G_ij`` (:mod:`policy.calibration`) and
greedily builds S from ∅, each time adding the expert c that most reduces the predicted error
``Σ_{i,j∈D} A_ij G_ij`` (:func:`policy.greedy.greedy_quadratic`). Relative to router ranking this
weighs an expert by the size of its outputs, by squared rather than linear mixing weights, and by
whether its outputs add up with or cancel those of experts it fires with. Ties (experts no tree
token routes to) fall back to router mass. Cost: O(N²) per added expert, no expert evaluation.

Under substitution the objective above is the wrong one (tokens whose experts are left out run
S's best instead, renormalised), so coact keeps, per tree-layer and budget, whichever of its own
order, squared mixing mass and router mass has the lowest substitution error *predicted* with
the same G (:class:`policy.rankings.base.SubstitutionAware`). Still runtime-legal.
"""

from __future__ import annotations

from moe_spec.policy.greedy import greedy_quadratic
from moe_spec.policy.rankings.base import Ranking, SubstitutionAware, mass_tiebreak, register


@register
class Coact(SubstitutionAware, Ranking):
    name = "coact"
    order_reads_coverage = False  # cached for both policies (Ranking.batch_order)

    def order(self, batch, coverage, max_budget):
        w = batch.dense_weights().double()  # [T, M, N]
        a = w.transpose(1, 2) @ w  # A_ij = Σ_t ḡ_i ḡ_j
        return greedy_quadratic(a * self.mean_gram(batch), mass_tiebreak(batch), max_budget)
