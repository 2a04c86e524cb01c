"""Budgets that adapt per tree-layer within a verification pass, at a mean budget B̄ (issue 63).

A verification pass runs its tree through the L MoE layers in order. A fixed budget loads B
experts at every layer; an adaptive one gives tree-layer l its own ``B_l ∈ [B_min, B_max]``
such that the mean over tree-layers is B̄ (the bytes of a memory-bound pass are the total, not
each layer's share). Per tree-layer the ranking has a shortlist at every B (for most rankings
the prefixes of one order: B + 1 adds its next expert), with error curve ``e_l(B)`` (RSE) and
marginal gain

    Δ_l(B) = e_l(B) − e_l(B + 1)        the error loading the (B+1)-th expert removes

Curves are tensors ``[..., L, S + 1]`` over ``B = B_min .. B_max`` (``S = B_max − B_min``),
gains ``[..., L, S]``; leading dimensions are passes.

**Price rule** (runtime): layer l, before its experts load and without looking at later layers,
keeps loading the ranking's next expert while its *predicted* gain exceeds a price λ:

    B_l = B_min + #{leading j : Δ̂_l(B_min + j) > λ}

with an optional hard cap C on a pass's total: ``B_l ← min(B_l, C − Σ_{m<l} B_m − B_min·(L−1−l))``
(the layers still to come keep B_min). λ is calibrated offline (:func:`calibrate_price`) on
calibration passes so that the mean B over their tree-layers is B̄; on other prompts the mean is
B̄ only in expectation, so the achieved mean is measured, never assumed.

**Pacing** (optional, runtime): λ meets B̄ only in expectation over prompts like the
calibration's; a prompt that asks for more experts than they did overspends for all its passes.
A paced rule keeps a running deficit per stream (a prompt; a batch's passes at b > 1), over its
tree-layers in pass order, layers in order within a pass,

    D_t = Σ_{s ≤ t} (B_s − B̄)        λ_t = λ · exp(η · D_{t−1} / B̄)       (D_0 = 0)

and prices tree-layer t at λ_t (:func:`paced_price`): every B̄ overspent multiplies the price
by e^η, every B̄ underspent divides it. Runtime-legal (only budgets already chosen), restarted
with the stream, as a stateful ranking is. An integral controller: where the rule can move the
mean, D_t stays bounded, so the stream's mean B is B̄ + O(1/t) whatever its prompts ask; the
layers and passes of a stream still compete for its experts by their predicted gains. A price
λ ≤ 0 (B̄ near N: every gain loads) is left unpaced. :class:`policy.prices.Prices` applies it
(``pace``), batched over streams.

How close, over T tree-layers: where the stream's prompts need a price λ* ≠ λ to spend B̄, the
deficit settles where λ_t = λ*, at ``D* = (B̄/η)·ln(λ*/λ)``, so the stream's mean B misses B̄ by
``D*/T``, a share ``ln(λ*/λ)/(η·T)``: an integral controller leaves its integral, not its
rate, off target. Paced per prompt (a stream restarted with each), T is one prompt's
tree-layers (tens: a few passes × L) and a miscalibrated λ leaves every prompt a few percent
off in the same direction. Paced **over the run** (``pace_over="run"``, budget mode
``+pace-run``), the deficit is carried from prompt to prompt in the order they are served, as
a server's spend would be, so T is the run's tree-layers and the miss shrinks with the run;
the run's prompts also keep competing for its experts. What a prompt gets then depends on the
prompts served before it, in a stated order (replay: the run's prompt order). Capture paces per
prompt only (a resumed or sharded capture would restart the run's deficit part way).

Predicted gains Δ̂ (:data:`PREDICTORS`) use runtime-legal quantities only: the router's mass
excluded by the ranking's shortlist at each B, ``m(B) = Σ_{i∉S_B} s_i / Σ_i s_i`` (known once
the router has run, before any expert loads), and, for ``calibrated``, per-layer ratios learned
on the calibration run; ``surrogate`` reads the sketch family's own predicted error curve
``ê(B) = Σ_t ||Ô_t − Ô_t(S_B)||² / Σ_t ||Ô_t||²`` on predicted outputs ``Ê_i(h_t)`` (replay's
``predicted_rse``). Each predictor declares which of these it reads (:attr:`Predictor.reads`).

**B_min.** 1 under truncation, k under substitution (:func:`policy.index.min_budget`, the rule
replay and the online budget share). The substitution code itself is honest below k: with
|S| = B < k every token runs its best B experts of S in the family's selection order, weighted as
the model weights (renormalised over them where it renormalises;
:meth:`policy.coverage.Substitution.apply`, ``tests/test_adaptive_predictors.py``), so an
adaptive budget could give a layer B < k there; but replay stores no substitution result below
k, so the study keeps B_min = k and at B̄ = k substitution's adaptive equals fixed by
construction (every layer at k).

**Adaptive oracle** (hindsight over the pass, true gains): start every layer at B_min and hand
out the pass's ``T − L·B_min`` further experts (T = B̄·L) one at a time, each to the layer whose
next expert has the largest true gain (:func:`hindsight_budgets`). This marginal allocation
(Gross 1956; Fox 1966) minimises ``Σ_l e_l(B_l)`` subject to ``Σ_l B_l = T`` exactly when every
curve is convex (Δ_l non-increasing in B: diminishing returns): then the greedy takes the T − L·B_min
largest gains of all layers, and any allocation's gain is a sum of as many gains, each layer's
a prefix of its own. With non-convex curves it is a heuristic (a gain hidden behind a smaller
one is never reached: under truncation an expert no tree token selected gains 0 and the next
one more, so replayed curves are rarely convex), and the adaptive oracle is the exact
minimum instead (:func:`best_budgets`: dynamic programming over the pass's layers, the
multiple-choice knapsack, ``O(L·S·T)`` per pass).

Torch only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Mapping

import torch

MASS, PREDICTED = "mass_excluded", "predicted_rse"  # replay metrics the predictors read


def gains_of(curves: torch.Tensor) -> torch.Tensor:
    """``Δ [..., L, S]`` of error curves ``e [..., L, S + 1]``: ``e(B) − e(B + 1)``."""
    return curves[..., :-1] - curves[..., 1:]


def convex_hull(curves: torch.Tensor) -> torch.Tensor:
    """The lower convex envelope ``ĕ [..., W]`` of curves ``e [..., W]`` over equally spaced B:
    in one dimension the envelope at B is the least interpolation between two points around it,

        ĕ(B) = min_{a ≤ B ≤ c} ( e(a)·(c − B) + e(c)·(B − a) ) / (c − a)     (e(B) where a = c)

    so its gains are non-increasing, and the price rule on them loads up to
    ``argmin_B ĕ(B) + λ·B = argmin_B e(B) + λ·B`` (a plateau is crossed where a later drop pays
    for it; the leading run of the raw gains stops at the plateau)."""
    e = curves.double()
    w = e.shape[-1]
    x = torch.arange(w, dtype=torch.float64, device=e.device)
    best = e.clone()
    for a in range(w - 1):  # left ends; right ends c > a, every B in between at once
        c = x[a + 1:]  # [C]
        span = c - a
        b = x[:, None]  # [W, 1]
        inside = (b >= a) & (b <= c)  # [W, C]
        line = (e[..., a, None, None] * (c - b) + e[..., None, a + 1:] * (b - a)) / span
        best = torch.minimum(best, line.masked_fill(~inside, float("inf")).amin(-1))
    return best


def price_budgets(gains: torch.Tensor, price: float, b_min: int,
                  cap: int | None = None) -> torch.Tensor:
    """``B_l [..., L]`` (long) of the price rule for predicted gains ``[..., L, S]``: each layer
    loads its next expert while the predicted gain exceeds ``price``, layers in order, under a
    hard cap ``cap`` on each pass's total where given (later layers keep ``b_min``)."""
    budgets = b_min + leading_run(gains, price)
    if cap is None:
        return budgets
    layers = budgets.shape[-1]
    if cap < b_min * layers:
        raise ValueError(f"a pass cap of {cap} experts is below B_min·L = {b_min * layers}")
    out = torch.empty_like(budgets)
    used = torch.zeros_like(budgets[..., 0])
    for layer in range(layers):  # in order: no layer knows what later ones will ask
        room = cap_room(cap, used, b_min, layers - 1 - layer)
        out[..., layer] = torch.minimum(budgets[..., layer], room)
        used = used + out[..., layer]
    return out


def leading_run(gains: torch.Tensor, price) -> torch.Tensor:
    """``#{leading j : Δ̂(B_min + j) > λ}`` of gains ``[..., S]`` at a price broadcast to
    ``[...]`` (long): how many experts above B_min the price rule loads."""
    price = torch.as_tensor(price, dtype=gains.dtype, device=gains.device)
    return (gains > price[..., None]).long().cumprod(-1).sum(-1)


def paced_price(price, pace: float, deficit: torch.Tensor, mean) -> torch.Tensor:
    """``λ_t = λ · exp(η · D / B̄)`` (module docstring, pacing) for running deficits ``D`` of
    experts over B̄ (tensors broadcasting with ``price`` and ``mean``); λ ≤ 0 stays as it is.
    The exponent is clipped to ±50 (a price already 10^21 times its base loads nothing more)."""
    price = torch.as_tensor(price, dtype=torch.float64, device=deficit.device)
    mean = torch.as_tensor(mean, dtype=torch.float64, device=deficit.device)
    step = torch.exp((pace * deficit.double() / mean).clamp(-50.0, 50.0))
    return torch.where(price > 0, price * step, price)


def cap_room(cap, used, b_min: int, later: int):
    """What a layer may still load under a pass cap C: ``C − Σ_{m<l} B_m − B_min·later``, the
    ``later`` layers still to come keeping B_min (tensors or numbers)."""
    return cap - used - b_min * later


def calibrate_price(gains: torch.Tensor, target: float, b_min: int,
                    cap: int | None = None) -> float:
    """The price λ whose :func:`price_budgets` on calibration gains ``[..., L, S]`` give a mean B
    over all tree-layers closest to ``target`` (B̄; ties to the higher price, the cheaper). The
    mean is a non-increasing step function of λ that changes only at the gains' own values, so
    the bisection runs over those (and −∞: every layer at B_max)."""
    values = torch.unique(gains.double().flatten())
    candidates = torch.cat([torch.tensor([float("-inf")], dtype=torch.float64), values])

    def mean(i: int) -> float:
        return float(price_budgets(gains, float(candidates[i]), b_min, cap).double().mean())

    lo, hi = 0, len(candidates) - 1  # mean(lo) is the largest, mean(hi) the smallest
    if mean(hi) >= target:
        return float(candidates[hi])
    if mean(lo) <= target:
        return float(candidates[lo])
    while hi - lo > 1:  # invariant: mean(lo) > target ≥ mean(hi)
        mid = (lo + hi) // 2
        if mean(mid) > target:
            lo = mid
        else:
            hi = mid
    closer = hi if abs(mean(hi) - target) <= abs(mean(lo) - target) else lo
    return float(candidates[closer])


def hindsight_budgets(gains: torch.Tensor, total: int, b_min: int) -> torch.Tensor:
    """``B_l [..., L]`` of the adaptive oracle: every layer at ``b_min``, then each of the pass's
    ``total − L·b_min`` further experts to the layer whose next one has the largest true gain
    (ties to the earlier layer); ``total`` is clamped to ``[L·b_min, L·B_max]``. Exact for convex
    curves (module docstring)."""
    *lead, layers, steps = gains.shape
    flat = gains.reshape(-1, layers, steps).double()
    extra = min(max(total - layers * b_min, 0), layers * steps)
    taken = torch.zeros(flat.shape[:2], dtype=torch.long, device=gains.device)
    padded = torch.cat([flat, torch.full_like(flat[..., :1], float("-inf"))], -1)
    rows = torch.arange(flat.shape[0], device=gains.device)
    for _ in range(extra):
        nxt = padded.gather(-1, taken[..., None])[..., 0]  # [P, L]: each layer's next gain
        best = nxt.argmax(-1)
        taken[rows, best] += 1
    return (b_min + taken).reshape(*lead, layers)


def best_budgets(curves: torch.Tensor, total: int, b_min: int) -> torch.Tensor:
    """``B_l [..., L]`` minimising ``Σ_l e_l(B_l)`` subject to ``Σ_l B_l = total`` (clamped to
    ``[L·b_min, L·B_max]``) for any curves ``[..., L, S + 1]``, exactly: after layer l,
    ``cost_l(t) = min_j cost_{l−1}(t − j) + e_l(b_min + j)`` over the ``t`` experts above B_min
    spent so far, then back from ``t = total − L·b_min`` (ties to the smaller B at the later
    layer)."""
    *lead, layers, width = curves.shape
    flat = curves.reshape(-1, layers, width).double()
    passes = flat.shape[0]
    extra = min(max(total - layers * b_min, 0), layers * (width - 1))
    cost = torch.full((passes, extra + 1), float("inf"), dtype=torch.float64,
                      device=curves.device)
    cost[:, 0] = 0.0
    choice = torch.zeros(layers, passes, extra + 1, dtype=torch.long, device=curves.device)
    for layer in range(layers):
        new = torch.full_like(cost, float("inf"))
        for j in range(min(width, extra + 1)):
            cand = cost[:, : extra + 1 - j] + flat[:, layer, j, None]
            better = cand < new[:, j:]
            new[:, j:] = torch.where(better, cand, new[:, j:])
            choice[layer, :, j:] = torch.where(better, j, choice[layer, :, j:])
        cost = new
    spent = torch.full((passes,), extra, dtype=torch.long, device=curves.device)
    out = torch.empty(passes, layers, dtype=torch.long, device=curves.device)
    for layer in reversed(range(layers)):
        j = choice[layer].gather(1, spent[:, None])[:, 0]
        out[:, layer] = b_min + j
        spent = spent - j
    return out.reshape(*lead, layers)


def errors_at(curves: torch.Tensor, budgets: torch.Tensor, b_min: int) -> torch.Tensor:
    """``e_l(B_l) [..., L]``: each tree-layer's error at its budget, from ``curves [..., L, S+1]``
    over ``B = b_min ..``."""
    return curves.gather(-1, (budgets - b_min)[..., None].long())[..., 0]


Inputs = torch.Tensor | Mapping[str, torch.Tensor]  # a predictor's curves by metric name


def predicted_errors(batch, keep: torch.Tensor, coverage, surrogate_ranked: torch.Tensor,
                     predict) -> torch.Tensor:
    """``ê [T, B]`` (float64; NaN where no surrogate ranked the tree-layer): the error a
    ranking's surrogate predicts for its own shortlists ``keep [T, B, N]`` before any expert
    loads,

        ê = Σ_t ||Ô_t − Ô_t(S)||² / Σ_t ||Ô_t||²,   Ô_t = Σ_{i∈T_k(t)} g_i(t) Ê_i(h_t)

    with ``Ô_t(S)`` the ``coverage`` policy's output over S (the same indices and weights rule
    as RSE) on the predicted outputs ``Ê_i(h_t)`` that ``predict(batch, rows)`` attaches as the
    rows' expert terms (:meth:`policy.rankings.sketch.Sketch.predicted`: each expert's residual
    energy is a private direction, so ê is the error expected with uncorrelated residuals);
    ``surrogate_ranked [T]``: where the ranking searched on its surrogate. Replay stores it as
    ``predicted_rse``; :class:`SurrogateGain` prices budgets by it."""
    out = torch.full(keep.shape[:2], float("nan"), dtype=torch.float64, device=keep.device)
    rows = surrogate_ranked.to(keep.device).nonzero().flatten()
    if predict is None or len(rows) == 0:
        return out
    for part_rows in rows.split(64):
        part = predict(batch, part_rows)
        shortlist = keep[part_rows].to(part.device)
        idx, w = coverage.apply(part, shortlist)
        sq = coverage.sq_errors(part, shortlist, idx, w)  # [R, B, M]
        gold = part.terms.gold_sq[:, None, :].double().sum(-1)
        out[part_rows] = (sq.sum(-1) / gold.clamp_min(1e-30)).to(out.device)
    return out


class Predictor(ABC):
    """Predicted gains ``Δ̂ [P, L, S]`` from runtime-legal curves ``[P, L, S + 1]`` over the
    ranking's shortlists at ``B = B_min .. B_max`` (``layers [L]``: the MoE layer of each
    column). Each predictor declares what it reads (:attr:`reads`: replay's open-loop metric
    names, e.g. ``mass_excluded``, the router mass a shortlist leaves out, or ``predicted_rse``,
    the error a surrogate predicts for it) and takes them as a mapping by those names; callers
    hand over what :attr:`reads` names, never branch on the predictor. A bare tensor stands for
    ``{"mass_excluded": tensor}``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = (MASS,)

    def inputs(self, given: Inputs) -> dict[str, torch.Tensor]:
        """``given`` as a mapping holding every name of :attr:`reads` (one clear error if not)."""
        found = {MASS: given} if isinstance(given, torch.Tensor) else dict(given)
        missing = [r for r in self.reads if r not in found]
        if missing:
            raise ValueError(f"gain predictor {self.name} reads {', '.join(missing)}; "
                             "replay the ranking with that metric")
        return found

    def fit(self, inputs: Inputs, errors: torch.Tensor, layers: torch.Tensor) -> Predictor:
        """Learn from calibration passes: their :attr:`reads` curves and true ``errors``, all
        ``[P, L, S + 1]``."""
        return self

    @abstractmethod
    def gains(self, inputs: Inputs, layers: torch.Tensor) -> torch.Tensor:
        ...


class MassGain(Predictor):
    name = "mass"
    summary = "router mass share of the ranking's next expert: Δ̂(B) = m(B) − m(B+1)"

    def gains(self, inputs, layers):
        return gains_of(self.inputs(inputs)[MASS].double())


class CalibratedMass(Predictor):
    """``ê_l(B) = r_l(B) · m(B)`` with ``r_l(B) = Σ_cal e / Σ_cal m`` over the calibration's
    tree-layers of MoE layer l at budget B (0 where the calibration excluded no mass), made
    non-increasing in B (running minimum: loading more never predicts more error)."""

    name = "calibrated"
    summary = ("mass excluded scaled to error per layer and budget on the calibration run: "
               "Δ̂(B) = ê(B) − ê(B+1), ê = r_l(B)·m(B)")
    ratio: dict[int, torch.Tensor]

    def fit(self, inputs, errors, layers):
        m = self.inputs(inputs)[MASS].double().sum(0)  # [L, S+1]
        e = errors.double().sum(0)
        r = torch.where(m > 0, e / m.clamp_min(1e-300), torch.zeros_like(m))
        self.ratio = {int(layer): r[j] for j, layer in enumerate(layers.tolist())}
        return self

    def curve(self, inputs, layers) -> torch.Tensor:
        """``ê [P, L, S + 1]``, non-increasing in B."""
        missing = sorted(set(layers.tolist()) - set(self.ratio))
        if missing:
            raise ValueError(f"the calibration has no tree-layer of layer(s) {missing}")
        r = torch.stack([self.ratio[int(layer)] for layer in layers.tolist()])
        return torch.cummin(r * self.inputs(inputs)[MASS].double(), -1).values

    def gains(self, inputs, layers):
        return gains_of(self.curve(inputs, layers))


class SurrogateGain(Predictor):
    """The surrogate's own error curve: ``ê(B)`` of replay's ``predicted_rse`` (the RSE of the
    ranking's shortlist at B computed on the sketch family's predicted outputs ``Ê_i(h_t)``,
    replay/open_loop.py), made non-increasing in B (running minimum); its gains are those of its
    lower convex hull (:func:`convex_hull`), so the price rule gives each layer
    ``argmin_B ê(B) + λ·B``: the whole predicted curve is known before the layer's experts load,
    and a plateau (the sketch's shortlists are searched per B, not nested) does not stop it.
    Runtime-legal: the surrogate predicts from the tree tokens' MoE inputs before any expert
    loads. A tree-layer the surrogate did not rank (``predicted_rse`` null, NaN here: sketch-
    gated's gate out, no surrogate) gets :class:`CalibratedMass`'s curve, fitted on the same
    calibration, so both speak RSE and one price serves the pass."""

    name = "surrogate"
    summary = ("the sketch family's predicted RSE of the ranking's own shortlists, Δ̂ = the "
               "gains of its lower convex hull; calibrated mass where no surrogate ran")
    reads = (PREDICTED, MASS)

    def fit(self, inputs, errors, layers):
        self.fallback = CalibratedMass().fit(self.inputs(inputs), errors, layers)
        return self

    def curve(self, inputs, layers) -> torch.Tensor:
        found = self.inputs(inputs)
        predicted = found[PREDICTED].double()
        missing = torch.isnan(predicted).any(-1, keepdim=True)  # [P, L, 1]: not ranked by it
        mine = torch.cummin(torch.nan_to_num(predicted, nan=0.0), -1).values
        if not bool(missing.any()):
            return mine
        return torch.where(missing, self.fallback.curve(found, layers), mine)

    def gains(self, inputs, layers):
        return gains_of(convex_hull(self.curve(inputs, layers)))


PREDICTORS: dict[str, type[Predictor]] = {p.name: p for p in (MassGain, CalibratedMass,
                                                              SurrogateGain)}


def predictor(name: str) -> Predictor:
    try:
        return PREDICTORS[name]()
    except KeyError:
        raise ValueError(f"unknown gain predictor {name!r}; use one of "
                         f"{', '.join(PREDICTORS)}") from None
