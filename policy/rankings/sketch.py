"""``sketch``: the oracle's own search run on *predicted* expert outputs of the tree's tokens.

Calibrated rankings score experts one by one (coact's Gram G is a calibration mean), so under
substitution at B = k, where every token runs all of S re-weighted and its error depends on how
*its own* experts' outputs relate, they close only part of the router→oracle gap. The selection
happens after every tree token's MoE input ``h_t`` is known and before any expert is loaded, so
this ranking predicts each expert's output on each token with a small surrogate fitted offline on
calibration (h, E_i(h)) pairs (:mod:`policy.surrogate`: rank-r least squares ``Ê_i(h) = U_i V_iᵀ
[h, 1]`` plus each expert's residual energy as a private direction) and hands the predictions to
:class:`policy.rankings.oracle.Oracle` in place of the true outputs: the same starts (greedy
prefixes under the coverage policy and the family's substitution rule, router and squared-mass
prefixes, exhaustive search where C(N, B) is small) and the same swap search, all scored on the
predicted terms. Under truncation the shortlist is then reordered so that the tree's selected
experts come first (:func:`policy.rankings.base.selected_first` semantics).

Runtime-legal: it reads the batch's routing (``probs``, ``idx``, ``weights``, ``mask``,
``layers``, ``rule``), the MoE inputs the caller attaches (:func:`with_inputs`), and the
surrogate fitted on calibration; never ``batch.terms`` (``tests/test_sketch.py`` perturbs the
evaluation pass's expert outputs and checks the shortlist). The surrogate comes with the
calibration statistics (:func:`with_surrogate_sums`, which replay and capture's online budget
call when sketch is asked for; :func:`attach_moments` / :func:`attach_surrogate`). Open-loop and
closed-loop replay and the online budget hand rankings h_t (``RoutingBatch.hidden``). Without a
surrogate or without the batch's MoE inputs it cannot be token-aware: it then returns
coact-prior's shortlists (before any pass: coact with the
energy prior), says so once in a warning and reports ``token_aware`` False. ``bench/sketch_gap.py``
attaches both and checks ``token_aware``.

Cost (:meth:`Sketch.cost`): the surrogate's bytes per layer and FLOPs per token
(:mod:`policy.overhead`, which :mod:`policy.index` names as the ranking's ``overhead``:
the cost model charges it to every verification pass).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import ClassVar

import torch

from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.coverage import Truncation, prefix_masks
from moe_spec.policy.overhead import SKETCH_RANK, surrogate_cost
from moe_spec.policy.rankings.base import Ranking, RankingError, by_mass, register
from moe_spec.policy.surrogate import MOMENTS, InputMoments, Surrogate, predicted_outputs

WORK_BYTES = 256 * 2**20  # predicted outputs, their float64 copy and Gram per chunk


def attach_moments(stats, moments: InputMoments):
    """``stats`` (calibration statistics) made to carry the surrogate's least-squares sums; sketch
    fits its surrogate from them (once per rank)."""
    stats.fitted[MOMENTS] = moments
    return stats


_SUMS: dict[str, InputMoments] = {}  # calibration run id -> its surrogate sums


def with_surrogate_sums(stats, runs: list, model, read):
    """A copy of ``stats`` carrying the surrogate's least-squares sums over the calibration
    ``runs`` (objects with ``run_id`` and ``ref``; ``read(run)`` their tree-layers; ``model``
    computes every expert's output), each run's sums collected once per process: what replay
    and the online budget do when a token-aware ranking is asked for. A copy: statistics are
    shared by every later replay of the same calibration in the process
    (:func:`policy.calibration.collect_runs`), and one that asked for no token-aware ranking
    must not find the sums (the oracle's results say whether it had them)."""
    for run in runs:
        if run.run_id not in _SUMS:
            _SUMS[run.run_id] = InputMoments.collect(read(run), model, sources=[run.ref])
    return attach_moments(dataclasses.replace(stats, fitted=dict(stats.fitted)),
                          InputMoments.merge([_SUMS[r.run_id] for r in runs]))


def attach_surrogate(stats, surrogate: Surrogate):
    """``stats`` made to carry a fitted (e.g. loaded) surrogate of rank ``surrogate.rank``."""
    stats.fitted[("sketch", surrogate.rank)] = surrogate
    return stats


def with_inputs(batch: RoutingBatch, hidden: torch.Tensor) -> RoutingBatch:
    """``batch`` with its tree tokens' MoE inputs ``hidden [T, M, H]`` attached (what a
    verification pass knows before it loads an expert)."""
    if hidden.shape[:2] != batch.probs.shape[:2]:
        raise ValueError(f"MoE inputs {tuple(hidden.shape)} do not match the batch's "
                         f"{tuple(batch.probs.shape[:2])} tokens")
    batch.hidden = hidden
    return batch  # (RoutingBatch.hidden: replay and the online budget attach h_t themselves)


def routing_only(batch: RoutingBatch, rows: torch.Tensor) -> RoutingBatch:
    """The routing of tree-layers ``rows``, without expert terms."""
    rule = batch.rule
    if rule.selection_bias is not None and rule.selection_bias.dim() == 3:
        rule = rule.for_layers(rule.selection_bias[rows])
    return RoutingBatch(batch.probs[rows], batch.idx[rows], batch.weights[rows], batch.mask[rows],
                        batch.layers[rows], rule,
                        hidden=None if batch.hidden is None else batch.hidden[rows])


@register
class Sketch(Ranking):
    name = "sketch"
    rank: ClassVar[int] = SKETCH_RANK  # the surrogate's rank r (policy.overhead)

    def __init__(self, rank: int | None = None):
        if rank is not None:
            self.rank = int(rank)
        self.surrogate: Surrogate | None = None
        self.token_aware = False

    def fit(self, calibration=None):
        from moe_spec.policy.rankings.coact_prior import CoactPrior
        super().fit(calibration)
        key = ("sketch", self.rank)
        found = calibration.fitted.get(key)
        if found is None and MOMENTS in calibration.fitted:
            found = calibration.fitted[key] = Surrogate.fit(calibration.fitted[MOMENTS],
                                                            self.rank)
        self.surrogate = found
        self.fallback = CoactPrior().fit(calibration)
        self.token_aware = found is not None
        if found is None:
            self.blind("this calibration carries no expert surrogates (fit them on (h, E_i(h)) "
                       "pairs: policy.rankings.sketch.attach_moments)")
        return self

    @classmethod
    def from_surrogate(cls, surrogate: Surrogate) -> Sketch:
        """A sketch that searches on ``surrogate``'s predictions (e.g. one refit during the
        prompt, :class:`policy.surrogate.OnlineSurrogate`); no calibration, no fallback."""
        found = cls(rank=surrogate.rank)
        found.surrogate, found.token_aware = surrogate, True
        return found

    def memo_key(self):
        return None  # its answer depends on batch.hidden and the surrogate: never shared

    def searches_surrogate(self, batch) -> bool:
        """Whether :meth:`shortlists` and :meth:`order` search on predicted outputs: it holds a
        surrogate and the batch carries its MoE inputs (else coact-prior's answer)."""
        return self.surrogate is not None and getattr(batch, "hidden", None) is not None

    def surrogate_ranked(self, batch):
        """Every tree-layer where it :meth:`searches_surrogate`, none where it falls back."""
        return torch.full((batch.size,), self.searches_surrogate(batch), dtype=torch.bool,
                          device=batch.device)

    def blind(self, why: str) -> None:
        """Say once per instance that sketch falls back to coact-prior's shortlists, and why."""
        self.token_aware = False
        if not getattr(self, "warned", False):
            self.warned = True
            warnings.warn(f"ranking {self.name}: {why}; using coact-prior's shortlists", stacklevel=3)

    def save(self, path: Path) -> None:
        """The fitted surrogate; without one, a record that coact-prior's shortlists ran."""
        if self.surrogate is None:
            import numpy as np
            with open(path, "wb") as f:
                np.savez(f, fallback=np.array("coact-prior"))
            return
        self.surrogate.save(path)

    @classmethod
    def cost(cls, n: int, h: int, intermediate: int, rank: int | None = None,
             expert_bytes: float = 2) -> dict:
        """Bytes per layer, FLOPs per token and expert-equivalents (experts of ``expert_bytes``
        a number) of the surrogate at a shape (what the cost model charges every verification
        pass)."""
        return surrogate_cost(n, h, cls.rank if rank is None else rank, intermediate, expert_bytes)

    def predicted(self, batch: RoutingBatch, rows: torch.Tensor) -> RoutingBatch:
        """Tree-layers ``rows`` of ``batch`` with predicted expert terms in place of true ones."""
        hidden = getattr(batch, "hidden", None)
        if hidden is None:
            raise RankingError(f"ranking {self.name} needs the tree tokens' MoE inputs h_t "
                               "(policy.rankings.sketch.with_inputs)")
        part = routing_only(batch, rows)
        pred = predicted_outputs(self.surrogate, part.layers, hidden[rows].to(batch.device),
                                 part.mask)
        part.terms = ExpertTerms.from_outputs(pred, part.idx, part.weights)
        return part

    def chunks(self, batch: RoutingBatch) -> list[torch.Tensor]:
        m, n = batch.probs.shape[1], batch.n
        width = self.surrogate.hidden_size + n
        per = max(1, m * n * (12 * width + 8 * n + 16))
        size = max(1, min(256, WORK_BYTES // per))
        return list(torch.arange(batch.size, device=batch.device).split(size))

    def shortlists(self, batch, coverage, budgets):
        from moe_spec.policy.rankings.oracle import Oracle
        if not self.searches_surrogate(batch):
            if self.surrogate is not None:
                self.blind("the batch carries no MoE inputs h_t (policy.rankings.sketch."
                           "with_inputs)")
            return self.fallback.shortlists(batch, coverage, budgets)
        search = Oracle()  # unfitted: its starts need router scores only
        budgets = list(budgets)
        keep = torch.zeros(batch.size, len(budgets), batch.n, dtype=torch.bool,
                           device=batch.device)
        for rows in self.chunks(batch):
            keep[rows] = search.shortlists(self.predicted(batch, rows), coverage, budgets)[0]
        if isinstance(coverage, Truncation):
            keep = selected_in(keep, batch, budgets)
        return keep, budgets

    def order(self, batch, coverage, max_budget):
        """The oracle's greedy order on the predicted terms (what :meth:`shortlists` starts
        from; the shortlists themselves are searched per budget)."""
        from moe_spec.policy.rankings.oracle import Oracle
        if not self.searches_surrogate(batch):
            return self.fallback.order(batch, coverage, max_budget)
        search = Oracle()
        return torch.cat([search.order(self.predicted(batch, rows), coverage, max_budget)
                          for rows in self.chunks(batch)])


def selected_in(keep: torch.Tensor, batch: RoutingBatch, budgets: list[int]) -> torch.Tensor:
    """Truncation: shortlists ``keep [T, B, N]`` of size B rebuilt so that experts some tree token
    selected come first: the kept ones of the union U, then U's others by router mass, then the
    rest by router mass (an expert outside U contributes nothing under truncation)."""
    union = batch.union()[:, None, :]  # [T, 1, N]
    n = batch.n
    rank = torch.empty(batch.size, n, dtype=torch.long, device=keep.device)
    rank.scatter_(1, by_mass(batch.mass()), torch.arange(n, device=keep.device).expand_as(rank))
    key = (~(keep & union)).long() * 2 * n + (~union).long() * n + rank[:, None, :]  # [T, B, N]
    order = torch.argsort(key, dim=-1, stable=True)  # [T, B, N]
    out = torch.zeros_like(keep)
    for j, b in enumerate(budgets):
        out[:, j] = prefix_masks(order[:, j], [b], n)[:, 0]
    return out
