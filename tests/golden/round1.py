"""The round-1 replay, frozen: one (tree, layer) at a time, the golden reference for the engine.

This is the per-tree-layer implementation that landed in round 1 (``replay/open_loop.py``,
``replay/budget.py``, ``replay/coact.py``, ``replay/rankings.py`` and the row builder of
``replay/run.py`` at commit ccc5ef7), kept verbatim in logic and only consolidated into one
module. Tests feed it the same expert outputs as the engine and require equal results; it must
never import project code, so that a change to the engine can never change the reference.
"""

from __future__ import annotations

import itertools
import math

import torch

EXACT_LIMIT = 5000


def prefix_masks(order, budgets: list[int], n: int) -> torch.Tensor:
    order = torch.as_tensor(order, dtype=torch.long)
    rank = torch.full((n,), n, dtype=torch.long)
    rank[order] = torch.arange(len(order))
    return rank[None] < torch.as_tensor(budgets)[:, None]


def substitute(probs, keep, k, renormalize):
    masked = probs.masked_fill(~keep, float("-inf"))
    weights, idx = masked.topk(k, dim=-1)
    weights = weights.clamp_min(0)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return idx, weights


def greedy_quadratic(m, tie, max_budget):
    m = m.double()
    n = m.shape[0]
    left = torch.ones(n, dtype=torch.bool)
    row = m.sum(1)
    order = []
    for _ in range(min(max_budget, n)):
        gain = 2 * row - m.diagonal() + tie
        gain[~left] = float("-inf")
        c = int(torch.argmax(gain))
        order.append(c)
        left[c] = False
        row -= m[:, c]
    return order


def coact_order(dense_weights, gram, router_mass, max_budget):
    a = dense_weights.T.double() @ dense_weights.double()
    tie = router_mass.double() / router_mass.double().sum().clamp_min(1e-30) * 1e-12
    return greedy_quadratic(a * gram.double(), tie, max_budget)


class TreeLayer:
    def __init__(self, probs, idx, weights, experts, renormalize):
        self.probs, self.idx, self.weights, self.experts = probs, idx, weights, experts
        self.renormalize = renormalize
        self.gold = combine(experts, idx, weights)
        e = experts.double()
        self.q = torch.einsum("mnh,mph->mnp", e, e)
        self.b = torch.einsum("mnh,mh->mn", e, self.gold.double())
        self.gold_sq = self.gold.double().pow(2).sum(-1)
        self.k, self.n = idx.shape[-1], probs.shape[-1]


def combine(experts, idx, weights):
    lead = idx.shape[:-2]
    e = experts.expand(*lead, *experts.shape)
    picked = e.gather(-2, idx[..., None].expand(*idx.shape, experts.shape[-1]))
    return (picked * weights[..., None].to(experts.dtype)).sum(-2)


def policy(tl, keep, coverage):
    lead = keep.shape[:-1]
    if coverage == "truncation":
        w = tl.weights * keep[..., tl.idx].to(tl.weights.dtype)
        return tl.idx.expand(*lead, *tl.idx.shape), w
    return substitute(tl.probs, keep[..., None, :], tl.k, tl.renormalize)


def token_sq_errors(tl, idx, w):
    w = w.double()
    lead = idx.shape[:-2]
    b = tl.b.expand(*lead, *tl.b.shape).gather(-1, idx)
    q = tl.q.expand(*lead, *tl.q.shape)
    rows = q.gather(-2, idx[..., None].expand(*idx.shape, tl.n))
    qq = rows.gather(-1, idx[..., None, :].expand(*idx.shape, idx.shape[-1]))
    err = tl.gold_sq - 2 * (w * b).sum(-1) + torch.einsum("...j,...jl,...l->...", w, qq, w)
    return err.clamp_min(0)


def metrics(tl, keep, coverage):
    idx, w = policy(tl, keep, coverage)
    sq = token_sq_errors(tl, idx, w)
    rse = sq.sum(-1) / tl.gold_sq.sum().clamp_min(1e-30)
    token = (sq.sqrt() / tl.gold_sq.sqrt().clamp_min(1e-30)).mean(-1)
    s = tl.probs.sum(0)
    excluded = (s * ~keep).sum(-1) / s.sum()
    used = torch.zeros(*keep.shape, dtype=torch.bool)
    used.scatter_(-1, idx.flatten(-2), (w != 0).flatten(-2))
    return dict(rse=rse, token_error=token, mass_excluded=excluded, experts_loaded=used.sum(-1))


def oracle_order(tl, coverage, max_budget):
    if coverage == "truncation":
        w = torch.zeros(tl.probs.shape, dtype=torch.float64).scatter(1, tl.idx, tl.weights.double())
        a = torch.einsum("mi,mj,mij->ij", w, w, tl.q)
        return greedy_quadratic(a, torch.zeros(tl.n, dtype=torch.float64), max_budget)
    keep = torch.zeros(tl.n, dtype=torch.bool)
    eye = torch.eye(tl.n, dtype=torch.bool)
    order = []
    for _ in range(min(max_budget, tl.n)):
        idx, w = policy(tl, keep[None] | eye, coverage)
        err = token_sq_errors(tl, idx, w).sum(-1)
        err[keep] = float("inf")
        best = int(torch.argmin(err))
        order.append(best)
        keep[best] = True
    return order


def exact_best(tl, coverage, budget):
    if math.comb(tl.n, budget) > EXACT_LIMIT:
        return None
    subsets = torch.tensor(list(itertools.combinations(range(tl.n), budget)))
    keep = torch.zeros(len(subsets), tl.n, dtype=torch.bool)
    keep.scatter_(1, subsets, True)
    best, best_err = None, float("inf")
    for chunk in keep.split(512):
        idx, w = policy(tl, chunk, coverage)
        err = token_sq_errors(tl, idx, w).sum(-1)
        i = int(torch.argmin(err))
        if float(err[i]) < best_err:
            best, best_err = chunk[i], float(err[i])
    return best


def rows(probs, idx, weights, experts, renormalize, rankings, coverages, budgets,
         selection_counts=None, mean_gram=None) -> list[dict]:
    """Every ranking × coverage × budget of one (tree, layer): dicts with ranking, coverage,
    budget, rse, token_error, mass_excluded, experts_loaded (round 1's open_loop_rows)."""
    tl = TreeLayer(probs, idx, weights, experts, renormalize)
    out = []
    for ranking in rankings:
        for coverage in coverages:
            bs = list(budgets)
            if ranking == "router":
                order = torch.argsort(probs.sum(0), descending=True, stable=True)
                masks, valid = prefix_masks(order, bs, tl.n), bs
            elif ranking == "static":
                order = torch.argsort(selection_counts, descending=True, stable=True)
                masks, valid = prefix_masks(order, bs, tl.n), bs
            elif ranking == "coact":
                dense = torch.zeros(idx.shape[0], tl.n).scatter(1, idx, weights.float())
                order = coact_order(dense, mean_gram, probs.sum(0), tl.n)
                masks, valid = prefix_masks(order, bs, tl.n), bs
            elif ranking == "oracle":
                masks, valid = prefix_masks(oracle_order(tl, coverage, max(bs)), bs, tl.n), bs
            else:
                found = [(b, exact_best(tl, coverage, b)) for b in bs]
                found = [(b, m) for b, m in found if m is not None]
                if not found:
                    continue
                valid, masks = [b for b, _ in found], torch.stack([m for _, m in found])
            if coverage == "substitution":
                ok = [i for i, b in enumerate(valid) if b >= tl.k]
                valid, masks = [valid[i] for i in ok], masks[ok]
                if not valid:
                    continue
            m = metrics(tl, masks, coverage)
            for i, b in enumerate(valid):
                out.append(dict(ranking=ranking, coverage=coverage, budget=b,
                                rse=float(m["rse"][i]), token_error=float(m["token_error"][i]),
                                mass_excluded=float(m["mass_excluded"][i]),
                                experts_loaded=int(m["experts_loaded"][i])))
    return out
