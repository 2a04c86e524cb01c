"""A batch of tree-layers: the routing every ranking sees, and the expert outputs offline ones use.

A *tree-layer* is one verification pass at one MoE layer (M tree tokens). Rankings and coverage
policies work on T of them at once, padded to a common M with a token mask (padding has zero
scores and zero weights, so every sum over tokens ignores it):

    probs   [T, M, N]   router scores g (0 on padding)
    idx     [T, M, k]   natural top-k T_k(t)
    weights [T, M, k]   natural mixing weights ḡ (0 on padding)
    mask    [T, M]      real tokens
    layers  [T]         decoder layer of each tree-layer

Offline rankings (oracle, exact) and the error metrics need every expert's output
``E_t [N, H]`` (:class:`ExpertTerms`). With ``R*_t = Σ_{i∈T_k(t)} ḡ_i E_i(h_t)`` the routed part of
the gold output and (i, w) the k (expert, weight) pairs a policy gives token t, the error is

    ||O*_t − Ô_t||² = ||R*_t − Σ_j w_j E_{i_j}(h_t)||²                      (direct, float64)
                    = ||R*_t||² − 2 wᵀ b_t[i] + wᵀ Q_t[i, i] w                (Gram expansion)

with ``Q_t = E_t E_tᵀ [N, N]`` and ``b_t = E_t R*_t [N]``: the direct form scores a few shortlists
exactly; the Gram form (computed once, lazily, only when a ranking needs it) scores thousands of
candidate shortlists without touching H. Shared experts, where a family has them, are in O* and
Ô alike and cancel in the difference; they count in ``||O*_t||²``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_spec.policy.routing import RoutingRule


def grow(x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """``x [T, …]`` viewed (not copied) as ``[T, *E, …]`` for leading dims ``lead = (T, *E)``."""
    return x.view(x.shape[0], *([1] * (len(lead) - 1)), *x.shape[1:]).expand(*lead, *x.shape[1:])


def combine(experts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """``Σ_j w_j(t) E_{idx_j(t)}(h_t)``: ``experts [T, M, N, H]``, ``idx, weights [T, M, k]`` →
    ``[T, M, H]``, computed in ``dtype`` (default: the experts')."""
    picked = experts.gather(-2, idx[..., None].expand(*idx.shape, experts.shape[-1]))
    dtype = dtype or experts.dtype
    return (picked.to(dtype) * weights[..., None].to(dtype)).sum(-2)


@dataclass
class ExpertTerms:
    """Every expert's output on a batch's tokens, and what errors are computed from.

    The gold output is the model's own sum ``R*`` (accumulated in the experts' dtype, as the
    model does). A policy's output ``Ô`` is summed exactly (float64). Their difference splits
    into a tiny per-token constant ``δ = R* − R̂`` (``R̂``: the natural top-k summed exactly) and
    the part the budget changes, so a token whose experts and weights are unchanged costs
    nothing and ``||δ||²`` is the error floor every policy shares."""

    experts: torch.Tensor | None  # [T, M, N, H] as computed (float32), 0 on padding (None:
    # left out by take(outputs=False))
    routed: torch.Tensor  # [T, M, H] float64: R*, the model's sum
    delta: torch.Tensor  # [T, M, H] float64: δ = R* − R̂
    gold_sq: torch.Tensor  # [T, M] float64: ||O*||² (shared experts included)
    natural: torch.Tensor  # [T, M, k, k] float64: ⟨ḡ_a E_a, ḡ_b E_b⟩ over each top-k
    cross: torch.Tensor  # [T, M, k] float64: ⟨δ, ḡ_a E_a⟩
    _gram: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def from_outputs(cls, experts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                     shared: torch.Tensor | None = None) -> ExpertTerms:
        """From every expert's output ``experts [T, M, N, H]``, the natural routing and, where the
        family has them, the shared experts' output ``[T, M, H]``."""
        routed = combine(experts, idx, weights).double()
        y = experts.gather(-2, idx[..., None].expand(*idx.shape, experts.shape[-1])).double() \
            * weights[..., None].double()  # ḡ_a E_a over each token's top-k: [T, M, k, H]
        delta = routed - y.sum(-2)
        gold = routed if shared is None else routed + shared.double()
        return cls(experts, routed, delta, gold.pow(2).sum(-1),
                   torch.einsum("tmah,tmbh->tmab", y, y), torch.einsum("tmh,tmah->tma", delta, y))

    @property
    def routed_sq(self) -> torch.Tensor:
        return self.routed.pow(2).sum(-1)

    @property
    def floor(self) -> torch.Tensor:
        """``||δ||² [T, M]``: the error of a token whose routing the budget leaves unchanged."""
        return self.delta.pow(2).sum(-1)

    def gram(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q [T, M, N, N], b [T, M, N])`` in float64, computed on first use."""
        if self._gram is None:
            e = self.experts.double()  # not kept: [T, M, N, H] float64 is the batch's largest
            self._gram = (torch.einsum("tmnh,tmph->tmnp", e, e),
                          torch.einsum("tmnh,tmh->tmn", e, self.routed))
        return self._gram

    def take(self, rows: torch.Tensor, outputs: bool = True) -> ExpertTerms:
        """The tree-layers ``rows``; ``outputs=False`` leaves the raw outputs ``experts`` out
        (None) once the Gram terms exist (they are all the swap search reads; copying
        ``[T, M, N, H]`` per search round cost more than the round)."""
        gram = None if self._gram is None else (self._gram[0][rows], self._gram[1][rows])
        experts = self.experts[rows] if outputs or gram is None else None
        return ExpertTerms(experts, self.routed[rows], self.delta[rows], self.gold_sq[rows],
                           self.natural[rows], self.cross[rows], gram)


@dataclass
class RoutingBatch:
    probs: torch.Tensor  # [T, M, N]
    idx: torch.Tensor  # [T, M, k]
    weights: torch.Tensor  # [T, M, k]
    mask: torch.Tensor  # [T, M] bool
    layers: torch.Tensor  # [T] long
    rule: RoutingRule
    terms: ExpertTerms | None = None
    _by_choice: torch.Tensor | None = field(default=None, repr=False)
    hidden: torch.Tensor | None = field(default=None, repr=False)  # [T, M, H] the MoE inputs
    # h_t: known in a verification pass before any expert runs (token-aware rankings read it)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # memo()'s
    # results: never carried to a copy (dataclasses.replace, take) whose fields may differ

    @classmethod
    def single(cls, probs, idx, weights, layer: int, rule: RoutingRule,
               hidden: torch.Tensor | None = None) -> RoutingBatch:
        """One tree-layer (``[M, …]`` tensors, ``hidden [M, H]`` its MoE inputs where known), as
        at run time inside a verification pass."""
        return cls(probs[None], idx[None], weights[None],
                   torch.ones(1, probs.shape[0], dtype=torch.bool, device=probs.device),
                   torch.tensor([layer], device=probs.device), rule,
                   hidden=None if hidden is None else hidden[None])

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

    def by_choice(self) -> torch.Tensor:
        """``[T, M, N]``: every token's experts in the order substitution selects them, by
        decreasing selection score with every expert allowed (group-limited routing: the
        token's kept groups first, :meth:`policy.routing.RoutingRule.selection_scores`), ties to
        the lower id (the order :func:`policy.routing.top_k_lowest_id` selects in), computed on
        first use."""
        if self._by_choice is None:
            self._by_choice = torch.sort(self.rule.substitution_scores(self.probs), dim=-1,
                                         descending=True, stable=True).indices
        return self._by_choice

    def memo(self, key, compute):
        """``compute()``, once per key for this batch's tree-layers (what several tasks ask of the
        same batch: :func:`policy.rankings.base.batch_shortlists`); a copy starts empty. The
        batch must not change after: the replay engine builds it whole (hidden and terms
        included) before any ranking runs."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def union(self) -> torch.Tensor:
        """``U = ∪_t T_k(t)`` per tree-layer, ``[T, N]`` bool (what an unbudgeted pass loads)."""
        hit = torch.zeros(*self.probs.shape[::2], dtype=torch.int32, device=self.device)
        counts = self.mask[..., None].expand(self.idx.shape).int()
        return hit.scatter_add_(-1, self.idx.flatten(1), counts.flatten(1)) > 0

    def take(self, rows: torch.Tensor, outputs: bool = True) -> RoutingBatch:
        """The tree-layers ``rows`` of this batch (and of its expert terms, with the raw outputs
        unless ``outputs=False``: :meth:`ExpertTerms.take`)."""
        rule = self.rule
        if rule.selection_bias is not None and rule.selection_bias.dim() == 3:
            rule = rule.for_layers(rule.selection_bias[rows])
        return RoutingBatch(self.probs[rows], self.idx[rows], self.weights[rows], self.mask[rows],
                            self.layers[rows], rule,
                            None if self.terms is None else self.terms.take(rows, outputs),
                            None if self._by_choice is None else self._by_choice[rows],
                            None if self.hidden is None else self.hidden[rows])

    def sq_errors(self, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``||O*_t − Ô_t||²`` for every token, exactly (float64): ``idx, w [T, *E, M, k]`` →
        ``[T, *E, M]``. Tokens whose experts and weights equal the natural ones get the floor
        ``||δ||²``; only the others gather their k expert outputs."""
        lead, m, k = idx.shape[:-2], idx.shape[-2], idx.shape[-1]
        t, n, terms = lead[0], self.n, self.terms
        h = terms.experts.shape[-1]
        same = ((idx == grow(self.idx, lead)) & (w == grow(self.weights, lead))).all(-1)
        out = grow(terms.floor, lead).reshape(-1).clone()  # [T·E·M]
        changed = (~same).reshape(-1).nonzero().squeeze(1)
        if changed.numel():
            per_t = out.numel() // t  # E·M
            token = (changed // per_t) * m + changed % m  # row of [T·M]
            rows = (token[:, None] * n + idx.reshape(-1, k).index_select(0, changed)).flatten()
            picked = terms.experts.reshape(-1, h).index_select(0, rows).view(-1, k, h).double()
            weights = w.reshape(-1, k).index_select(0, changed).double()
            approx = torch.einsum("ckh,ck->ch", picked, weights)
            gold = terms.routed.reshape(-1, h).index_select(0, token)
            out[changed] = (gold - approx).pow(2).sum(-1)
        return out.view(*lead, m)

    def token_sq_errors(self, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``||O*_t − Ô_t||²`` from the Gram expansion (any number of candidate shortlists):
        ``idx, w [T, *E, M, k]`` → ``[T, *E, M]`` (float64)."""
        q, b = self.terms.gram()
        return gram_sq_errors(self.terms.routed_sq, b, q, idx, w).clamp_min(0)


def pair_index(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``a·N + b`` for every pair of each token's experts ``idx [..., k]`` → ``[..., k·k]``: where
    ``Q_t[a, b]`` sits in a flattened ``[N·N]`` Gram."""
    return (idx[..., :, None] * n + idx[..., None, :]).flatten(-2)


def gram_sq_errors(r_sq: torch.Tensor, b: torch.Tensor, q: torch.Tensor, idx: torch.Tensor,
                   w: torch.Tensor) -> torch.Tensor:
    """``||R*_t||² − 2 wᵀ b_t[i] + wᵀ Q_t[i, i] w`` for every token: ``r_sq [T, M]``, ``b [T, M, N]``,
    ``q [T, M, N, N]`` (expanded views welcome), ``idx, w [T, *E, M, k]`` → ``[T, *E, M]``."""
    lead = idx.shape[:-2]  # (T, *E)
    n, k = q.shape[-1], idx.shape[-1]
    bb = grow(b, lead).gather(-1, idx)  # [T, *E, M, k]
    pairs = pair_index(idx, n)  # [T, *E, M, k*k]
    qq = grow(q.flatten(-2), lead).gather(-1, pairs).unflatten(-1, (k, k))
    w = w.double()
    return grow(r_sq, lead) - 2 * (w * bb).sum(-1) + torch.einsum(
        "...j,...jl,...l->...", w, qq, w)
