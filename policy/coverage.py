"""Coverage policies: what a token uses when some of its experts are outside the shortlist S.

For one tree-layer with router scores ``g [M, N]`` and shortlist S (a boolean mask over the N
experts), DESIGN.md's two policies:

* ``truncation``: ``MoE_S(h_t) = Σ_{i∈T_k(t)∩S} ḡ_i(t) E_i(h_t)`` — the natural top-k and weights,
  experts outside S contribute nothing (weights are not renormalised; an empty intersection
  leaves only the residual);
* ``substitution``: the family's own routing rule applied within S (top-k of S by the selection
  scores, ties to the lower id, mixing weights formed as the model forms them: renormalised
  exactly when the model renormalises, scaled when it scales); needs B ≥ k. A token whose natural
  top-k lies inside S keeps its natural experts and weights exactly (so S ⊇ U gives the error
  floor under both policies); group-limited routing keeps the token's own groups and fills from
  S's other groups only when those hold fewer than k experts of S
  (:meth:`policy.routing.RoutingRule.selection_scores`).

Both are batched: shortlists ``keep [T, *E, N]`` (T tree-layers, any extra dims E such as budgets
or candidates) give indices and weights ``[T, *E, M, k]``. Shortlists themselves come from a
ranking's order through :func:`prefix_masks`, the one place they are built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from moe_spec.policy import index
from moe_spec.policy.batch import RoutingBatch, grow


def prefix_masks(order: torch.Tensor, budgets, n: int) -> torch.Tensor:
    """Shortlists ``[T, len(budgets), N]``: the first B experts of each selection ``order
    [T, L]`` (expert ids by priority; experts missing from a shorter order are never kept).
    ``budgets``: a list shared by every row, or a tensor ``[T, B]`` of each row's own."""
    t, length = order.shape
    rank = torch.full((t, n), n, dtype=torch.long, device=order.device)
    rank.scatter_(1, order, torch.arange(length, device=order.device).expand(t, length))
    b = torch.as_tensor(budgets, device=order.device)
    return rank[:, None, :] < (b[..., None] if b.dim() == 2 else b[None, :, None])


class Coverage(ABC):
    name: ClassVar[str]

    def min_budget(self, k: int) -> int:
        """The smallest budget the policy accepts for top-k routing
        (:func:`policy.index.min_budget`, read there without torch)."""
        return index.min_budget(self.name, k)

    @abstractmethod
    def apply(self, batch: RoutingBatch, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, weights) ``[T, *E, M, k]`` every token uses under shortlists
        ``keep [T, *E, N]``."""

    def sq_errors(self, batch: RoutingBatch, keep: torch.Tensor, idx: torch.Tensor,
                  w: torch.Tensor) -> torch.Tensor:
        """``||O*_t − Ô_t||²`` ``[T, *E, M]`` of :meth:`apply`'s (idx, w), exactly (float64)."""
        return batch.sq_errors(idx, w)


class Truncation(Coverage):
    name = "truncation"

    def apply(self, batch, keep):
        lead = keep.shape[:-1]
        idx = grow(batch.idx, lead)  # [T, *E, M, k]
        kept = keep[..., None, :].expand(*lead, batch.idx.shape[1], batch.n).gather(-1, idx)
        return idx, grow(batch.weights, lead) * kept.to(batch.weights.dtype)

    def sq_errors(self, batch, keep, idx, w):
        """Only the dropped slots d change: ``O*_t − Ô_t = δ_t + Σ_{a∈d} ḡ_a E_a``, so the error
        is ``||δ||² + 2 Σ_{a∈d} ⟨δ, ḡ_a E_a⟩ + dᵀ Y_t d`` with ``Y_t`` the k × k Gram of the
        ``ḡ_a E_a`` (no H-sized work per budget)."""
        lead = keep.shape[:-1]
        terms = batch.terms
        dropped = ((w == 0) & (grow(batch.weights, lead) != 0)).double()  # [T, *E, M, k]
        quad = torch.einsum("...a,...ab,...b->...", dropped, grow(terms.natural, lead), dropped)
        return grow(terms.floor, lead) + 2 * (dropped * grow(terms.cross, lead)).sum(-1) + quad


class Substitution(Coverage):
    name = "substitution"

    def apply(self, batch, keep):
        lead = keep.shape[:-1]
        probs = grow(batch.probs, lead)
        rule = batch.rule
        if bool((keep.sum(-1) >= batch.k).all()):  # every token finds k experts in S
            idx = self.first_in(batch, keep)
            w = rule.mix(probs, idx)
        else:
            if rule.selection_bias is not None and rule.selection_bias.dim() == 3:
                rule = rule.for_layers(grow(rule.selection_bias, lead))
            idx, valid = rule.select(probs, keep[..., None, :])  # allowed: [T, *E, 1, N]
            w = rule.mix(probs, idx, valid)
        real = batch.mask.view(batch.size, *([1] * (len(lead) - 1)), -1, 1)
        w = torch.where(real, w, torch.zeros((), dtype=w.dtype, device=w.device))
        natural_idx = grow(batch.idx, lead)
        covered = keep[..., None, :].expand(*lead, batch.idx.shape[1], batch.n).gather(
            -1, natural_idx).all(-1, keepdim=True)  # T_k(t) ⊆ S: nothing to substitute
        return (torch.where(covered, natural_idx, idx),
                torch.where(covered, grow(batch.weights, lead).to(w.dtype), w))


    @staticmethod
    def first_in(batch, keep):
        """``[T, *E, M, k]``: each token's k first experts of S in its selection order
        (:meth:`policy.batch.RoutingBatch.by_choice`), for |S| ≥ k: the rule's top-k restricted
        to S (what :meth:`policy.routing.RoutingRule.select` returns; group-limited rules
        included, their out-of-group tier being a fixed per-token offset), without a top-k or a
        group selection per shortlist."""
        lead, k = keep.shape[:-1], batch.k
        order = grow(batch.by_choice(), lead)  # [T, *E, M, N]
        inside = keep[..., None, :].expand(*lead, order.shape[-2], batch.n).gather(-1, order)
        place = inside.cumsum(-1)  # 1-based place among S's experts in selection order
        slot = torch.where(inside & (place <= k), place - 1, k)  # the rest to a spare slot k
        out = torch.empty(*order.shape[:-1], k + 1, dtype=order.dtype, device=order.device)
        return out.scatter_(-1, slot, order)[..., :k]  # (scatter, not masked_select: no sync)


COVERAGES: dict[str, Coverage] = {c.name: c for c in (Truncation(), Substitution())}


def get(name: str) -> Coverage:
    try:
        return COVERAGES[name]
    except KeyError:
        raise ValueError(f"unknown coverage {name!r}; use one of {', '.join(COVERAGES)}") \
            from None


def experts_used(idx: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """Experts with non-zero weight for some token, ``[..., N]`` bool from ``[..., M, k]``: what a
    budgeted verification pass actually has to load."""
    counts = torch.zeros(*idx.shape[:-2], n, dtype=torch.int32, device=idx.device)
    return counts.scatter_add_(-1, idx.flatten(-2), (weights != 0).int().flatten(-2)) > 0
