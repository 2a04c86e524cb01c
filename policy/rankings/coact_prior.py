"""``coact-prior``: coact-online whose calibration output energies are shrunk toward their layer's
mean by an empirical-Bayes prior, its strength chosen from the calibration data alone.

Across domains coact trusts each expert's calibration energy ``G_ii`` too much: part of an
expert's deviation from its layer's typical energy belongs to the calibration domain and does not
carry over. Shrinking each energy toward the layer mean ``Ḡ = mean_{j: c_j > 0} G_jj``,

    G'_ii = (c_i G_ii + κ Ḡ) / (c_i + κ)      (c_i: calibration tokens routed to i),

with a hand-picked κ = 256 lifted tiny-olmoe's worst cross-domain cell from −38% to 39% of the
router→oracle gap (``bench/energy_prior.py``). Here κ is chosen per layer from the calibration
alone, by the method of moments in a normal model whose posterior mean is exactly the shrinkage
above. The energy the ranking needs is the expert's mean energy ``μ'_i`` on the *served* domain;
calibration measured ``x_i = G_ii`` on its own. Assume a domain moves an expert's mean energy
about as much as one prompt does (the only context shift a single-domain calibration can see):

    x_i = μ_i + δ_i + ε_i,   μ'_i = μ_i + δ'_i,   μ_i ~ (Ḡ, τ²),   δ_i, δ'_i ~ (0, u_i),   ε_i ~ (0, v_i)

    v_i = the prompt-clustered sampling variance of x_i over its P_i prompts
          (:meth:`policy.calibration.CalibrationStats.energy_variance`)
    u_i = P_i v_i                       the variance of one prompt's mean energy
    τ²  = max(0, var_i(x_i) − mean_i (u_i + v_i))      between-expert variance of the μ_i
    E[μ'_i | x] = Ḡ + τ²/(τ² + u_i + v_i) · (x_i − Ḡ)  ⇔  κ_i = c_i (u_i + v_i) / τ²
    κ   = mean_i c_i (u_i + v_i) / τ²   (∞ where τ² = 0: every expert gets Ḡ)

over the layer's experts seen in ≥ 2 calibration prompts (``var`` with n − 1). Prompts, not
tokens, are the draws: tokens of one prompt share their context. Measured on tiny-olmoe (8 eval,
24 mbpp calibration prompts, 32 new tokens; off-diagonal cells ← mbpp, B = 8..32, both policies)
this chose κ = 26..286 per layer and its worst cell closed 58% of the gap (coact-online: 39%);
the plain empirical-Bayes κ of the sampling noise alone (u_i = 0, the in-domain optimum) chose
κ = 1..8, barely shrinking, worst cell 44%. Only the diagonal is shrunk; the
co-activation terms G_ij (i ≠ j) are coact's. On top of the shrunk means coact-online refines G
from the outputs the prompt's earlier passes executed (:mod:`policy.rankings.coact_online`), and
under substitution the prediction uses the same means (:class:`~policy.rankings.base.
SubstitutionAware`). κ = 0 (:attr:`CoactPrior.kappa`) is coact-online, and before any pass coact.
Runtime-legal: calibration statistics and router scores only.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from moe_spec.policy.calibration import CalibrationStats
from moe_spec.policy.rankings.base import register
from moe_spec.policy.rankings.coact import Coact
from moe_spec.policy.rankings.coact_online import CoactOnline


def prior_strength(stats: CalibrationStats) -> torch.Tensor:
    """``κ [L]`` float64 per layer (module docstring): ``mean_i c_i (u_i + v_i) / τ²`` with
    ``u_i = P_i v_i``; ∞ where the energies' spread is all prompt-to-prompt variation, NaN where
    fewer than two experts were seen in two prompts (nothing to estimate from: no shrinkage)."""
    v, prompts = stats.energy_variance()  # [L, N], NaN where P_i < 2
    counts = stats.pairs.diagonal(dim1=-2, dim2=-1)
    x = stats.gram.diagonal(dim1=-2, dim2=-1) / counts.clamp_min(1)
    kappa = torch.full((len(stats.layers),), float("nan"), dtype=torch.float64)
    for row in range(len(stats.layers)):
        ok = ~torch.isnan(v[row])
        if int(ok.sum()) < 2:
            continue
        shift = (prompts[row][ok] + 1) * v[row][ok]  # u_i + v_i
        tau2 = (x[row][ok].var(correction=1) - shift.mean()).clamp_min(0)
        kappa[row] = (counts[row][ok] * shift).mean() / tau2 if tau2 > 0 else float("inf")
    return kappa


def shrunk_means(stats: CalibrationStats, kappa: torch.Tensor) -> torch.Tensor:
    """``G' [L, N, N]`` float32: the calibration means (:meth:`CalibrationStats.layer_means`)
    with each seen expert's energy moved toward its layer's mean energy,
    ``G'_ii = G_ii + κ/(c_i + κ) · (Ḡ − G_ii)`` (= (c_i G_ii + κ Ḡ)/(c_i + κ)); ``kappa [L]``,
    NaN read as 0, ∞ as all the way. κ = 0 returns the means bit for bit."""
    means = stats.layer_means().double().clone()
    counts = stats.pairs.diagonal(dim1=-2, dim2=-1)
    k = torch.nan_to_num(kappa.double(), nan=0.0)[:, None].expand_as(counts)
    pull = torch.where(torch.isinf(k), torch.ones_like(k), k / (counts + k).clamp_min(1e-300))
    pull = torch.where(counts > 0, pull, torch.zeros_like(pull))  # unseen already hold Ḡ
    diag = means.diagonal(dim1=-2, dim2=-1)
    diag.add_(pull * (stats.mean_energy()[:, None] - diag))  # adds exactly 0 where pull = 0
    return means.float()


class EnergyPriorMeans:
    """Calibration means with the energy prior, for the coact family's ``mean_gram``: placed
    between :class:`CoactOnline` and :class:`Coact` in the MRO, so coact-online's refinement
    starts from the shrunk means."""

    def mean_gram(self, batch):
        stats = self.calibration
        key = self.name if self.kappa is None else (self.name, float(self.kappa))
        if key not in stats.fitted:  # shrunk once per calibration (and fixed κ)
            kappa = prior_strength(stats) if self.kappa is None else torch.full(
                (len(stats.layers),), float(self.kappa), dtype=torch.float64)
            stats.fitted[key] = shrunk_means(stats, kappa)
        means = stats.fitted[key]
        rows = stats.rows(batch.layers)
        return means[rows].to(batch.device).double()


@register
class CoactPrior(CoactOnline, EnergyPriorMeans, Coact):
    name = "coact-prior"
    kappa: ClassVar[float | None] = None  # None: per layer, prior_strength(); a number: fixed
