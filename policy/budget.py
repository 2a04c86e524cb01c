"""An expert budget inside verification passes: rank, keep B, cover — for one layer at a time.

This is what MoE-Spec does at run time, and what capture's online mode and closed-loop replay
both apply in every MoE layer's router:

    routed = budget.route(layer, g, idx, ḡ, rule)     # shortlist + the indices/weights to run
    ...                                               # the experts module runs routed.idx/weights
    budget.observe(loaded, executed)                  # after the pass (stateful rankings)
    budget.reset()                                    # before the next prompt

An adaptive budget (:class:`AdaptiveBudget`, issue 63) is the same path: its ``route`` ranks the
layer's shortlists at every B of ``B_min .. B_max``, predicts from the mass each excludes the
gain of the next expert, and keeps loading while it exceeds the price λ calibrated for the mean
budget B̄ (:class:`Prices`, :mod:`policy.adaptive`'s price rule), layers in pass order, under
an optional cap on a pass's total. Open-loop replay applies the same :meth:`Prices.choose` to a
batch of tree-layers at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_spec.policy.batch import RoutingBatch
from moe_spec.policy.coverage import Coverage, experts_used
from moe_spec.policy.prices import Prices
from moe_spec.policy.rankings.base import Ranking, RankingError
from moe_spec.policy.routing import RoutingRule


@dataclass
class Routed:
    idx: torch.Tensor  # [M, k] experts each token uses
    weights: torch.Tensor  # [M, k] their weights (0: dropped slot)
    keep: torch.Tensor  # [N] the shortlist, or [M, N] each token's (budget groups)

    def anchor(self) -> torch.Tensor:
        """A shortlisted expert (the lowest id) per token, ``[M, 1]`` (or one for all): what a
        dropped slot may point at."""
        first = self.keep.int().argmax(-1)
        return first[:, None] if first.dim() else first

    def loaded(self) -> torch.Tensor:
        """``[N]`` bool: experts with non-zero weight for some token (what is loaded)."""
        return experts_used(self.idx, self.weights, self.keep.shape[-1])


@dataclass
class Budget:
    size: int  # B
    ranking: Ranking  # fitted, runtime
    coverage: Coverage

    def __post_init__(self):
        if not self.ranking.runtime:
            raise RankingError(f"{self.ranking.name} is not a runtime ranking; it needs expert "
                               "outputs a verification pass does not have")

    def route(self, layer: int, probs: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
              rule: RoutingRule, hidden: torch.Tensor | None = None) -> Routed:
        """The shortlist and what each token runs, from the layer's router scores (and its MoE
        inputs ``hidden [M, H]``, for token-aware rankings)."""
        batch = RoutingBatch.single(probs, idx, weights.float(), layer, rule,
                                    None if hidden is None else hidden.float())
        keep = self.ranking.shortlists(batch, self.coverage, [self.size])[0][:, 0]  # [1, N]
        new_idx, new_w = self.coverage.apply(batch, keep)
        return Routed(new_idx[0], new_w[0], keep[0])

    def observe(self, loaded: dict[int, torch.Tensor],
                executed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
                ) -> None:
        """After a pass: ``loaded[layer] [N]`` the experts it ran and, for rankings that learn
        from them, ``executed[layer] = (idx, weights [M, k], outputs [M, k, H])``."""
        if loaded:
            layers = list(loaded)
            self.ranking.observe(torch.tensor(layers), torch.stack([loaded[i] for i in layers]))
        if executed and self.ranking.observes_outputs:
            layers = list(executed)
            idx, w, out = (torch.stack([executed[i][j] for i in layers]) for j in range(3))
            self.ranking.observe_outputs(torch.tensor(layers, device=idx.device), idx, w, out)

    def reset(self) -> None:
        self.ranking.reset()

    @property
    def observes_outputs(self) -> bool:
        return self.ranking.observes_outputs

    def parts(self, rows: int) -> list[tuple[Budget, int, int]]:
        """Which budget routed which of a forward's ``rows`` tokens: all of them, this one."""
        return [(self, 0, rows)]


@dataclass
class AdaptiveBudget(Budget):
    """A mean budget B̄ (``size``) spent by the price rule (:class:`Prices`) layer by layer in
    each pass: every layer's shortlists at ``B_min .. B_max`` ranked, the mass each excludes
    predicting the next expert's gain, the layer keeping its next expert while that gain exceeds
    λ; a pass cap is tracked across the pass's layers (a layer at or before the last one routed
    starts a new pass), and a paced rule's deficit across the passes until :meth:`reset` (the
    next prompt, or batch; paced over the run, across those too). ``chosen`` holds the pass's
    B per layer so far."""

    prices: Prices | None = None
    chosen: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if self.prices is None or self.size not in self.prices.prices:
            raise ValueError(f"no calibrated price for a mean budget of {self.size}")
        self._used: dict = {}
        self._deficit: dict = {}  # paced: the stream's running deficit (a prompt's, or the run's)
        self._last = None

    def route(self, layer, probs, idx, weights, rule, hidden=None):
        if self._last is not None and layer <= self._last:  # a new pass
            self._used, self.chosen = {}, {}
        self._last = layer
        batch = RoutingBatch.single(probs, idx, weights.float(), layer, rule,
                                    None if hidden is None else hidden.float())
        keep = self.ranking.shortlists(batch, self.coverage, self.prices.budgets)[0]  # [1, S+1, N]
        chosen = self.prices.choose(self.prices.curves(batch, keep, self.coverage, self.ranking),
                                    batch.layers, [self.size],
                                    torch.zeros(1, dtype=torch.long), self._used,
                                    deficit=self._deficit)
        self.chosen[layer] = int(chosen[0, 0])
        keep = self.prices.pick(keep, chosen)[:, 0]  # [1, N]
        new_idx, new_w = self.coverage.apply(batch, keep)
        return Routed(new_idx[0], new_w[0], keep[0])

    def reset(self) -> None:
        super().reset()
        self._used, self.chosen, self._last = {}, {}, None
        if self.prices.pace_over == "prompt":  # paced over the run, the deficit goes on
            self._deficit = {}


@dataclass
class BudgetGroups:
    """Several budgets verified in ONE forward: the batch holds the same trees once per budget,
    and in every MoE call the g-th equal block of tokens is budget g's (its own shortlist, from
    its own block's router scores, as if it were the only pass). Closed-loop replay uses it to
    re-verify a pass under every budget at once; each budget keeps its own state."""

    budgets: list[Budget]

    def route(self, layer: int, probs: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
              rule: RoutingRule, hidden: torch.Tensor | None = None) -> Routed:
        count = len(self.budgets)
        if probs.shape[0] % count:
            raise ValueError(f"{probs.shape[0]} tokens do not split into {count} budget groups")
        blocks = [None] * count if hidden is None else hidden.chunk(count)
        parts = [b.route(layer, p, i, w, rule, x) for b, p, i, w, x in zip(
            self.budgets, probs.chunk(count), idx.chunk(count), weights.chunk(count), blocks)]
        per = probs.shape[0] // count
        return Routed(torch.cat([r.idx for r in parts]), torch.cat([r.weights for r in parts]),
                      torch.stack([r.keep for r in parts]).repeat_interleave(per, 0))

    @property
    def observes_outputs(self) -> bool:
        return any(b.observes_outputs for b in self.budgets)

    def parts(self, rows: int) -> list[tuple[Budget, int, int]]:
        per = rows // len(self.budgets)
        return [(b, g * per, (g + 1) * per) for g, b in enumerate(self.budgets)]

    def reset(self) -> None:
        for b in self.budgets:
            b.reset()
