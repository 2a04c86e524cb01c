"""``previous``: temporal locality, the baseline expert caching asks about.

The experts the previous verification pass loaded at the same layer come first (they would still
be in a cache), ordered by the current tree's router mass, then every other expert by router
mass. The first pass of a prompt has no previous pass and falls back to router mass.
"""

from __future__ import annotations

import torch

from moe_spec.policy.rankings.base import Ranking, by_mass, register


@register
class Previous(Ranking):
    name = "previous"

    def __init__(self):
        self.loaded: dict[int, torch.Tensor] = {}  # decoder layer -> [N] bool

    def reset(self):
        self.loaded = {}

    def observe(self, layers, loaded):
        for layer, mask in zip(layers.tolist(), loaded):
            self.loaded[layer] = mask.clone()

    def order(self, batch, coverage, max_budget):
        by_router = by_mass(batch.mass())
        cached = torch.stack([self.loaded.get(layer, torch.zeros(batch.n, dtype=torch.bool))
                              .to(batch.device) for layer in batch.layers.tolist()])
        # stable sort on "not cached" keeps router order within each group
        first = torch.argsort((~cached).gather(-1, by_router).int(), dim=-1, stable=True)
        return by_router.gather(-1, first)
