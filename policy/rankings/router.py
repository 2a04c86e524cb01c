"""``router``: MoE-Spec's ranking, by router mass ``s_i = Σ_t g_i(t)`` over the tree's tokens."""

from __future__ import annotations

from moe_spec.policy.rankings.base import Ranking, by_mass, register


@register
class Router(Ranking):
    name = "router"
    selected_first = False  # the paper's definition: summed router probabilities

    def order(self, batch, coverage, max_budget):
        return by_mass(batch.mass())
