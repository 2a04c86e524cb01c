"""``sqmass``: the first step of coact's ablation — squared mixing mass ``A_ii = Σ_t ḡ_i(t)²``.

The truncation error of dropping expert i alone, with every expert output the same size and
orthogonal to the others, is ``A_ii``: this ranking is coact with ``G = I``. It differs from
``router`` only by squaring the (renormalised) mixing weights instead of summing raw router
probabilities, so experts that dominate a few tokens gain on experts spread thinly over many.
"""

from __future__ import annotations

from moe_spec.policy.rankings.base import Ranking, by_squared_mass, register


@register
class SquaredMass(Ranking):
    name = "sqmass"

    def order(self, batch, coverage, max_budget):
        return by_squared_mass(batch)
