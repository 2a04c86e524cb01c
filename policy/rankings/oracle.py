"""``oracle``: the best shortlist found with every expert's output known (offline reference).

Per tree-layer and budget, under either coverage policy:

1. **Exhaustive** where C(N, B) ≤ 5000 (every budget of an 8-expert model): the oracle *is*
   ``exact`` there (:func:`policy.rankings.exact.exhaustive_best`).
2. Elsewhere, **starts**: the greedy prefixes below, router's and squared mixing mass's
   prefixes, and the shortlist of every registered runtime ranking (fitted on the replay's
   calibration when one is given: static, coact-diag, coact, learned, coact-online; the
   stateful ones, previous and coact-online, streamed pass by pass by open-loop replay exactly
   as their own results are; the token-aware ones, sketch, sketch-post and sketch-gated, only
   where the calibration carries the surrogate's sums, i.e. when one of them is replayed with
   the oracle, and its results' key then says ``token_aware_starts``:
   :func:`policy.index.surrogate_sums`); the start with the least exact error is kept (ties to
   the first).
3. **Swap local search** from that start (:func:`local_search`): every swap (one member of S
   out, one expert outside in) screened in closed form, the best few scored exactly, the best
   made while the exact error drops, batched over tree-layers.

So in open-loop replay the oracle is never worse than any runtime ranking in any cell, by
construction (called directly, without the stream, it starts from the stateless ones only); the
search does not prove optimality beyond the exhaustive budgets. ``bench/oracle_bound.py``
counts the cells where any runtime ranking beats it.

The greedy starts:

From S = ∅ add the expert that most reduces ``Σ_t ||O*_t − MoE_S(h_t)||²`` under the coverage
policy, for every tree-layer of a batch at once (``max_budget`` steps per batch).

* Truncation has a closed form: with D the experts left out the error is ``Σ_{i,j∈D} A_ij``,
  ``A_ij = Σ_t ḡ_i(t) ḡ_j(t) ⟨E_i(h_t), E_j(h_t)⟩``, built from each token's k selected outputs
  only, and minimised by :func:`policy.greedy.greedy_quadratic`.
* Substitution re-routes tokens as S grows. Adding candidate c changes token t's selection P_t
  (its top-k within S) only if P_t has room or c beats P_t's weakest member m, which c then
  replaces. With per-token sums over P_t (Gram terms Q_t, b_t of :mod:`policy.batch`)

      L = Σ_{i∈P} g_i b_i,   Q = Σ_{i,j∈P} g_i g_j Q_ij,   Z = Σ_{i∈P} g_i,   C_x = Σ_{j∈P} g_j Q_xj

  every candidate's new error follows in O(1) per token (m's terms out, c's in):

      L' = L − g_m b_m + g_c b_c
      Q' = Q − 2 g_m C_m + g_m² Q_mm + 2 g_c (C_c − g_m Q_cm) + g_c² Q_cc
      err = ||R*||² − 2 a(Z') L' + a(Z')² Q'    (a: the rule's mixing, policy.routing.Mixing)

  so each step scores all N candidates of all T tree-layers in O(T·M·N). Once no candidate
  changes any token of a tree-layer (S covers every token's top-k), the rest of its order is
  filled by expert id, as exact ties resolve, and it leaves the loop. "c beats m" is the
  token's substitution order, so group-limited routing (DeepSeek's: the token's kept groups
  first, a fixed tier above S's other experts) is searched the same way.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from moe_spec.policy.coverage import COVERAGES, Truncation, prefix_masks
from moe_spec.policy.greedy import greedy_quadratic, pair_sums
from moe_spec.policy.index import EXACT_LIMIT
from moe_spec.policy.rankings.base import (
    REGISTRY,
    Ranking,
    RankingError,
    Same,
    batch_shortlists,
    by_mass,
    by_squared_mass,
    register,
    selected_first,
)
from moe_spec.policy.rankings.exact import exhaustive_best
from moe_spec.policy.substitution import best_shortlists
from moe_spec.policy.surrogate import MOMENTS


@register
class Oracle(Ranking):
    name = "oracle"
    max_rounds: ClassVar[int] = 8

    def fit(self, calibration=None):
        super().fit(calibration)
        self.starts = start_rankings(calibration)
        self.stateful_starts = tuple(start_rankings(calibration, stateful=True))
        return self

    def shortlists(self, batch, coverage, budgets, starts=()):
        """Per tree-layer and budget the best shortlist found (module docstring): exhaustive where
        C(N, B) ≤ ``EXACT_LIMIT``, else the best start improved by swaps. ``starts``: shortlists
        ``[T, len(budgets), N]`` of the stateful rankings, streamed by open-loop replay."""
        if batch.terms is None:
            raise RankingError("oracle needs every expert's output (open-loop replay only)")
        budgets = list(budgets)
        keep = torch.zeros(batch.size, len(budgets), batch.n, dtype=torch.bool,
                           device=batch.device)
        searched = [j for j, b in enumerate(budgets) if math.comb(batch.n, b) > EXACT_LIMIT]
        for j, b in enumerate(budgets):
            if j not in searched:
                keep[:, j] = exhaustive_best(batch, coverage, b)
        if searched:
            part = [budgets[j] for j in searched]
            extra = [s[:, searched] for s in starts]
            keep[:, searched] = local_search(batch, coverage,
                                             self.start(batch, coverage, part, extra),
                                             part, self.max_rounds)
        return keep, budgets

    def start(self, batch, coverage, budgets, extra=()) -> torch.Tensor:
        """``[T, len(budgets), N]``: per tree-layer and budget the best of the greedy prefixes,
        router's and squared mass's prefixes and every start ranking's shortlist (ties to the
        first)."""
        most = max(budgets)
        if isinstance(coverage, Truncation):
            orders = [selected_first(self.order(batch, coverage, most), batch)]
        else:
            orders = [self.order(batch, coverage, most),  # the substitution greedy first: ties
                      selected_first(self.order(batch, COVERAGES["truncation"], most), batch)]
        orders += [by_mass(batch.mass()), by_squared_mass(batch)]
        candidates = [prefix_masks(o, budgets, batch.n) for o in orders]
        starts = getattr(self, "starts", None)  # fit() sets them; unfitted: no calibration
        for ranking in start_rankings(None) if starts is None else starts:
            candidates.append(batch_shortlists(ranking, batch, coverage, budgets)[0])
        return best_shortlists(batch, coverage, candidates + list(extra),
                               token_errors(batch, coverage))

    def order(self, batch, coverage, max_budget):
        if batch.terms is None:
            raise RankingError("oracle needs every expert's output (open-loop replay only)")
        if isinstance(coverage, Truncation):
            return greedy_quadratic(truncation_matrix(batch), torch.zeros(
                batch.size, batch.n, dtype=torch.float64, device=batch.device), max_budget)
        return substitution_order(batch, max_budget)


_STARTS: dict[tuple, list[Ranking]] = {}  # the stateless starts per calibration object and
# whether it carried the surrogate's sums then (the token-aware starts need them)


def start_rankings(calibration, stateful: bool = False) -> list[Ranking]:
    """Every registered runtime ranking, fitted on ``calibration`` where it needs one (skipped
    without it, or without examples for a ranking that learns from them): the shortlists the
    oracle must never lose to. Stateless ones are fitted once per calibration object; stateful
    ones (``stateful=True``) fresh, since they keep state (open-loop replay streams them)."""
    key = (Same(calibration), calibration is not None and MOMENTS in calibration.fitted)
    if not stateful and key in _STARTS:
        return _STARTS[key]
    found = []
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        if not cls.runtime or cls.stateful != stateful:
            continue
        if cls.needs_hidden and (
                calibration is None or MOMENTS not in calibration.fitted):
            continue  # token-aware (sketch) without its surrogate: coact-prior's, a start already
        if cls.needs_calibration and calibration is None:
            continue
        try:
            found.append(cls().fit(calibration))
        except RankingError:  # e.g. learned without calibration examples
            continue
    if not stateful:
        _STARTS[key] = found
    return found


def token_errors(batch, coverage):
    """``(keep, idx, w) → ||O*_t − Ô_t||² [T, *E, M]`` for searching: truncation's closed form,
    substitution's Gram expansion (:meth:`policy.batch.RoutingBatch.token_sq_errors`; both
    equal the direct error to rounding)."""
    if isinstance(coverage, Truncation):
        return lambda keep, idx, w: coverage.sq_errors(batch, keep, idx, w)
    return lambda keep, idx, w: batch.token_sq_errors(idx, w)


def errors(batch, coverage, keep: torch.Tensor) -> torch.Tensor:
    """Total ``Σ_t ||O*_t − Ô_t||²`` per shortlist, ``keep [T, *E, N] → [T, *E]``."""
    return token_errors(batch, coverage)(keep, *coverage.apply(batch, keep)).sum(-1)


def local_search(batch, coverage, keep: torch.Tensor, budgets: list[int], max_rounds: int,
                 verify: int = 4) -> torch.Tensor:
    """Swap local search from ``keep [T, B, N]``. Each round, every tree-layer still improving
    *screens* its swaps (one member of S out, one expert outside in), takes the ``verify`` swaps
    screened best, scores them with the exact error and makes the best one if it lowers the exact
    error by more than 1e-12 relative; rounds end when no tree-layer improves or after
    ``max_rounds``. Screening (:func:`screen_swaps`) predicts every swap's error in closed form,
    all b·(N − b) of them, under either policy and every routing rule. Batched over
    tree-layers; only exact errors decide, so the result is never worse than the start."""
    keep = keep.clone()
    floor = batch.terms.floor.sum(-1)  # [T]: every token's routing unchanged
    for j, b in enumerate(budgets):
        if b >= batch.n:
            continue
        current = keep[:, j].clone()  # [T, N]
        err = errors(batch, coverage, current[:, None])[:, 0]
        active = err > floor * (1 + 1e-9) + 1e-300  # at the floor nothing can improve
        for _ in range(max_rounds):
            if not bool(active.any()):
                break
            sub = active.nonzero().squeeze(1)
            part = batch if len(sub) == batch.size else batch.take(sub, outputs=False)
            tries = one_swap_away(part, coverage, current[sub], b, verify)
            found = errors(part, coverage, tries)  # [R, V] exact
            low, at = found.min(-1)
            better = low < err[sub] * (1 - 1e-12) - 1e-300
            if not bool(better.any()):
                break
            won = sub[better]
            current[won] = tries[better, at[better]]
            err[won] = low[better]
            active = torch.zeros_like(active)
            active[won] = True
        keep[:, j] = current
    return keep


def one_swap_away(batch, coverage, current: torch.Tensor, b: int, verify: int) -> torch.Tensor:
    """``[R, V, N]`` shortlists one swap away from ``current [R, N]`` (|S| = b) to score exactly:
    the ``verify`` best by :func:`screen_swaps`."""
    r, n = current.shape
    rows = torch.arange(r, device=current.device)
    predicted = screen_swaps(batch, coverage, current)  # [R, N (out), N (in)]
    legal = current[:, :, None] & ~current[:, None, :]  # m ∈ S, c ∉ S
    flat = predicted.masked_fill(~legal, float("inf")).view(r, -1)
    v = min(verify, b * (n - b))
    pick = flat.topk(v, dim=-1, largest=False).indices  # ties: any, all verified
    out_, in_ = pick // n, pick % n  # [R, V]
    tries = current[:, None, :].repeat(1, out_.shape[1], 1)  # [R, V, N]
    slot = torch.arange(out_.shape[1], device=current.device)[None, :]
    tries[rows[:, None], slot, out_] = False
    tries[rows[:, None], slot, in_] = True
    return tries


def screen_swaps(batch, coverage, current: torch.Tensor) -> torch.Tensor:
    """Predicted total error ``[R, N, N]`` of every swap (member m out, expert c in) of the
    shortlists ``current [R, N]``, in closed form (the Gram expansion, rounding aside).

    * Truncation: with D the experts left out the error is ``F + 2 Σ_{i∈D} l_i + Σ_{i,j∈D} A_ij``
      (``A``: :func:`truncation_matrix`; ``l_i = Σ_t ⟨δ_t, ḡ_i E_i⟩``), so with ``R_x = Σ_{j∈D}
      A_xj`` a swap changes it by ``2(l_m − l_c) + A_mm + A_cc + 2(R_m − R_c) − 2 A_mc``.
    * Substitution: token t's selection P_t (top-k of S) changes only if m ∈ P_t (m's slot goes
      to the better of c and the best expert of S outside P_t) or c outranks P_t's weakest member
      (c takes its slot); each case is one slot replaced, scored in O(1) by the update of
      :func:`substitution_order`, and the m ∈ P_t terms are scattered to m (k per token).
      "Outranks" is the token's substitution order (:meth:`policy.batch.RoutingBatch.by_choice`;
      group-limited rules: its kept groups first), so every routing rule is screened."""
    if isinstance(coverage, Truncation):
        a = truncation_matrix(batch)  # [R, N, N]
        lin = torch.zeros(batch.size, batch.n, dtype=torch.float64, device=batch.device)
        lin.scatter_add_(1, batch.idx.flatten(1), batch.terms.cross.flatten(1))
        out = (~current).double()  # D
        row = torch.einsum("rij,rj->ri", a, out)
        diag = a.diagonal(dim1=-2, dim2=-1)
        total = (torch.einsum("ri,ri->r", out, 2 * lin + row))[:, None, None]
        m_side = (2 * lin + diag + 2 * row)[:, :, None]
        c_side = (-2 * lin + diag - 2 * row)[:, None, :]
        return total + m_side + c_side - 2 * a
    return _substitution_swaps(batch, current)


def _substitution_swaps(batch, current: torch.Tensor) -> torch.Tensor:
    """The substitution case of :func:`screen_swaps`."""
    q, bvec = batch.terms.gram()  # [R, M, N, N], [R, M, N]
    r_sq = batch.terms.routed_sq  # [R, M]
    r, m, n, k = batch.size, batch.probs.shape[1], batch.n, batch.k
    real = batch.mask.double()  # [R, M]
    g = batch.probs.double()
    mixing = batch.rule.mixing
    # rank of every expert per token in substitution's order, ties to the lower id
    by_choice = batch.by_choice()
    rank = torch.empty_like(by_choice).scatter_(
        -1, by_choice, torch.arange(n, device=batch.device).expand_as(by_choice))
    key = rank.masked_fill(~current[:, None, :], 2 * n)  # only S selectable
    top = key.topk(k + 1, dim=-1, largest=False).indices  # [R, M, k+1], best first
    sel, nxt = top[..., :k], top[..., k]  # P_t, and the best of S outside P_t
    gp = g.gather(-1, sel)  # [R, M, k]
    qrows = q.gather(2, sel[..., None].expand(r, m, k, n))  # Q_t[P_a, :]: [R, M, k, N]
    cvec = torch.einsum("rma,rman->rmn", gp, qrows)  # C_x = Σ_a g_Pa Q_x,Pa
    L = (gp * bvec.gather(-1, sel)).sum(-1)
    Z = gp.sum(-1)
    Q = (gp * cvec.gather(-1, sel)).sum(-1)
    diag = q.diagonal(dim1=-2, dim2=-1)  # [R, M, N]

    def error(L2, Q2, Z2, r2):
        a = mixing.coefficient(Z2)
        return r2 - 2 * a * L2 + a * a * Q2

    def replaced(a_g, a_b, a_c, a_d, x_g, x_b, x_c, x_d, q_xa, lead):
        """Error after member a (its g, b, C, Q_aa) is replaced by x (the same, and Q_xa)."""
        L2 = L.view(lead) - a_g * a_b + x_g * x_b
        Q2 = (Q.view(lead) - 2 * a_g * a_c + a_g * a_g * a_d
              + 2 * x_g * (x_c - a_g * q_xa) + x_g * x_g * x_d)
        return error(L2, Q2, Z.view(lead) - a_g + x_g, r_sq.view(lead))

    now = error(L, Q, Z, r_sq)  # [R, M]
    # case A, m ∉ P_t: c replaces the weakest member w if c outranks it
    w = sel[..., k - 1]
    wg, wb, wc, wd = (x.gather(-1, w[..., None]) for x in (g, bvec, cvec, diag))  # [R, M, 1]
    q_cw = q.gather(2, w[..., None, None].expand(r, m, 1, n))[:, :, 0]  # Q_t[w, :]: [R, M, N]
    into_w = replaced(wg, wb, wc, wd, g, bvec, cvec, diag, q_cw, (r, m, 1))
    beats_w = rank < rank.gather(-1, w[..., None])
    case_a = torch.where(beats_w, into_w, now[..., None]) * real[..., None]  # [R, M, N]
    # case B, m = P_a: P_a's slot goes to c if c outranks nxt, else to nxt
    lead = (r, m, 1, 1)
    a_g, a_b, a_c, a_d = (x[..., None] for x in (gp, bvec.gather(-1, sel), cvec.gather(-1, sel),
                                                 diag.gather(-1, sel)))  # [R, M, k, 1]
    with_c = replaced(a_g, a_b, a_c, a_d, g[:, :, None], bvec[:, :, None], cvec[:, :, None],
                      diag[:, :, None], qrows, lead)  # [R, M, k, N]
    ng, nb, nc, nd = (x.gather(-1, nxt[..., None])[..., None] for x in (g, bvec, cvec, diag))
    q_na = qrows.gather(-1, nxt[:, :, None, None].expand(r, m, k, 1))  # [R, M, k, 1]
    with_next = replaced(a_g, a_b, a_c, a_d, ng, nb, nc, nd, q_na, lead)  # [R, M, k, 1]
    lone = key.gather(-1, nxt[..., None]) >= 2 * n  # |S| = k: nothing of S outside P_t
    beats_next = ((rank < rank.gather(-1, nxt[..., None])) | lone)[:, :, None, :]  # [R, M, 1, N]
    case_b = torch.where(beats_next, with_c, with_next) * real[..., None, None]
    correction = (case_b - case_a[:, :, None, :]).reshape(r, m * k, n)
    total = case_a.sum(1)[:, None, :].repeat(1, n, 1)  # [R, N (m), N (c)]
    return total.scatter_add_(1, sel.reshape(r, m * k, 1).expand(r, m * k, n), correction)


def truncation_matrix(batch) -> torch.Tensor:
    """``A [T, N, N]``: ``A_ij = Σ_t ⟨ḡ_i E_i(h_t), ḡ_j E_j(h_t)⟩`` over tokens whose top-k holds
    both (k² dot products per token, scattered)."""
    return pair_sums(batch.idx, batch.terms.natural, batch.n)


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[t, m, index[t, m]]`` for ``x [T, M, N]``, ``index [T, M]`` → ``[T, M]``."""
    return x.gather(-1, index[..., None])[..., 0]


def _column(q: torch.Tensor, index: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``Q_t[:, index_t]`` of the tree-layers ``live [R]`` for ``q [T, M, N, N]``, ``index
    [R, M]`` → ``[R, M, N]`` (Q is symmetric, so its contiguous row is read; q is never copied)."""
    _, m, n, _ = q.shape
    token = live[:, None] * m + torch.arange(m, device=q.device)  # [R, M] rows of [T·M]
    return q.reshape(-1, n).index_select(0, (token * n + index).reshape(-1)).view(-1, m, n)


def substitution_order(batch, max_budget) -> torch.Tensor:
    """The incremental greedy of the module docstring (every routing rule: "c beats m" in the
    token's substitution order, group-limited rules' kept groups first)."""
    rule = batch.rule
    q, b = batch.terms.gram()  # [T, M, N, N], [T, M, N]
    r_sq = batch.terms.routed_sq  # [T, M]
    t, m, n, k = batch.size, batch.probs.shape[1], batch.n, batch.k
    dev = batch.device
    choice = rule.substitution_scores(batch.probs)  # selection scores (biased if any;
    # group-limited: float64, the experts outside a token's kept groups a fixed tier below)
    g = batch.probs.double()
    diag = q.diagonal(dim1=-2, dim2=-1)
    real = batch.mask

    mixing = rule.mixing

    def error(r, L, Q, Z):
        """``||R*||² − 2 a L + a² Q`` with a = a(Z) the rule's mixing coefficient
        (:meth:`policy.routing.Mixing.coefficient`)."""
        a = mixing.coefficient(Z)
        return r - 2 * a * L + a * a * Q

    live = torch.arange(t, device=dev)  # tree-layers still ordered (the others are filled)
    count = torch.zeros(t, m, dtype=torch.long, device=dev)
    sel = torch.zeros(t, m, k, dtype=torch.long, device=dev)  # slots; valid below count
    L = torch.zeros(t, m, dtype=torch.float64, device=dev)
    Q = torch.zeros_like(L)
    Z = torch.zeros_like(L)
    C = torch.zeros(t, m, n, dtype=torch.float64, device=dev)
    keep = torch.zeros(t, n, dtype=torch.bool, device=dev)
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
        going = changes.flatten(1).any(-1)  # [R]: a tree-layer some candidate still changes
        if not bool(going.all()):  # the others' candidates all tie, now and at every later
            # step (adding an expert that changes no token changes no later choice): the rest
            # of their order by expert id, and they leave the loop
            done = ~going
            rest = torch.argsort(keep[done].long() * n + torch.arange(n, device=dev), -1)
            order[live[done], s:] = rest[:, : steps - s]
            if not bool(going.any()):
                break
            live, changes, full, mi, weakest = (x[going] for x in (live, changes, full, mi,
                                                                   weakest))
            g, b, choice, diag, r_sq, real, L, Q, Z, C, keep, sel, count = (
                x[going] for x in (g, b, choice, diag, r_sq, real, L, Q, Z, C, keep, sel, count))
        gm = (_at(g, mi) * full)[..., None]  # 0 where c joins instead of replacing
        q_cm = _column(q, mi, live)  # Q_t[c, m] for every candidate c
        L2 = L[..., None] - gm * _at(b, mi)[..., None] + g * b
        Q2 = (Q[..., None] - 2 * gm * _at(C, mi)[..., None] + gm * gm * _at(diag, mi)[..., None]
              + 2 * g * (C - gm * q_cm) + g * g * diag)
        Z2 = Z[..., None] - gm + g
        err = torch.where(changes, error(r_sq[..., None], L2, Q2, Z2),
                          error(r_sq, L, Q, Z)[..., None])
        total = err.sum(1).masked_fill(keep, float("inf"))  # [T, N]
        c = total.argmin(-1)
        order[live, s] = c
        cc = c[:, None].expand(len(live), m)
        changed = _at(changes, cc)  # [T, M]
        L = torch.where(changed, _at(L2, cc), L)
        Q = torch.where(changed, _at(Q2, cc), Q)
        Z = torch.where(changed, _at(Z2, cc), Z)
        delta = _at(g, cc)[..., None] * _column(q, cc, live) - gm * q_cm
        C = C + changed[..., None] * delta
        slot = torch.where(full, weakest, count.clamp_max(k - 1))
        sel = torch.where(changed[..., None] & (slots == slot[..., None]), cc[..., None], sel)
        count = count + (changed & ~full)
        keep[torch.arange(len(live), device=dev), c] = True
    return order
