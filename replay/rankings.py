"""Expert rankings: which experts a budget keeps for one tree and MoE layer.

Runtime rankings (usable inside a verification pass, by capture's online mode and closed-loop
replay) need only the tree's router probabilities and offline calibration statistics:

* ``router``: by ``s_i = Σ_t g_i(t)`` (MoE-Spec);
* ``static``: by calibration selection counts ``c_i`` (input-independent);
* ``coact``: this project's co-activation-aware selector (:mod:`replay.coact`).

Offline-only rankings need every expert's output: ``oracle`` (greedy reconstruction) and
``exact`` (exhaustive search), in :mod:`replay.open_loop`.
"""

from __future__ import annotations

import torch

from replay import budget as budgets
from replay.budget import keep_mask  # noqa: F401  (re-exported: callers pick masks here)
from replay.coact import CoactStats, coact_order

RUNTIME = ("router", "static", "coact")
OFFLINE = ("oracle", "exact")
ALL = ("static", "router", "oracle", "exact", "coact")
NEEDS_CALIBRATION = ("static", "coact")


def dense_weights(idx: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """``ḡ`` scattered to ``[M, N]`` (0 outside each token's top-k)."""
    return torch.zeros(idx.shape[0], n, dtype=weights.dtype, device=weights.device).scatter(
        1, idx, weights)


def runtime_order(ranking: str, probs: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                  layer: int, stats: CoactStats | None) -> torch.Tensor:
    """All N expert ids (a LongTensor) in the order a runtime ranking adds them to the
    shortlist."""
    n = probs.shape[-1]
    mass = budgets.router_scores(probs)
    if ranking == "router":
        scores = mass
    elif ranking == "static":
        scores = stats.selection_counts(layer).to(probs.device)
    elif ranking == "coact":
        order = coact_order(dense_weights(idx, weights.float(), n),
                            stats.mean_gram(layer).to(probs.device), mass, n)
        return torch.tensor(order, device=probs.device)
    else:
        raise ValueError(f"{ranking!r} is not a runtime ranking; use one of {', '.join(RUNTIME)}")
    return torch.argsort(scores, descending=True, stable=True)

