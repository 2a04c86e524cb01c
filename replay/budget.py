"""Expert budgets: shortlist B experts for a tree, then cover each token within the shortlist.

The one implementation of DESIGN.md's rankings and coverage policies that both the online mode
of capture (inside verification passes) and offline replay use. For one tree and MoE layer with
router softmax ``g [M, N]``:

* router ranking: ``s_i = Σ_t g_i(t)``; the shortlist S holds the B largest ``s_i``;
* static ranking: per-layer selection counts ``c_i`` from calibration traces; S = the B largest;
* truncation: ``MoE_S(h_t) = Σ_{i∈T_k(t)∩S} ḡ_i(t) E_i(h_t)`` — natural top-k and weights, the
  experts outside S contribute nothing (weights are not renormalised);
* substitution: the top-k *within S* by ``g_i(t)``, ``T_k^S(t)``, with weights renormalised over
  it exactly when the model renormalises, else the raw ``g_i(t)``.
"""

from __future__ import annotations

import torch

COVERAGES = ("truncation", "substitution")


def router_scores(probs: torch.Tensor) -> torch.Tensor:
    """``s_i = Σ_t g_i(t)`` over the tree's tokens: ``[M, N] → [N]``."""
    return probs.sum(0)


def prefix_masks(order, budgets: list[int], n: int) -> torch.Tensor:
    """Shortlists ``[len(budgets), N]``: the first B experts of a selection ``order`` (expert ids
    by priority), one row per budget. The one place shortlists are built."""
    order = torch.as_tensor(order, dtype=torch.long)
    rank = torch.full((n,), n, dtype=torch.long, device=order.device)  # outside the order: never
    rank[order] = torch.arange(len(order), device=order.device)
    return rank[None] < torch.as_tensor(budgets, device=order.device)[:, None]


def keep_mask(order, budget: int, n: int) -> torch.Tensor:
    """Boolean ``[N]``: the first ``budget`` experts of ``order``."""
    return prefix_masks(order, [budget], n)[0]


def shortlist(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Boolean mask ``[N]`` of the ``budget`` highest-scoring experts (ties: lower index)."""
    return keep_mask(torch.argsort(scores, descending=True, stable=True), budget, len(scores))


def truncate(natural_idx: torch.Tensor, natural_w: torch.Tensor, keep: torch.Tensor):
    """Natural top-k with the weights of experts outside the shortlist set to 0.

    Returns (indices, weights) of the same shape ``[M, k]``; dropped slots keep their index only
    so the shapes stay fixed — their weight is exactly 0."""
    return natural_idx, natural_w * keep[natural_idx].to(natural_w.dtype)


def substitute(probs: torch.Tensor, keep: torch.Tensor, k: int, renormalize: bool):
    """Top-k within the shortlist by ``g``; weights renormalised iff the model renormalises."""
    masked = probs.masked_fill(~keep, float("-inf"))
    weights, idx = masked.topk(k, dim=-1)
    weights = weights.clamp_min(0)  # -inf only when B < k, which callers refuse
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return idx, weights


def apply(probs: torch.Tensor, natural_idx: torch.Tensor, natural_w: torch.Tensor,
          keep: torch.Tensor, coverage: str, renormalize: bool):
    """(indices, weights) a budgeted MoE layer uses for every token, ``[M, k]`` each."""
    if coverage == "truncation":
        return truncate(natural_idx, natural_w, keep)
    if coverage == "substitution":
        return substitute(probs, keep, natural_idx.shape[-1], renormalize)
    raise ValueError(f"unknown coverage {coverage!r}; use one of {', '.join(COVERAGES)}")


def experts_used(idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sorted ids of the experts with non-zero weight for some token: what a budgeted
    verification pass actually has to load."""
    return torch.unique(idx[weights != 0])
