"""Open-loop replay of one (tree, MoE layer): what a budget costs in reconstruction error.

For one captured tree and layer (M tokens, N experts): router softmax ``g [M, N]``, natural
top-k ``idx [M, k]`` with mixing weights ``ḡ``, and every expert's output ``E [M, N, H]``
(computed once from the captured MoE inputs and shared by every ranking, budget and policy).
The gold output is ``O*_t = Σ_{i∈T_k(t)} ḡ_i(t) E_i(h_t)``. Errors (DESIGN.md):

    RSE      = Σ_t ||O*_t − Ô_t||² / Σ_t ||O*_t||²
    token    = mean_t ||O*_t − Ô_t|| / ||O*_t||
    excluded = Σ_{i∉S} s_i / Σ_i s_i,   s_i = Σ_t g_i(t)

Fast path. Any policy output is ``Ô_t = Σ_j w_j E_{i_j}(h_t)`` for k (index, weight) pairs, so

    ||O*_t − Ô_t||² = ||O*_t||² − 2 Σ_j w_j b_t[i_j] + Σ_{j,l} w_j w_l Q_t[i_j, i_l]

with per-token Gram ``Q_t = E_t E_tᵀ [N, N]`` and ``b_t = E_t O*_t [N]`` computed once (float64).
Every candidate, budget and policy then costs O(M·k²) instead of O(M·k·H), which is what makes
the vectorised greedy oracle cheap. ``approximate`` builds Ô itself (the direct formula, used by
the tests as a cross-check).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from replay import budget as budgets
from replay.budget import prefix_masks  # noqa: F401  (re-exported for replay.run and tests)

EXACT_LIMIT = 5000  # exhaustive search only when C(N, B) is at most this


@dataclass
class TreeLayer:
    probs: torch.Tensor  # [M, N] float32
    idx: torch.Tensor  # [M, k] natural top-k
    weights: torch.Tensor  # [M, k] natural ḡ
    experts: torch.Tensor  # [M, N, H] every expert's output
    renormalize: bool
    gold: torch.Tensor = field(init=False)  # [M, H] O*
    q: torch.Tensor = field(init=False)  # [M, N, N] float64
    b: torch.Tensor = field(init=False)  # [M, N] float64
    gold_sq: torch.Tensor = field(init=False)  # [M] float64

    def __post_init__(self):
        self.gold = combine(self.experts, self.idx, self.weights)
        e = self.experts.double()
        self.q = torch.einsum("mnh,mph->mnp", e, e)
        self.b = torch.einsum("mnh,mh->mn", e, self.gold.double())
        self.gold_sq = self.gold.double().pow(2).sum(-1)

    @property
    def k(self) -> int:
        return self.idx.shape[-1]

    @property
    def n(self) -> int:
        return self.probs.shape[-1]

    @property
    def union(self) -> torch.Tensor:
        return torch.unique(self.idx)


def combine(experts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Ô_t = Σ_j w_j(t) E_{idx_j(t)}(h_t)`` for ``idx, weights [..., M, k]`` → ``[..., M, H]``."""
    lead = idx.shape[:-2]
    e = experts.expand(*lead, *experts.shape)
    picked = e.gather(-2, idx[..., None].expand(*idx.shape, experts.shape[-1]))
    return (picked * weights[..., None].to(experts.dtype)).sum(-2)


def policy(tl: TreeLayer, keep: torch.Tensor, coverage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, weights) ``[..., M, k]`` each token uses under shortlists ``keep [..., N]``."""
    lead = keep.shape[:-1]
    if coverage == "truncation":
        w = tl.weights * keep[..., tl.idx].to(tl.weights.dtype)
        return tl.idx.expand(*lead, *tl.idx.shape), w
    if coverage == "substitution":
        return budgets.substitute(tl.probs, keep[..., None, :], tl.k, tl.renormalize)
    raise ValueError(f"unknown coverage {coverage!r}")


def approximate(tl: TreeLayer, keep: torch.Tensor, coverage: str) -> torch.Tensor:
    """``MoE_S(h_t)`` itself, ``[..., M, H]`` (the direct formula)."""
    idx, w = policy(tl, keep, coverage)
    return combine(tl.experts, idx, w)


def token_sq_errors(tl: TreeLayer, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``||O*_t − Ô_t||²`` for every token, ``[..., M]``, from the Gram expansion."""
    w = w.double()
    lead = idx.shape[:-2]
    b = tl.b.expand(*lead, *tl.b.shape).gather(-1, idx)  # [..., M, k]
    q = tl.q.expand(*lead, *tl.q.shape)
    rows = q.gather(-2, idx[..., None].expand(*idx.shape, tl.n))  # [..., M, k, N]
    qq = rows.gather(-1, idx[..., None, :].expand(*idx.shape, idx.shape[-1]))  # [..., M, k, k]
    err = tl.gold_sq - 2 * (w * b).sum(-1) + torch.einsum("...j,...jl,...l->...", w, qq, w)
    return err.clamp_min(0)


def metrics(tl: TreeLayer, keep: torch.Tensor, coverage: str) -> dict[str, torch.Tensor]:
    """RSE, mean per-token relative error, mass excluded and experts loaded for shortlists
    ``keep [..., N]``."""
    idx, w = policy(tl, keep, coverage)
    sq = token_sq_errors(tl, idx, w)
    rse = sq.sum(-1) / tl.gold_sq.sum().clamp_min(1e-30)
    token = (sq.sqrt() / tl.gold_sq.sqrt().clamp_min(1e-30)).mean(-1)
    s = budgets.router_scores(tl.probs)
    excluded = (s * ~keep).sum(-1) / s.sum()
    used = torch.zeros(*keep.shape, dtype=torch.bool, device=keep.device)
    used.scatter_(-1, idx.flatten(-2), (w != 0).flatten(-2))
    return dict(rse=rse, token_error=token, mass_excluded=excluded, experts_loaded=used.sum(-1))


def oracle_order(tl: TreeLayer, coverage: str, max_budget: int) -> list[int]:
    """Greedy oracle: from S = ∅ add the expert that most reduces Σ_t ||O*_t − MoE_S(h_t)||²;
    returns the order of additions.

    Truncation has a closed form: with D the experts left out, the error is
    ``Σ_{i,j∈D} A_ij``, ``A_ij = Σ_t ḡ_i(t) ḡ_j(t) Q_t[i, j]``, so each greedy step is an O(N)
    update (:func:`replay.coact.greedy_quadratic`). Substitution re-routes tokens as S grows, so
    all N candidates are scored in one batched call per step."""
    if coverage == "truncation":
        from replay.coact import greedy_quadratic
        w = torch.zeros(tl.probs.shape, dtype=torch.float64).scatter(1, tl.idx,
                                                                      tl.weights.double())
        a = torch.einsum("mi,mj,mij->ij", w, w, tl.q)
        return greedy_quadratic(a, torch.zeros(tl.n, dtype=torch.float64), max_budget)
    keep = torch.zeros(tl.n, dtype=torch.bool, device=tl.probs.device)
    eye = torch.eye(tl.n, dtype=torch.bool, device=tl.probs.device)
    order: list[int] = []
    for _ in range(min(max_budget, tl.n)):
        idx, w = policy(tl, keep[None] | eye, coverage)  # S ∪ {c} for every c
        err = token_sq_errors(tl, idx, w).sum(-1)
        err[keep] = float("inf")
        best = int(torch.argmin(err))
        order.append(best)
        keep[best] = True
    return order


def exact_best(tl: TreeLayer, coverage: str, budget: int) -> torch.Tensor | None:
    """The B-subset with the least squared error by exhaustive search, or None when
    C(N, B) > EXACT_LIMIT."""
    if math.comb(tl.n, budget) > EXACT_LIMIT:
        return None
    subsets = torch.tensor(list(itertools.combinations(range(tl.n), budget)),
                           device=tl.probs.device)
    keep = torch.zeros(len(subsets), tl.n, dtype=torch.bool, device=tl.probs.device)
    keep.scatter_(1, subsets, True)
    best, best_err = None, float("inf")
    for chunk in keep.split(512):
        idx, w = policy(tl, chunk, coverage)
        err = token_sq_errors(tl, idx, w).sum(-1)
        i = int(torch.argmin(err))
        if float(err[i]) < best_err:
            best, best_err = chunk[i], float(err[i])
    return best
