"""The error of a shortlist under substitution, from a Gram of expert outputs, and its greedy.

Under substitution token t runs ``P_t`` (its top-k within S) with the rule's weights ``w``, so
its error is the Gram expansion of :mod:`policy.batch`,

    ||R*_t − Σ_{i∈P_t} w_i E_i||² = ||R*_t||² − 2 Σ_{i∈P_t} w_i b_t,i + Σ_{i,j∈P_t} w_i w_j Q_t,ij

with ``Q_t = E_t E_tᵀ`` and ``b_t = E_t R*_t``. The oracle has the exact per-token terms
(:class:`ExactGram`, used by its incremental greedy :func:`greedy_order`); a runtime ranking has
only the tree's router scores and the calibration's mean Gram ``G`` per layer, and *predicts*
them (:func:`predicted_sq_errors`):

    Q_t ≈ G,    b_t ≈ G ḡ_t,    ||R*_t||² ≈ ḡ_tᵀ G ḡ_t      (ḡ_t dense over the N experts)

Both choose among candidate orders per tree-layer and budget with :func:`best_prefixes`, the
oracle by the exact error, calibrated rankings by the predicted one
(:class:`policy.rankings.base.SubstitutionAware`).
"""

from __future__ import annotations

import torch

from policy.batch import RoutingBatch, grow
from policy.coverage import Coverage, prefix_masks


class ExactGram:
    """Per-token terms from every expert's output (offline: the oracle)."""

    def __init__(self, batch: RoutingBatch):
        self.q, self.b = batch.terms.gram()  # [T, M, N, N], [T, M, N]
        self.r_sq = batch.terms.routed_sq  # [T, M]
        self.diag = self.q.diagonal(dim1=-2, dim2=-1)  # [T, M, N]

    def column(self, index: torch.Tensor) -> torch.Tensor:
        """``Q_t[:, index_t]`` for ``index [T, M]`` → ``[T, M, N]`` (Q symmetric: a row)."""
        t, m, n, _ = self.q.shape
        rows = torch.arange(t * m, device=self.q.device) * n + index.reshape(-1)
        return self.q.reshape(-1, n).index_select(0, rows).view(t, m, n)


def predicted_sq_errors(batch: RoutingBatch, gram: torch.Tensor, idx: torch.Tensor,
                       w: torch.Tensor) -> torch.Tensor:
    """Predicted ``||O*_t − Ô_t||²`` ``[T, *E, M]`` for ``idx, w [T, *E, M, k]`` from a mean Gram
    ``gram [T, N, N]`` per tree-layer: the Gram expansion with ``Q_t ≈ G``, ``b_t ≈ G ḡ_t`` and
    ``||R*_t||² ≈ ḡ_tᵀ G ḡ_t`` (ḡ_t dense over the N experts). Runtime-legal: router scores and
    calibration statistics only."""
    lead, m, k = idx.shape[:-2], idx.shape[-2], idx.shape[-1]
    g = gram.double()  # [T, N, N]
    n = g.shape[-1]
    dense = batch.dense_weights().double()  # ḡ: [T, M, N]
    b_all = dense @ g  # [T, M, N]
    r_sq = (b_all * dense).sum(-1)  # [T, M]
    b = grow(b_all, lead).gather(-1, idx)  # [T, *E, M, k]
    pairs = (idx[..., :, None] * n + idx[..., None, :]).flatten(-2)  # [T, *E, M, k·k]
    flat = g.flatten(-2)  # [T, N·N]
    flat = flat.view(flat.shape[0], *([1] * len(lead)), -1).expand(*lead, m, n * n)
    qq = flat.gather(-1, pairs).unflatten(-1, (k, k))
    w = w.double()
    return grow(r_sq, lead) - 2 * (w * b).sum(-1) + torch.einsum("...j,...jl,...l->...", w, qq, w)


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[t, m, index[t, m]]`` for ``x [T, M, N]``, ``index [T, M]`` → ``[T, M]``."""
    return x.gather(-1, index[..., None])[..., 0]


def greedy_order(batch: RoutingBatch, gram, max_budget: int) -> torch.Tensor:
    """Grow S from ∅, each step adding the expert whose addition gives the lowest error under
    substitution (plain top-k rules), for every tree-layer at once: ``[T, min(B, N)]``.

    Adding candidate c changes token t's selection P_t only if P_t has room or c beats P_t's
    weakest member m, which c then replaces. With per-token sums over P_t

        L = Σ_{i∈P} g_i b_i,   Q = Σ_{i,j∈P} g_i g_j Q_ij,   Z = Σ_{i∈P} g_i,   C_x = Σ_{j∈P} g_j Q_xj

    every candidate's new error follows in O(1) per token (m's terms out, c's in):

        L' = L − g_m b_m + g_c b_c
        Q' = Q − 2 g_m C_m + g_m² Q_mm + 2 g_c (C_c − g_m Q_cm) + g_c² Q_cc
        err = ||R*||² − 2 s L' / Z' + s² Q' / Z'²    (s = scale; Z' → 1 without renormalisation)

    so each step scores all N candidates of all T tree-layers in O(T·M·N). Once no candidate
    changes any token (S covers every token's top-k), the rest is filled by expert id, as exact
    ties resolve. ``gram``: :class:`ExactGram` (the oracle's exact per-token terms).

    Greedy from ∅ fits early picks to a tiny S; on a *predicted* objective it also overfits the
    prediction (on tiny-qwen3-moe, as a candidate for coact it closed 67% of the gap at B = 8
    where coact without it closed 90%), so runtime rankings do not use it."""
    rule = batch.rule
    b, diag, r_sq = gram.b, gram.diag, gram.r_sq
    t, m, n, k = batch.size, batch.probs.shape[1], batch.n, batch.k
    dev = batch.device
    choice = rule._choice(batch.probs, None)  # selection scores (float32, biased if any)
    g = batch.probs.double()
    real = batch.mask

    def error(r, L, Q, Z):
        """``||R*||² − 2 a L + a² Q`` with a the weight scale of the selection."""
        a = torch.where(Z > 0, rule.scale / (Z + rule.renormalize_eps), torch.zeros_like(Z)) \
            if rule.renormalize else rule.scale
        return r - 2 * a * L + a * a * Q

    count = torch.zeros(t, m, dtype=torch.long, device=dev)
    sel = torch.zeros(t, m, k, dtype=torch.long, device=dev)  # slots; valid below count
    L = torch.zeros(t, m, dtype=torch.float64, device=dev)
    Q = torch.zeros_like(L)
    Z = torch.zeros_like(L)
    C = torch.zeros(t, m, n, dtype=torch.float64, device=dev)
    keep = torch.zeros(t, n, dtype=torch.bool, device=dev)
    rows = torch.arange(t, device=dev)
    slots = torch.arange(k, device=dev)
    steps = min(max_budget, n)
    order = torch.empty(t, steps, dtype=torch.long, device=dev)
    for s in range(steps):
        full = count >= k
        sel_choice = choice.gather(-1, sel).masked_fill(slots >= count[..., None], float("inf"))
        weakest = sel_choice.argmin(-1)  # slot of the weakest selected expert
        mi = sel.gather(-1, weakest[..., None])[..., 0]  # its expert id (meaningful when full)
        changes = (~full[..., None] | (choice > _at(choice, mi)[..., None])) \
            & ~keep[:, None, :] & real[..., None]  # [T, M, N]
        if not bool(changes.any()):  # every candidate ties: the rest by expert id
            rest = torch.argsort(keep.long() * n + torch.arange(n, device=dev), -1)
            order[:, s:] = rest[:, : steps - s]
            break
        gm = (_at(g, mi) * full)[..., None]  # 0 where c joins instead of replacing
        q_cm = gram.column(mi)  # Q_t[c, m] for every candidate c
        L2 = L[..., None] - gm * _at(b, mi)[..., None] + g * b
        Q2 = (Q[..., None] - 2 * gm * _at(C, mi)[..., None] + gm * gm * _at(diag, mi)[..., None]
              + 2 * g * (C - gm * q_cm) + g * g * diag)
        Z2 = Z[..., None] - gm + g
        err = torch.where(changes, error(r_sq[..., None], L2, Q2, Z2),
                          error(r_sq, L, Q, Z)[..., None])
        total = err.sum(1).masked_fill(keep, float("inf"))  # [T, N]
        c = total.argmin(-1)
        order[:, s] = c
        cc = c[:, None].expand(t, m)
        changed = _at(changes, cc)  # [T, M]
        L = torch.where(changed, _at(L2, cc), L)
        Q = torch.where(changed, _at(Q2, cc), Q)
        Z = torch.where(changed, _at(Z2, cc), Z)
        delta = _at(g, cc)[..., None] * gram.column(cc) - gm * q_cm
        C = C + changed[..., None] * delta
        slot = torch.where(full, weakest, count.clamp_max(k - 1))
        sel = torch.where(changed[..., None] & (slots == slot[..., None]), cc[..., None], sel)
        count = count + (changed & ~full)
        keep[rows, c] = True
    return order


def best_prefixes(batch: RoutingBatch, coverage: Coverage, orders: list[torch.Tensor],
                  budgets: list[int], sq_errors) -> torch.Tensor:
    """Per tree-layer and budget, the prefix of ``orders`` (each ``[T, L]``) with the lowest total
    error ``sq_errors(keep, idx, w) → [T, *E, M]`` under ``coverage``; ties to the first order.
    Returns shortlists ``[T, len(budgets), N]`` (not nested across budgets in general)."""
    candidates = torch.stack([prefix_masks(o, budgets, batch.n) for o in orders])  # [C, T, B, N]
    err = torch.stack([sq_errors(c, *coverage.apply(batch, c)).sum(-1)
                       for c in candidates])  # [C, T, B]
    best = err.argmin(0)  # the first of equals
    pick = best[None, ..., None].expand(1, *candidates.shape[1:])
    return candidates.gather(0, pick)[0]
