"""``coact-online``: coact whose expert-output Gram is refined from the run's own earlier passes.

After a verification pass the outputs of the experts it *executed* are known (they were just
computed), so the inner products ``⟨E_i(h_t), E_j(h_t)⟩`` of every executed pair (i, j) of every
tree token t are free. coact-online keeps their sums per layer for the current prompt and blends
them with the calibration mean, each pair's calibration mean counting as ``κ_ij = min(κ, c_ij)``
pseudo-observations (``c_ij``: calibration tokens that fired the pair, κ = :attr:`prior`):

    G_ij = (κ_ij · G^cal_ij + Σ_{earlier passes, t} ⟨E_i(h_t), E_j(h_t)⟩) / (κ_ij + n_ij)

with ``n_ij`` the pair's executions so far in this prompt. A pair calibration never saw is
learned from the run alone; one the run has executed often follows the run. Runtime-legal: a
pass's order uses only passes that finished before it, and under a budget only the experts that
budget let run (never the current tree's unexecuted experts). The state restarts with each prompt
(replay treats prompts independently), so the numbers are a lower bound on what a server that
keeps refining across requests would see.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import ClassVar

import torch

from moe_spec.policy.batch import pair_index
from moe_spec.policy.rankings.base import register
from moe_spec.policy.rankings.coact import Coact


@register
class CoactOnline(Coact):
    name = "coact-online"  # (reads executed outputs: its policy.index line's inputs)
    prior: ClassVar[float] = 8.0  # κ: calibration pseudo-observations per pair

    def __init__(self):
        self.sums: torch.Tensor | None = None  # [L, N·N] Σ ⟨E_i, E_j⟩ per calibration layer row
        self.counts: torch.Tensor | None = None  # [L, N·N] n_ij
        self.seen: torch.Tensor | None = None  # [L] bool: the layer ran a pass in this prompt
        self.stacked_gram: torch.Tensor | None = None  # set only by shortlists_each's stand-in

    def reset(self):
        self.sums = self.counts = self.seen = None

    @classmethod
    def shortlists_each(cls, instances, batch, coverage, budgets):
        """Every budget's instance in one call: the batch repeated once per budget, each copy
        with its instance's blended Gram, and copy j's shortlist at budget j kept (coact's
        greedy is incremental and substitution's choice is per budget, so this is exactly the
        one-instance-per-call answer; each copy is scored at its own budget only)."""
        t, count = batch.size, len(budgets)
        stand_in = copy.copy(instances[0])
        stand_in.stacked_gram = torch.cat([ranking.mean_gram(batch) for ranking in instances])
        routing = dataclasses.replace(batch, terms=None)  # rankings never see expert outputs
        repeated = routing.take(torch.arange(t, device=batch.device).repeat(count))
        own = torch.as_tensor(budgets, device=batch.device).repeat_interleave(t)[:, None]
        keep = stand_in.prefixes(repeated, coverage, own)  # [count·T, 1, N]
        return keep[:, 0].view(count, t, batch.n).transpose(0, 1)

    def observe_outputs(self, layers, idx, weights, outputs, dots=None):
        """``idx, weights [T, M, k]`` what each token of the finished pass ran at ``layers [T]``
        (weight 0: not run, padding included) and ``outputs [T, M, k, H]`` those experts'
        outputs, or their inner products ``dots [T, M, k, k]`` alone (the sums need no more)."""
        n = self.calibration.num_experts
        device = idx.device
        if self.sums is None:
            size = (len(self.calibration.layers), n * n)
            self.sums = torch.zeros(size, dtype=torch.float64, device=device)
            self.counts = torch.zeros(size, dtype=torch.float64, device=device)
            self.seen = torch.zeros(size[0], dtype=torch.bool, device=device)
        ran = (weights != 0).double()  # [T, M, k]
        both = ran[..., :, None] * ran[..., None, :]
        if dots is None:
            out = outputs.double()
            dots = torch.einsum("tmah,tmbh->tmab", out, out)  # [T, M, k, k]
        dots = dots * both  # a pair counts only where both ran
        rows = self.calibration.rows(layers).to(device)  # [T]
        flat = (rows[:, None] * (n * n)
                + pair_index(idx, n).flatten(1)).flatten()
        self.sums.view(-1).index_add_(0, flat, dots.flatten())
        self.counts.view(-1).index_add_(0, flat, both.flatten())
        self.seen[rows] = True

    def mean_gram(self, batch):
        if self.stacked_gram is not None:
            return self.stacked_gram
        gram = super().mean_gram(batch)  # [T, N, N] coact's calibration means
        if self.sums is None:
            return gram
        rows = self.calibration.rows(batch.layers).to(batch.device)
        kappa = self.calibration.pairs[rows.cpu()].to(batch.device).clamp(max=self.prior)  # κ_ij
        n = batch.n
        blended = (kappa * gram + self.sums[rows].view(-1, n, n)) \
            / (kappa + self.counts[rows].view(-1, n, n)).clamp_min(1)
        return torch.where(self.seen[rows][:, None, None], blended, gram)
