"""``sketch-post``: sketch whose surrogate learns during the prompt from the experts its passes ran.

Off its calibration's domain sketch's linear surrogate extrapolates badly (docs/results.md,
sketch). After every verification pass the outputs ``E_i(h_t)`` of the experts it executed are
known for the tokens that ran them, so before the next pass this ranking updates each expert's
surrogate to the posterior mean that weighs the calibration fit (a prior of κ pseudo-tokens,
through the layer's input Gram) against the expert's last w executed pairs
(:class:`policy.surrogate.PosteriorSurrogate`: a w × w solve per expert, no per-expert D × D
state), and runs sketch's search on it. Runtime-legal: a pass's shortlist reads the calibration,
its own tokens' MoE inputs and the outputs that earlier passes under the same budget executed;
never the current pass's expert outputs (``tests/test_sketch.py``). One state per budget (what a
pass executes depends on it), restarted with each prompt, as coact-online's.

Cost (:func:`policy.overhead.posterior_surrogate`): the rank-(r + w) surrogate read every pass,
an updated expert's pairs read and new factors written, each layer's prior inverse read (all
float32; an upper bound that counts every expert as updated); charged to every
verification pass by the cost model like sketch's surrogate.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch

from moe_spec.policy.overhead import POSTERIOR_KAPPA, POSTERIOR_WINDOW, SKETCH_RANK
from moe_spec.policy.rankings.base import RankingError, register
from moe_spec.policy.rankings.sketch import Sketch
from moe_spec.policy.surrogate import MOMENTS, PosteriorSurrogate


@register
class SketchPosterior(Sketch):
    name = "sketch-post"  # learns from the executed outputs themselves, not only their dots
    # (its policy.index line's inputs)
    rank: ClassVar[int] = SKETCH_RANK
    window: ClassVar[int] = POSTERIOR_WINDOW  # w: executed pairs kept per expert
    kappa: ClassVar[float] = POSTERIOR_KAPPA  # κ: the calibration's weight in pseudo-tokens

    def __init__(self, rank: int | None = None):
        super().__init__(rank)
        self.moments = self.base = self.posterior = None
        self.inverses: dict = {}
        self.inputs: dict[int, torch.Tensor] = {}  # layer -> h_t [M, H] of the pass in flight

    def fit(self, calibration=None):
        super().fit(calibration)
        self.base = self.surrogate
        self.moments = calibration.fitted.get(MOMENTS)
        if self.surrogate is not None and self.moments is None:
            self.blind("its calibration carries a fitted surrogate but not the sums it was "
                       "fitted from (policy.rankings.sketch.attach_moments), so it cannot learn")
            self.surrogate = self.base = None  # coact-prior's shortlists, as the warning says
        # each layer's prior inverse, shared by every budget's and prompt's state
        self.inverses = calibration.fitted.setdefault(("sketch-post", self.rank, self.kappa), {})
        return self

    def reset(self):
        self.posterior, self.inputs = None, {}
        self.surrogate = self.base

    def clone(self):
        """A fresh per-budget state sharing the (read-only) calibration, base fit, sums and
        prior inverses."""
        shared = (self.calibration, self.base, self.moments, self.inverses)
        return copy.deepcopy(self, {id(x): x for x in shared if x is not None})

    def save(self, path) -> None:
        """The calibration surrogate (what every prompt starts from)."""
        current, self.surrogate = self.surrogate, self.base
        try:
            super().save(path)
        finally:
            self.surrogate = current

    def shortlists(self, batch, coverage, budgets):
        if self.base is None or self.moments is None or getattr(batch, "hidden", None) is None:
            return super().shortlists(batch, coverage, budgets)  # sketch's fallback, warned
        if self.posterior is None:
            self.posterior = PosteriorSurrogate(self.moments, self.rank, self.kappa, self.window,
                                                base=self.base, inverses=self.inverses)
        for row, layer in enumerate(batch.layers.tolist()):
            self.inputs[layer] = batch.hidden[row]
        self.surrogate = self.posterior.refresh()
        return super().shortlists(batch, coverage, budgets)

    def observe_outputs(self, layers, idx, weights, outputs, dots=None):
        """After a pass: what it executed (``idx, weights [T, M, k]``, weight 0 not run) and
        those experts' outputs ``outputs [T, M, k, H]`` at ``layers [T]``; the MoE inputs are
        the ones this pass's :meth:`shortlists` saw."""
        if self.posterior is None:
            return  # blind (coact-prior's shortlists): nothing to learn into
        if outputs is None:
            raise RankingError("ranking sketch-post learns from the executed experts' outputs; "
                               "the caller passed only their inner products")
        try:
            hidden = torch.stack([self.inputs.pop(int(layer)) for layer in layers.tolist()])
        except KeyError as exc:
            raise RankingError(f"ranking sketch-post observed layer {exc.args[0]} without "
                               "having shortlisted it in this pass") from None
        self.posterior.observe(layers.cpu(), hidden.cpu(), idx.cpu(), weights.cpu(),
                               outputs.cpu())
