"""Adaptive budgets' price rule in the product (issue 63): what it reads at run time and how
its price λ is calibrated.

Per tree-layer a ranking gives shortlists ``S_B`` at every ``B = B_min .. B_max``; the router mass
each excludes, ``m(B) = Σ_{i∉S_B} s_i / Σ_i s_i`` (known once the router has run, before any
expert loads), feeds a gain predictor (:data:`policy.adaptive.PREDICTORS`), and the price rule
(:func:`policy.adaptive.price_budgets`) picks the layer's ``B_l``. :class:`Prices` holds one
ranking × coverage's calibrated rule and applies it to a batch of tree-layers (open-loop replay)
or to one layer at a time (:class:`policy.budget.AdaptiveBudget`: closed loop and capture's
online budget). :func:`calibrate_all` is the calibration step (:func:`policy.calibration.calibrate`
calls it): on the calibration run's tree-layers, each mean budget B̄'s λ such that the rule's
mean B there is B̄ (:func:`policy.adaptive.calibrate_price`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import numpy as np
import torch

from moe_spec.policy import adaptive, index
from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.calibration import CalibrationError, CalibrationStats, ExpertModel
from moe_spec.policy.coverage import Coverage


def excluded_mass(batch: RoutingBatch, keep: torch.Tensor) -> torch.Tensor:
    """``m(S) = Σ_{i∉S} s_i / Σ_i s_i`` ``[T, B]`` for shortlists ``keep [T, B, N]``, with
    ``s_i = Σ_t g_i(t)`` (runtime-legal: the router has run, no expert has loaded)."""
    s = batch.mass()[:, None, :]
    return (s * ~keep).sum(-1) / s.sum(-1)


MASS = "mass_excluded"  # the curve every predictor may read (policy.adaptive's MassGain)
# the runtime-legal curves ``[T, S + 1]`` a gain predictor may read, by the replay metric name it
# declares (``Predictor.reads``; mass alone where it declares nothing): ``(batch, keep,
# coverage, ranking) -> curve`` over the shortlists ``keep [T, S + 1, N]``. A predictor reading
# another curve works in the product once that curve has its line here.
RUNTIME_CURVES: dict[str, Callable] = {
    MASS: lambda batch, keep, coverage, ranking: excluded_mass(batch, keep),
    adaptive.PREDICTED: lambda batch, keep, coverage, ranking: adaptive.predicted_errors(
        batch, keep, coverage, ranking.surrogate_ranked(batch), ranking.predicted),
}


def reads(predictor: adaptive.Predictor) -> tuple[str, ...]:
    """The curves ``predictor`` reads (mass excluded where it declares nothing)."""
    return tuple(getattr(predictor, "reads", (MASS,)))


def runtime_curves(predictor: adaptive.Predictor, batch: RoutingBatch, keep: torch.Tensor,
                   coverage: Coverage, ranking) -> torch.Tensor | dict[str, torch.Tensor]:
    """What ``predictor`` reads of the shortlists ``keep [T, S + 1, N]``, each ``[T, S + 1]``
    float64 (:data:`RUNTIME_CURVES`): the mass tensor itself where that is all it reads, else a
    mapping by name."""
    names = reads(predictor)
    missing = [n for n in names if n not in RUNTIME_CURVES]
    if missing:
        raise CalibrationError(f"the {predictor.name} gain predictor reads {', '.join(missing)}, "
                               "which adaptive budgets cannot compute at run time yet; use "
                               f"--gain-predictor {' or '.join(sorted(index.GAIN_PREDICTORS))}")
    found = {n: RUNTIME_CURVES[n](batch, keep, coverage, ranking).double() for n in names}
    return found[MASS] if names == (MASS,) else found


def _map(curves, f):
    """``f`` applied to a curve tensor or to each curve of a mapping."""
    return f(curves) if isinstance(curves, torch.Tensor) else {k: f(v) for k, v in curves.items()}


def relative_errors(batch: RoutingBatch, keep: torch.Tensor, coverage: Coverage) -> torch.Tensor:
    """``RSE = Σ_t ||O*_t − Ô_t||² / Σ_t ||O*_t||²`` ``[T, B]`` for shortlists ``keep [T, B, N]``
    (the batch's expert terms needed): what a learning predictor is fitted to."""
    idx, w = coverage.apply(batch, keep)
    sq = coverage.sq_errors(batch, keep, idx, w)  # [T, B, M], exact
    return sq.sum(-1) / batch.terms.gold_sq[:, None, :].sum(-1).clamp_min(1e-30)


@dataclass
class Prices:
    """The price rule of one ranking × coverage, calibrated on a calibration run
    (:func:`calibrate_prices`): the fitted gain ``predictor``, the budgets
    ``b_min .. b_max`` a layer may get, the price λ of each mean budget B̄, the MoE ``layers``
    of a pass in order, the optional cap on a pass's total, ``round(pass_cap · B̄ · L)``, and
    the optional pacing η (λ calibrated unpaced); ``achieved`` is the mean B per tree-layer the
    unpaced rule gave on the calibration run itself."""

    predictor: adaptive.Predictor
    b_min: int
    b_max: int
    prices: dict[int, float]
    layers: list[int]
    pass_cap: float | None = None
    achieved: dict[int, float] = field(default_factory=dict)
    pace: float | None = None  # η of the paced rule (policy.adaptive, pacing); None: unpaced
    pace_over: str = "prompt"  # whose deficit: each prompt's, or the run's (index.PACE_SCOPES)

    @property
    def budgets(self) -> list[int]:
        """Every budget a layer may get, ``B_min .. B_max``: the shortlists ranked per layer."""
        return list(range(self.b_min, self.b_max + 1))

    def for_layers(self, layers: list[int]) -> Prices:
        """These prices for passes through MoE ``layers`` (what a replay scores, or every MoE
        layer of the model online): the cap's L and the layer order are theirs. Refused in one
        line when the predictor cannot predict at one of them (``calibrated`` learned ratios
        only for the calibration's stored layers)."""
        zero = torch.zeros(1, len(layers), len(self.budgets), dtype=torch.float64)
        names = reads(self.predictor)
        probe = zero if names == (MASS,) else {n: zero for n in names}
        try:
            self.predictor.gains(probe, torch.tensor(list(layers)))
        except ValueError as exc:
            raise CalibrationError(f"the {self.predictor.name} gain predictor: {exc}; capture "
                                   "the calibration with --store-layers all") from None
        return replace(self, layers=list(layers))

    def cap(self, mean: int) -> int | None:
        return None if self.pass_cap is None else round(self.pass_cap * mean * len(self.layers))

    def curves(self, batch: RoutingBatch, keep: torch.Tensor, coverage: Coverage, ranking):
        """What the predictor reads of the shortlists ``keep [T, S + 1, N]`` at :attr:`budgets`
        (:func:`runtime_curves`)."""
        return runtime_curves(self.predictor, batch, keep, coverage, ranking)

    def choose(self, curves, layers: torch.Tensor, means: list[int],
               passes: torch.Tensor | None = None, used: dict | None = None,
               streams: torch.Tensor | None = None, deficit: dict | None = None) -> torch.Tensor:
        """``B_l [T, len(means)]`` (long) for tree-layers of MoE ``layers [T]`` whose shortlists
        at :attr:`budgets` give ``curves`` (:meth:`curves`; ``[T, S + 1]``, e.g. the mass each
        excludes): the price rule at each mean's λ. With a cap, ``passes [T]`` (ints) says which
        pass each tree-layer is in and ``used`` (pass -> ``[len(means)]`` experts its earlier
        layers loaded, updated here) carries a pass across calls; the batch's tree-layers are
        capped layer position by position, in pass order. Paced (:attr:`pace`), ``streams [T]``
        (ints; all one stream if not given) says whose deficit prices each tree-layer and
        ``deficit`` (stream -> ``[len(means)]``, updated here) carries it across calls; each
        stream's tree-layers go in (pass, layer) order, the streams side by side."""
        gains = self.predictor.gains(_map(curves, lambda c: c[None].double()), layers)[0]
        if self.pace is None and self.pass_cap is None:  # every tree-layer on its own
            return torch.stack([adaptive.price_budgets(gains, self.prices[m], self.b_min)
                                for m in means], 1)
        # in order: a paced stream's tree-layers, or (unpaced, capped) each pass's layers
        paced = self.pace is not None
        return self._in_order(gains, layers, means, passes, {} if used is None else used,
                              streams if paced else passes,
                              {} if deficit is None or not paced else deficit)

    def paced_streams(self, prompts: torch.Tensor) -> torch.Tensor:
        """Whose running deficit prices each tree-layer of ``prompts [T]`` (:meth:`choose`'s
        ``streams``): its prompt's, or paced over the run (:attr:`pace_over`), the run's one
        stream, its prompts in the order they are served."""
        return prompts if self.pace_over == "prompt" else torch.zeros_like(prompts)

    def positions(self, layers: torch.Tensor) -> torch.Tensor:
        """Each MoE layer's place in a pass, ``[T]`` (long)."""
        lookup = torch.full((max(self.layers) + 1,), -1, dtype=torch.long)
        lookup[torch.tensor(self.layers)] = torch.arange(len(self.layers))
        return lookup[layers.cpu()]

    def _in_order(self, gains, layers, means, passes, used, streams, deficit) -> torch.Tensor:
        """:meth:`choose` where order matters: step r takes the r-th tree-layer of every stream
        at once (its (pass, layer) order), prices it at its stream's ``λ_t = λ·exp(η·D/B̄)``
        when paced (:func:`policy.adaptive.paced_price`; λ otherwise), clips it to the room a
        pass cap leaves its pass and adds B to the pass's spend, and ``B − B̄`` to the stream's
        deficit. Unpaced and capped, each pass is its own stream."""
        t, device = gains.shape[0], gains.device
        streams = torch.zeros(t, dtype=torch.long) if streams is None else streams.long().cpu()
        passes = torch.zeros(t, dtype=torch.long) if passes is None else passes.long().cpu()
        position = self.positions(layers)
        order = torch.from_numpy(np.lexsort((position.numpy(), passes.numpy(), streams.numpy())))
        ordered = streams[order]
        rank = torch.empty(t, dtype=torch.long)  # each row's place in its stream
        rank[order] = torch.arange(t) - torch.searchsorted(ordered, ordered)
        # the state as tensors over this call's streams and passes, read from and written back
        # to the dicts that carry it across calls
        zeros = lambda dtype: torch.zeros(len(means), dtype=dtype)  # noqa: E731
        stream_ids, at_stream = torch.unique(streams, return_inverse=True)
        pass_ids, at_pass = torch.unique(passes, return_inverse=True)
        owed = torch.stack([deficit.get(i, zeros(torch.float64)) for i in stream_ids.tolist()]) \
            if t else zeros(torch.float64)[None]
        spent = torch.stack([used.get(p, zeros(torch.long)) for p in pass_ids.tolist()]) \
            if t else zeros(torch.long)[None]
        price = torch.tensor([self.prices[m] for m in means], dtype=torch.float64)
        target = torch.tensor(means, dtype=torch.float64)
        cap = None if self.pass_cap is None else torch.tensor([self.cap(m) for m in means])
        later = (len(self.layers) - 1 - position)[:, None]
        g = gains.cpu()[:, None, :]
        chosen = torch.empty(t, len(means), dtype=torch.long)
        by_rank = torch.argsort(rank, stable=True)
        for rows in by_rank.split(torch.bincount(rank).tolist() if t else []):  # one a stream
            s_, p_ = at_stream[rows], at_pass[rows]
            lam = price if self.pace is None else adaptive.paced_price(price, self.pace,
                                                                       owed[s_], target)
            b = self.b_min + adaptive.leading_run(g[rows], lam)
            if cap is not None:
                b = torch.minimum(b, adaptive.cap_room(cap, spent[p_], self.b_min, later[rows]))
                spent.index_add_(0, p_, b)
            owed.index_add_(0, s_, b - target)
            chosen[rows] = b
        deficit.update({i: owed[k] for k, i in enumerate(stream_ids.tolist())})
        used.update({p: spent[k] for k, p in enumerate(pass_ids.tolist())})
        return chosen.to(device)

    def pick(self, keep: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``[T, len(means), N]``: of the shortlists ``keep [T, S + 1, N]`` at :attr:`budgets`,
        each tree-layer's at its chosen ``B_l [T, len(means)]``."""
        at = (chosen - self.b_min).clamp(0, keep.shape[1] - 1)
        return keep.gather(1, at[..., None].expand(-1, -1, keep.shape[-1]))


@dataclass(frozen=True)
class PriceRequest:
    """What adaptive budgets ask of the calibration step (issue 63): the gain ``predictor``
    (:data:`policy.adaptive.PREDICTORS`), the mean budgets B̄ (``means``), the ``coverages``
    they run under, the optional pass cap (a pass's total ≤ ``pass_cap · B̄ · L``), the
    largest budget a layer may get (None: N) and the optional pacing η."""

    predictor: str
    means: tuple[int, ...]
    coverages: tuple[str, ...]
    pass_cap: float | None = None
    b_max: int | None = None
    pace: float | None = None  # η of the paced rule (not the calibration's: λ is unpaced)
    pace_over: str = "prompt"  # whose deficit it keeps (index.PACE_SCOPES)


def prices_key(ranking: str, coverage: str, request: PriceRequest) -> tuple:
    """Where :func:`policy.calibration.calibrate` keeps a ranking's :class:`Prices` in ``fitted``
    (the pacing left out: λ is calibrated unpaced, so paced and unpaced share one calibration)."""
    return ("prices", ranking, coverage, replace(request, pace=None, pace_over="prompt"))


def prices_for(stats: CalibrationStats | None, ranking: str, coverage: str,
               request: PriceRequest):
    """The calibrated :class:`Prices` of ``ranking`` × ``coverage`` (refused in one
    line when the calibration step was not asked for them), paced as ``request`` asks."""
    found = None if stats is None else stats.fitted.get(prices_key(ranking, coverage, request))
    if found is None:
        raise CalibrationError(f"no price λ calibrated for {ranking} under {coverage}; adaptive "
                               "budgets need --calibration RUN")
    return replace(found, pace=request.pace, pace_over=request.pace_over)


def calibrate_prices(stats: CalibrationStats, runs: list, read: Callable[[object], Iterable],
                     model: ExpertModel, ranking: str, coverage: str, request: PriceRequest):
    """:class:`Prices` of ``ranking`` (fitted on ``stats``) under ``coverage``: per
    calibration tree-layer the ranking's shortlists at every ``B = B_min .. B_max`` and the
    router mass each excludes (runtime-legal), the predictor's gains from them (fitted first on
    the true error curves where it learns: those need every expert's output), then for each
    mean B̄ the price λ whose rule gives a mean B of B̄ over the calibration's tree-layers
    (:func:`policy.adaptive.calibrate_price`; with a cap, over its complete passes, each layer
    in order). Rankings are asked as at run time: one tree-layer at a time, without the state a
    stateful ranking would carry across passes."""
    from moe_spec.policy import coverage as coverages
    from moe_spec.policy import rankings
    ranked = rankings.get(ranking)().fit(stats)
    cover = coverages.get(coverage)
    b_min = index.min_budget(coverage, model.top_k)
    b_max = min(request.b_max or model.num_experts, model.num_experts)
    predictor = adaptive.predictor(request.predictor)
    learns = type(predictor).fit is not adaptive.Predictor.fit  # fitted on true errors
    budgets = list(range(b_min, b_max + 1))
    keys, found, errors = [], [], []
    for run in runs:
        for tl in read(run):
            tensor = lambda a, dtype: torch.as_tensor(np.asarray(a), dtype=dtype)  # noqa: E731
            hidden = None if tl.hidden is None else tensor(tl.hidden, torch.float32)
            layer = torch.tensor([tl.layer])
            batch = RoutingBatch.single(tensor(tl.probs, torch.float32), tensor(tl.idx, torch.long),
                                        tensor(tl.weights, torch.float32), tl.layer,
                                        model.batch_rule(layer), hidden)
            if learns:
                batch.terms = ExpertTerms.from_outputs(
                    model.expert_outputs(tl.layer, hidden)[None], batch.idx, batch.weights)
            keep = ranked.shortlists(batch, cover, budgets)[0]  # [1, S+1, N]
            keys.append((run.name, tl.prompt_index, tl.step, tl.layer))
            found.append(runtime_curves(predictor, batch, keep, cover, ranked))
            if learns:
                errors.append(relative_errors(batch, keep, cover).double())
    if not keys:
        raise CalibrationError(f"--calibration {', '.join(r.name for r in runs)}: no tree-layer "
                               "to calibrate the price λ on; calibrate on other runs")
    curves = torch.cat(found) if isinstance(found[0], torch.Tensor) else \
        {n: torch.cat([f[n] for f in found]) for n in found[0]}  # [T, S+1] each
    layers = sorted({k[3] for k in keys})
    grid = _pass_grid(keys, layers)  # [P, L] rows of complete passes
    if learns or request.pass_cap is not None:
        if grid is None:
            raise CalibrationError(f"--calibration {', '.join(r.name for r in runs)}: no "
                                   "verification pass with every MoE layer stored, which the "
                                   f"{request.predictor} predictor or a pass cap needs")
    if learns:
        predictor.fit(_map(curves, lambda c: c[grid]), torch.cat(errors)[grid],
                      torch.tensor(layers))
    prices, achieved = {}, {}
    for mean in request.means:
        if not b_min <= mean <= b_max:
            continue
        if request.pass_cap is None:
            gains = predictor.gains(_map(curves, lambda c: c[None]),
                                    torch.tensor([k[3] for k in keys]))
            cap = None
        else:
            gains = predictor.gains(_map(curves, lambda c: c[grid]), torch.tensor(layers))
            cap = round(request.pass_cap * mean * len(layers))
        prices[mean] = adaptive.calibrate_price(gains, mean, b_min, cap)
        achieved[mean] = float(adaptive.price_budgets(gains, prices[mean], b_min, cap)
                               .double().mean())
    return Prices(predictor, b_min, b_max, prices, layers, request.pass_cap, achieved)


def _pass_grid(keys: list[tuple], layers: list[int]) -> torch.Tensor | None:
    """``[P, L]`` row numbers of ``keys`` ((run, prompt, step, layer) per tree-layer) for the
    passes holding every one of ``layers``, in layer order; None when there is none."""
    rows: dict[tuple, dict[int, int]] = {}
    for i, (run, prompt, step, layer) in enumerate(keys):
        rows.setdefault((run, prompt, step), {})[layer] = i
    full = [[found[x] for x in layers] for found in rows.values() if set(found) >= set(layers)]
    return torch.tensor(full) if full else None


def calibrate_all(stats: CalibrationStats, runs: list, model: ExpertModel,
                  read: Callable[[object], Iterable], rankings, request: PriceRequest) -> None:
    """The calibration step of adaptive budgets: :func:`calibrate_prices` of every ranking ×
    coverage ``request`` asks, kept in ``stats.fitted`` (once per calibration)."""
    for ranking in rankings:
        for coverage in request.coverages:
            key = prices_key(ranking, coverage, request)
            if key not in stats.fitted:
                stats.fitted[key] = calibrate_prices(stats, runs, read, model, ranking, coverage,
                                                     request)
