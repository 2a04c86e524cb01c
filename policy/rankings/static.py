"""``static``: an input-independent ranking by calibration selection counts ``c_i`` per layer."""

from __future__ import annotations

from moe_spec.policy.rankings.base import Ranking, by_mass, register


@register
class Static(Ranking):
    name = "static"
    selected_first = False  # the paper's definition: calibration selection counts

    def order(self, batch, coverage, max_budget):
        return by_mass(self.calibration.selection_counts(batch.layers).to(batch.device))
