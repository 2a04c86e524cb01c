"""``coact``: a co-activation-aware expert selector that needs no expert outputs at run time.

The oracle picks S to minimise the truncation error Σ_t ||Σ_{i∈D} ḡ_i(t) E_i(h_t)||², D the
experts left out. Expanding the square,

    err(D) = Σ_{i,j∈D} Σ_t ḡ_i(t) ḡ_j(t) ⟨E_i(h_t), E_j(h_t)⟩.

At verification time the tree's router probabilities give ``A_ij = Σ_t ḡ_i(t) ḡ_j(t)`` exactly —
the tree's co-activation matrix weighted by mixing weights — but not the expert outputs. coact
replaces the unknown inner products by their calibration averages

    G_ij = mean ⟨E_i(h), E_j(h)⟩ over calibration tokens whose top-k holds both i and j
           (G_ii: mean ||E_i(h)||² over tokens routed to i; 0 for pairs never co-activated),

learned offline (the model's own experts on captured calibration MoE inputs), and greedily
builds S from ∅, each time adding the expert c that most reduces the predicted error
``q(D) = Σ_{i,j∈D} A_ij G_ij``: removing c from D lowers q by ``2 Σ_{j∈D} M_cj − M_cc`` with
``M = A ⊙ G``. Relative to router ranking (mass ``Σ_t g_i(t)``) this weighs an expert by the size
of its outputs, by squared rather than linear mixing weights, and by whether its outputs add up
with or cancel those of experts it fires with. Ties (experts no tree token routes to) fall back
to router mass. Cost: O(N²) per added expert, no expert evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CoactStats:
    gram: torch.Tensor  # [L, N, N] float64 sums of <E_i, E_j> over co-activated tokens
    pairs: torch.Tensor  # [L, N, N] co-activation counts (diagonal: selection counts)
    layers: list[int]  # decoder layer index of each row

    def mean_gram(self, layer: int) -> torch.Tensor:
        i = self.layers.index(layer)
        return (self.gram[i] / self.pairs[i].clamp_min(1)).float()

    def selection_counts(self, layer: int) -> torch.Tensor:
        """``c_i``: calibration tokens whose top-k holds expert i (static ranking's scores)."""
        return self.pairs[self.layers.index(layer)].diagonal().float()


def accumulate(stats: CoactStats, layer: int, idx: torch.Tensor, topk_outputs: torch.Tensor):
    """Add one batch: ``idx [M, k]`` selected experts and ``topk_outputs [M, k, H]`` their
    outputs on those tokens."""
    i = stats.layers.index(layer)
    n = stats.gram.shape[-1]
    dots = torch.einsum("mah,mbh->mab", topk_outputs.double(), topk_outputs.double())  # [M,k,k]
    flat = (idx[:, :, None] * n + idx[:, None, :]).reshape(-1)
    stats.gram[i].view(-1).index_add_(0, flat, dots.reshape(-1))
    stats.pairs[i].view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=stats.pairs.dtype))


def greedy_quadratic(m: torch.Tensor, tie: torch.Tensor, max_budget: int) -> list[int]:
    """Greedy minimisation of ``q(D) = Σ_{i,j∈D} M_ij`` over S = complement of D, from S = ∅:
    each step adds the c with the largest drop ``2 Σ_{j∈D} M_cj − M_cc`` (``tie`` breaks exact
    ties). O(N) per step after the O(N²) row sums."""
    m = m.double()
    n = m.shape[0]
    left = torch.ones(n, dtype=torch.bool, device=m.device)  # D
    row = m.sum(1)  # Σ_{j∈D} M_cj
    order: list[int] = []
    for _ in range(min(max_budget, n)):
        gain = 2 * row - m.diagonal() + tie
        gain[~left] = float("-inf")
        c = int(torch.argmax(gain))
        order.append(c)
        left[c] = False
        row -= m[:, c]
    return order


def coact_order(dense_weights: torch.Tensor, gram: torch.Tensor, router_mass: torch.Tensor,
                max_budget: int) -> list[int]:
    """Greedy selection order for one tree-layer. ``dense_weights [M, N]``: ḡ scattered over the
    natural top-k (0 elsewhere); ``gram [N, N]``: calibration G; ``router_mass [N]``: s_i."""
    a = dense_weights.T.double() @ dense_weights.double()  # A_ij = Σ_t ḡ_i ḡ_j
    tie = router_mass.double() / router_mass.double().sum().clamp_min(1e-30) * 1e-12
    return greedy_quadratic(a * gram.double(), tie, max_budget)
