"""The error of a shortlist under substitution predicted at run time, and the choice among orders.

Under substitution token t runs ``P_t`` (its top-k within S) with the rule's weights ``w``, so
its error is the Gram expansion of :mod:`policy.batch`,

    ||R*_t − Σ_{i∈P_t} w_i E_i||² = ||R*_t||² − 2 Σ_{i∈P_t} w_i b_t,i + Σ_{i,j∈P_t} w_i w_j Q_t,ij

with ``Q_t = E_t E_tᵀ`` and ``b_t = E_t R*_t``. The oracle has the exact per-token terms
(:meth:`policy.batch.RoutingBatch.token_sq_errors`); a runtime ranking has only the tree's
router scores and the calibration's mean Gram ``G`` per layer, and *predicts* them
(:func:`predicted_sq_errors`):

    Q_t ≈ G,    b_t ≈ G ḡ_t,    ||R*_t||² ≈ ḡ_tᵀ G ḡ_t      (ḡ_t dense over the N experts)

Both choose among candidate shortlists per tree-layer and budget with :func:`best_shortlists`, the
oracle by the exact error, calibrated rankings by the predicted one
(:class:`policy.rankings.base.SubstitutionAware`).
"""

from __future__ import annotations

import torch

from moe_spec.policy.batch import RoutingBatch, gram_sq_errors
from moe_spec.policy.coverage import Coverage


def predicted_sq_errors(batch: RoutingBatch, gram: torch.Tensor, idx: torch.Tensor,
                        w: torch.Tensor) -> torch.Tensor:
    """Predicted ``||O*_t − Ô_t||²`` ``[T, *E, M]`` for ``idx, w [T, *E, M, k]`` from a mean Gram
    ``gram [T, N, N]`` per tree-layer: the Gram expansion (:func:`policy.batch.gram_sq_errors`)
    with ``Q_t ≈ G``, ``b_t ≈ G ḡ_t`` and ``||R*_t||² ≈ ḡ_tᵀ G ḡ_t`` (ḡ_t dense over the N
    experts). Runtime-legal: router scores and calibration statistics only."""
    return predictor(batch, gram)(idx, w)


def predictor(batch: RoutingBatch, gram: torch.Tensor):
    """``(idx, w) →`` :func:`predicted_sq_errors`, its per-token terms computed once (for
    scoring several candidate shortlists)."""
    g = gram.double()  # [T, N, N]
    dense = batch.dense_weights().double()  # ḡ: [T, M, N]
    b = dense @ g  # [T, M, N]
    shared = g[:, None].expand(-1, dense.shape[1], -1, -1)  # the same G for every token
    r_sq = (b * dense).sum(-1)
    return lambda idx, w: gram_sq_errors(r_sq, b, shared, idx, w)


def best_shortlists(batch: RoutingBatch, coverage: Coverage, candidates: list[torch.Tensor],
                    sq_errors) -> torch.Tensor:
    """Per tree-layer and budget, the candidate shortlist (each ``[T, B, N]``) with the lowest
    total error ``sq_errors(keep, idx, w) → [T, *E, M]`` under ``coverage``; ties to the first.
    A candidate equal to an earlier one as a whole (the oracle's router-mass start and router's
    shortlists, say) can only tie it, so it is not scored."""
    distinct: list[torch.Tensor] = []
    for c in candidates:
        if not any(torch.equal(c, d) for d in distinct):
            distinct.append(c)
    stacked = torch.stack(distinct)  # [C, T, B, N]
    err = torch.stack([sq_errors(c, *coverage.apply(batch, c)).sum(-1)
                       for c in distinct])  # [C, T, B]
    pick = err.argmin(0)[None, ..., None].expand(1, *stacked.shape[1:])
    return stacked.gather(0, pick)[0]
