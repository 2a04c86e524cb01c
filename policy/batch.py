"""A batch of tree-layers: the routing every ranking sees, and the expert terms offline ones use.

A *tree-layer* is one verification pass at one MoE layer (M tree tokens). Rankings and coverage
policies work on T of them at once, padded to a common M with a token mask (padding has zero
scores and zero weights, so every sum over tokens ignores it):

    probs   [T, M, N]   router scores g (0 on padding)
    idx     [T, M, k]   natural top-k T_k(t)
    weights [T, M, k]   natural mixing weights ḡ (0 on padding)
    mask    [T, M]      real tokens
    layers  [T]         decoder layer of each tree-layer

Offline rankings (oracle, exact) and the error metrics need every expert's output; they get it
as per-token Gram terms (float64), from which any policy's error follows without touching H:

    q_t = E_t E_tᵀ [N, N],   b_t = E_t R*_t [N],   ||O*_t − Ô_t||² = ||R*_t||² − 2 wᵀb_t[i] + wᵀ Q_t[i, i] w

with ``E_t [N, H]`` all experts' outputs on h_t, ``R*_t = Σ_{i∈T_k(t)} ḡ_i E_i(h_t)`` the routed
part of the gold output, and (i, w) the k (expert, weight) pairs the policy uses for token t.
Shared experts, where a family has them, are in O* and Ô alike and cancel in the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policy.routing import RoutingRule


@dataclass
class ExpertTerms:
    q: torch.Tensor  # [T, M, N, N] float64
    b: torch.Tensor  # [T, M, N] float64
    routed_sq: torch.Tensor  # [T, M] ||R*_t||² float64
    gold_sq: torch.Tensor  # [T, M] ||O*_t||² float64 (shared experts included)

    @classmethod
    def from_outputs(cls, experts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                     shared: torch.Tensor | None = None) -> ExpertTerms:
        """From every expert's output ``experts [T, M, N, H]``, the natural routing and, where the
        family has them, the shared experts' output ``[T, M, H]``."""
        routed = combine(experts, idx, weights)  # [T, M, H]
        e = experts.double()
        q = torch.einsum("tmnh,tmph->tmnp", e, e)
        b = torch.einsum("tmnh,tmh->tmn", e, routed.double())
        routed_sq = routed.double().pow(2).sum(-1)
        gold_sq = routed_sq if shared is None else (routed + shared).double().pow(2).sum(-1)
        return cls(q, b, routed_sq, gold_sq)


def grow(x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """``x [T, …]`` viewed (not copied) as ``[T, *E, …]`` for leading dims ``lead = (T, *E)``."""
    return x.view(x.shape[0], *([1] * (len(lead) - 1)), *x.shape[1:]).expand(*lead, *x.shape[1:])


def combine(experts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_j w_j(t) E_{idx_j(t)}(h_t)``: ``experts [T, M, N, H]``, ``idx, weights [T, M, k]`` →
    ``[T, M, H]``."""
    picked = experts.gather(-2, idx[..., None].expand(*idx.shape, experts.shape[-1]))
    return (picked * weights[..., None].to(experts.dtype)).sum(-2)


@dataclass
class RoutingBatch:
    probs: torch.Tensor  # [T, M, N]
    idx: torch.Tensor  # [T, M, k]
    weights: torch.Tensor  # [T, M, k]
    mask: torch.Tensor  # [T, M] bool
    layers: torch.Tensor  # [T] long
    rule: RoutingRule
    terms: ExpertTerms | None = None

    @classmethod
    def single(cls, probs, idx, weights, layer: int, rule: RoutingRule) -> RoutingBatch:
        """One tree-layer (``[M, …]`` tensors), as at run time inside a verification pass."""
        return cls(probs[None], idx[None], weights[None],
                   torch.ones(1, probs.shape[0], dtype=torch.bool, device=probs.device),
                   torch.tensor([layer], device=probs.device), rule)

    @property
    def size(self) -> int:
        return self.probs.shape[0]

    @property
    def n(self) -> int:
        return self.probs.shape[-1]

    @property
    def k(self) -> int:
        return self.idx.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.probs.device

    def mass(self) -> torch.Tensor:
        """Router mass ``s_i = Σ_t g_i(t)`` per tree-layer, ``[T, N]``."""
        return self.probs.sum(1)

    def dense_weights(self) -> torch.Tensor:
        """``ḡ`` scattered to ``[T, M, N]`` (0 outside each token's top-k and on padding)."""
        return torch.zeros(*self.probs.shape, dtype=torch.float32, device=self.device).scatter(
            -1, self.idx, self.weights.float())

    def union(self) -> torch.Tensor:
        """``U = ∪_t T_k(t)`` per tree-layer, ``[T, N]`` bool (what an unbudgeted pass loads)."""
        hit = torch.zeros(*self.probs.shape[::2], dtype=torch.int32, device=self.device)
        counts = self.mask[..., None].expand(self.idx.shape).int()
        return hit.scatter_add_(-1, self.idx.flatten(1), counts.flatten(1)) > 0

    def take(self, rows: torch.Tensor) -> RoutingBatch:
        """The tree-layers ``rows`` of this batch (and of its expert terms)."""
        t = self.terms
        terms = None if t is None else ExpertTerms(t.q[rows], t.b[rows], t.routed_sq[rows],
                                                   t.gold_sq[rows])
        rule = self.rule
        if rule.selection_bias is not None and rule.selection_bias.dim() == 3:
            rule = rule.for_layers(rule.selection_bias[rows])
        return RoutingBatch(self.probs[rows], self.idx[rows], self.weights[rows], self.mask[rows],
                            self.layers[rows], rule, terms)

    def token_sq_errors(self, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``||O*_t − Ô_t||²`` for every token from the Gram terms: ``idx, w [T, *E, M, k]`` →
        ``[T, *E, M]`` (float64)."""
        t = self.terms
        lead = idx.shape[:-2]  # (T, *E)
        n, k = self.n, idx.shape[-1]
        shape = (*lead, idx.shape[-2])
        b = grow(t.b, lead).gather(-1, idx)  # [T, *E, M, k]
        pairs = (idx[..., :, None] * n + idx[..., None, :]).flatten(-2)  # [T, *E, M, k*k]
        qq = grow(t.q.flatten(-2), lead).gather(-1, pairs).unflatten(-1, (k, k))
        w = w.double()
        err = grow(t.routed_sq, lead) - 2 * (w * b).sum(-1) + torch.einsum("...j,...jl,...l->...",
                                                                      w, qq, w)
        return err.clamp_min(0).reshape(shape)
