"""``coact-diag``: the second step of coact's ablation — squared mixing mass times each expert's
calibration output energy, ``A_ii · G_ii``, the diagonal of coact's quadratic form.

With ``G_ii = mean ⟨E_i, E_i⟩`` over calibration tokens routed to i, this is coact with every
off-diagonal term (co-activation) removed: what expert output *norms* explain of the oracle's
advantage. ``coact`` adds the off-diagonal ``A_ij G_ij``; ``sqmass`` drops G altogether.
"""

from __future__ import annotations

from moe_spec.policy.rankings.base import Ranking, by_mass, mass_tiebreak, register


@register
class CoactDiagonal(Ranking):
    name = "coact-diag"
    order_reads_coverage = False  # cached for both policies (Ranking.batch_order)

    def order(self, batch, coverage, max_budget):
        w = batch.dense_weights().double()  # [T, M, N]
        energy = self.calibration.mean_gram(batch.layers).to(batch.device).double() \
            .diagonal(dim1=-2, dim2=-1)  # [T, N]
        return by_mass((w * w).sum(1) * energy + mass_tiebreak(batch))
