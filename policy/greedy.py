"""Greedy minimisation of a quadratic form over the experts left out, batched over tree-layers.

For a symmetric ``Q [N, N]`` and the experts left out D = complement of S, minimise
``q(D) = Σ_{i,j∈D} Q_ij`` by growing S from ∅: removing c from D lowers q by
``2 Σ_{j∈D} Q_cj − Q_cc``, so each step adds the c with the largest drop (``tie`` breaks exact
ties). After the O(N²) row sums each step is O(N) per tree-layer, and the loop runs
``max_budget`` steps per *batch*, not per tree-layer. An expert whose row of Q is all zero (no
tree token routes to it) gains exactly ``tie`` at every step, so once only such experts are left
the rest of the order is theirs by ``tie`` (descending, ties to the lower id, as the loop's argmax
would pick them). Both the truncation oracle
(Q = A ⊙ Gram of the tree) and coact (Q = A ⊙ calibration G) are this.
"""

from __future__ import annotations

import torch

from moe_spec.policy.batch import pair_index


def greedy_quadratic(q: torch.Tensor, tie: torch.Tensor, max_budget: int) -> torch.Tensor:
    """Order of additions ``[T, min(max_budget, N)]`` for ``q [T, N, N]``, ``tie [T, N]``."""
    q = q.double()
    t, n = q.shape[0], q.shape[-1]
    rows = torch.arange(t, device=q.device)
    left = torch.ones(t, n, dtype=torch.bool, device=q.device)  # D
    row = q.sum(-1)  # Σ_{j∈D} Q_cj
    diag = q.diagonal(dim1=-2, dim2=-1)
    steps = min(max_budget, n)
    order = torch.empty(t, steps, dtype=torch.long, device=q.device)
    active = (q != 0).any(-1)  # [T, N]: the others gain exactly `tie`, whatever is chosen
    settled = int(active.sum(-1).max())  # no step before this can have only those left
    for s in range(steps):
        if s >= settled and not bool((left & active).any()):
            rest = torch.sort(tie.masked_fill(~left, float("-inf")), dim=-1, descending=True,
                              stable=True).indices
            order[:, s:] = rest[:, : steps - s]
            break
        gain = (2 * row - diag + tie).masked_fill(~left, float("-inf"))
        c = gain.argmax(-1)
        order[:, s] = c
        left[rows, c] = False
        row -= q[rows, :, c]
    return order


def pair_sums(idx: torch.Tensor, dots: torch.Tensor, n: int) -> torch.Tensor:
    """``Q [T, N, N]`` float64 with ``Q_ij = Σ_t dots_t[a, b]`` over the slots a, b of tokens whose
    top-k ``idx [T, M, k]`` holds i at a and j at b (``dots [T, M, k, k]``): the k² products of
    each token scattered, never an ``[M, N, ·]`` temporary."""
    t = idx.shape[0]
    flat = pair_index(idx, n).reshape(t, -1)
    return torch.zeros(t, n * n, dtype=torch.float64, device=idx.device).scatter_add_(
        1, flat, dots.double().reshape(t, -1)).view(t, n, n)


def oracle_order(idx: torch.Tensor, weights: torch.Tensor, picked: torch.Tensor,
                 n: int) -> torch.Tensor:
    """The truncation oracle's greedy order of one tree-layer, ``[N]``, from each token's top-k
    ``idx, weights [M, k]`` and those experts' outputs ``picked [M, k, H]``: ``Q_ij = Σ_t
    ⟨ḡ_i E_i, ḡ_j E_j⟩`` over tokens whose top-k holds both (:func:`pair_sums`), ties by
    router mass."""
    y = weights.double()[..., None] * picked.double()  # ḡ_a E_a: [M, k, H]
    q = pair_sums(idx[None], torch.einsum("mah,mbh->mab", y, y)[None], n)
    tie = torch.zeros(n, dtype=torch.float64).scatter_add_(
        0, idx.reshape(-1), weights.double().reshape(-1)) * 1e-12
    return greedy_quadratic(q, tie[None], n)[0]
