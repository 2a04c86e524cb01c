"""``sketch-gated``: sketch where the tree's MoE inputs resemble its calibration's, coact-prior
elsewhere.

sketch's linear surrogate predicts well on inputs like its calibration's and badly far from them:
calibrated on one benchmark and evaluated on a distant one (code ↔ math or news) it closed as
little as 9–13% of the router→oracle gap at B = k, below coact-prior (docs/results.md, "sketch
across domains"). How far a tree-layer's inputs lie is known before any expert is loaded:
:class:`policy.surrogate.InputGate` measures their novelty, a Mahalanobis distance per dimension
under the calibration's inputs (mean exactly 1 on the calibration itself). A tree-layer whose
novelty is at most :data:`policy.overhead.GATE_NOVELTY` gets sketch's shortlist
(:class:`policy.rankings.sketch.Sketch`, the same surrogate rank); any other gets coact-prior's,
whose state (refined from what the prompt's earlier passes executed) this ranking carries and
feeds as coact-prior does, pass by pass, one instance per budget.

Runtime-legal: sketch's and coact-prior's inputs (``h_t``, routing, calibration) and the
outputs earlier passes executed; never the current pass's expert outputs
(``tests/test_sketch.py``). Cost (:func:`policy.overhead.gated_surrogate`): the surrogate and
the gate's p directions read every pass.
"""

from __future__ import annotations

import copy
import warnings
from typing import ClassVar

import torch

from moe_spec.policy.overhead import GATE_COMPONENTS, GATE_NOVELTY, SKETCH_RANK
from moe_spec.policy.rankings.base import register
from moe_spec.policy.rankings.coact_prior import CoactPrior
from moe_spec.policy.rankings.sketch import Sketch, routing_only
from moe_spec.policy.surrogate import MOMENTS, InputGate


@register
class SketchGated(CoactPrior):
    name = "sketch-gated"
    rank: ClassVar[int] = SKETCH_RANK
    components: ClassVar[int] = GATE_COMPONENTS
    threshold: ClassVar[float] = GATE_NOVELTY

    def __init__(self, rank: int | None = None):
        super().__init__()
        if rank is not None:
            self.rank = int(rank)
        self.sketch: Sketch | None = None
        self.gate: InputGate | None = None

    def fit(self, calibration=None):
        super().fit(calibration)
        self.sketch = Sketch(rank=self.rank).fit(calibration)  # warns without its surrogate
        moments = calibration.fitted.get(MOMENTS)
        key = ("sketch-gate", self.components)
        if moments is not None and key not in calibration.fitted:
            calibration.fitted[key] = InputGate.fit(moments, self.components)
        self.gate = calibration.fitted.get(key)
        return self

    @property
    def token_aware(self) -> bool:
        return self.gate is not None and self.sketch.token_aware

    def clone(self):
        """A fresh per-budget coact-prior state sharing the calibration, sketch and gate."""
        shared = (self.calibration, self.sketch, self.gate)
        return copy.deepcopy(self, {id(x): x for x in shared if x is not None})

    def near(self, batch) -> torch.Tensor:
        """``[T]`` bool: the tree-layers whose inputs the gate lets sketch rank."""
        if self.gate is None or getattr(batch, "hidden", None) is None:
            if self.sketch.surrogate is not None and not getattr(self, "warned", False):
                self.warned = True  # (without a surrogate, fit() has said so)
                why = ("its calibration carries no input sums to gate by (policy.rankings."
                       "sketch.attach_moments)" if self.gate is None else
                       "the batch carries no MoE inputs h_t (policy.rankings.sketch.with_inputs)")
                warnings.warn(f"ranking {self.name}: {why}; using coact-prior's shortlists",
                              stacklevel=3)
            return torch.zeros(batch.size, dtype=torch.bool, device=batch.device)
        novelty = self.gate.novelty(batch.layers, batch.hidden, batch.mask)
        return (novelty <= self.threshold).to(batch.device)

    def surrogate_ranked(self, batch):
        """The gated-in tree-layers (:meth:`near`) where sketch holds a surrogate."""
        return self.near(batch) & self.sketch.surrogate_ranked(batch)

    def predicted(self, batch, rows):
        """Sketch's predicted terms of the gated-in rows (:meth:`Sketch.predicted`)."""
        return self.sketch.predicted(batch, rows)

    def overlay(self, batch, coverage, budgets, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` (coact-prior's shortlists) with the rows of the tree-layers sketch ranks
        (:meth:`surrogate_ranked`) replaced by sketch's."""
        rows = self.surrogate_ranked(batch).nonzero().flatten()
        if len(rows):
            keep = keep.clone()
            keep[rows] = self.sketch.shortlists(routing_only(batch, rows), coverage,
                                                list(budgets))[0].to(keep.device)
        return keep

    def shortlists(self, batch, coverage, budgets):
        keep, budgets = super().shortlists(batch, coverage, budgets)
        return self.overlay(batch, coverage, budgets, keep), budgets

    @classmethod
    def shortlists_each(cls, instances, batch, coverage, budgets):
        keep = super().shortlists_each(instances, batch, coverage, budgets)  # [T, B, N]
        return instances[0].overlay(batch, coverage, budgets, keep)
