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

from typing import ClassVar

import torch

from policy.rankings.base import register
from policy.rankings.coact import Coact


@register
class CoactOnline(Coact):
    name = "coact-online"
    stateful = True
    observes_outputs = True
    prior: ClassVar[float] = 8.0  # κ: calibration pseudo-observations per pair

    def __init__(self):
        self.sums: dict[int, torch.Tensor] = {}  # decoder layer -> [N, N] Σ ⟨E_i, E_j⟩
        self.counts: dict[int, torch.Tensor] = {}  # decoder layer -> [N, N] n_ij

    def reset(self):
        self.sums, self.counts = {}, {}

    def observe_outputs(self, layers, idx, weights, outputs):
        """``idx, weights [T, M, k]`` what each token of the finished pass ran at ``layers [T]``
        (weight 0: not run, padding included) and ``outputs [T, M, k, H]`` those experts'
        outputs."""
        n = self.calibration.num_experts
        ran = (weights != 0).double()  # [T, M, k]
        out = outputs.double() * ran[..., None]
        dots = torch.einsum("tmah,tmbh->tmab", out, out)  # [T, M, k, k]
        both = ran[..., :, None] * ran[..., None, :]
        flat = (idx[..., :, None] * n + idx[..., None, :]).flatten(1)  # [T, M·k·k]
        for row, layer in enumerate(layers.tolist()):
            if layer not in self.sums:
                self.sums[layer] = torch.zeros(n * n, dtype=torch.float64, device=out.device)
                self.counts[layer] = torch.zeros(n * n, dtype=torch.float64, device=out.device)
            self.sums[layer].index_add_(0, flat[row], dots[row].flatten())
            self.counts[layer].index_add_(0, flat[row], both[row].flatten())

    def mean_gram(self, batch):
        gram = super().mean_gram(batch)  # [T, N, N] coact's calibration means
        if not self.sums:
            return gram
        pairs = self.calibration.pairs[self.calibration.rows(batch.layers)].to(batch.device)
        n = batch.n
        for i, layer in enumerate(batch.layers.tolist()):
            if layer in self.sums:
                kappa = pairs[i].clamp(max=self.prior)  # κ_ij
                seen = self.counts[layer].view(n, n)
                gram[i] = (kappa * gram[i] + self.sums[layer].view(n, n)) \
                    / (kappa + seen).clamp_min(1)
        return gram
