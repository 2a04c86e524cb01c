"""The ranking protocol and its registry.

A ranking decides which experts a budget keeps for each tree-layer: it returns the experts in the
order they join the shortlist, so budget B keeps the first B (:func:`policy.coverage.prefix_masks`).

    ranking = get("coact")().fit(calibration)      # offline statistics, if it needs them
    ranking.reset()                                # a new prompt
    order = ranking.order(batch, coverage, max_budget)   # [T, L] over T tree-layers at once
    ranking.observe(layers, loaded)                # after each verification pass (stateful ones)
    ranking.observe_outputs(layers, idx, w, out)   # ... and what it executed (observes_outputs)

Class attributes say what a ranking needs; the CLIs derive their choices, help text and error
messages from them and from its line in :mod:`policy.index`, which also says where the class lives:
:func:`get` imports that module on first use. A new ranking is one module with a ``@register``-ed
subclass, plus its line in :data:`policy.index.RANKINGS`.
"""

from __future__ import annotations

import copy
import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import ClassVar

import torch

from moe_spec.errors import UserError
from moe_spec.policy import index
from moe_spec.policy.batch import RoutingBatch
from moe_spec.policy.calibration import CalibrationStats
from moe_spec.policy.coverage import Coverage, Truncation, prefix_masks
from moe_spec.policy.substitution import best_shortlists, predictor


class RankingError(UserError, ValueError):
    """A ranking used where it cannot work; the message is one line for the user."""


class Ranking(ABC):
    name: ClassVar[str]
    # set by register() from the ranking's line in policy.index (the facts results are keyed
    # by, read there without torch), never declared by the class:
    runtime: ClassVar[bool]  # needs only what a verification pass has (router scores)
    version: ClassVar[int] = 1  # raised when what order()/shortlists() return changes
    needs_calibration: ClassVar[bool] = False  # fit() needs calibration statistics
    uses_calibration: ClassVar[bool] = False  # fit() uses calibration when given (the oracle)
    artifact: ClassVar[str | None] = None  # file name of what fit() learns, saved by save()
    stateful: ClassVar[bool] = False  # uses observe(): orders depend on earlier passes
    needs_hidden: ClassVar[bool] = False  # reads the tree tokens' MoE inputs (batch.hidden;
    # its line's inputs hold "moe_inputs")
    token_aware_starts: ClassVar[bool] = False  # starts from the token-aware rankings where the
    # calibration carries the surrogate's sums (the oracle; policy.index.surrogate_sums)
    observes_outputs: ClassVar[bool] = False  # uses observe_outputs() (one state per budget;
    # its line's inputs hold "executed_outputs")
    observes_output_vectors: ClassVar[bool] = False  # ... and needs the outputs themselves, not
    # only their inner products (open-loop replay then gathers them; "executed_output_vectors")
    stateful_starts: tuple = ()  # rankings whose shortlists open-loop replay streams in order
    # and hands to shortlists(starts=...) (the oracle's stateful starts)
    selected_first: ClassVar[bool] = True  # under truncation, experts some tree token selected
    # come before any other (B ≥ |U| ⇒ the error floor); False only for the papers' own
    # definitions (router, static), which can leave a selected expert out even when B ≥ |U|
    order_reads_coverage: ClassVar[bool] = True  # False: order() ignores the coverage, so a
    # batch computes it once for both policies (stateless rankings only, see memo_key)

    calibration: CalibrationStats | None = None

    def fit(self, calibration: CalibrationStats | None = None) -> Ranking:
        if self.needs_calibration and calibration is None:
            raise RankingError(f"ranking {self.name} needs calibration statistics (--calibration "
                               "RUN, captured on other prompts)")
        self.calibration = calibration
        return self

    def save(self, path) -> None:
        """Write what :meth:`fit` learned to ``path`` (rankings with an ``artifact`` only)."""
        raise NotImplementedError(f"ranking {self.name} learns nothing to save")

    def reset(self) -> None:
        """A new prompt starts: forget what earlier passes did."""

    def clone(self) -> Ranking:
        """An independent copy of this ranking's state that shares its (read-only) calibration
        statistics: one instance per budget for rankings that observe outputs."""
        return copy.deepcopy(self, {id(self.calibration): self.calibration})

    def observe(self, layers: torch.Tensor, loaded: torch.Tensor) -> None:
        """After a verification pass: ``loaded [T, N]`` the experts it loaded at ``layers [T]``."""

    def observe_outputs(self, layers: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                        outputs: torch.Tensor | None, dots: torch.Tensor | None = None) -> None:
        """After a verification pass, what it executed: ``idx, weights [T, M, k]`` each token's
        experts at ``layers [T]`` (weight 0: not run) and ``outputs [T, M, k, H]`` their outputs,
        or, from a caller that already holds every expert's output Gram (open-loop replay), only
        their inner products ``dots [T, M, k, k]`` (float64; ``outputs`` None). Only rankings with
        ``observes_outputs`` are called; what a pass executes depends on the budget, so callers
        keep one instance per budget."""

    @abstractmethod
    def order(self, batch: RoutingBatch, coverage: Coverage, max_budget: int) -> torch.Tensor:
        """Expert ids by priority, ``[T, L]`` with ``max_budget ≤ L ≤ N``."""

    def shortlists(self, batch: RoutingBatch, coverage: Coverage, budgets: list[int]):
        """``(keep [T, len(valid), N], valid budgets)``; nested prefixes of :meth:`order` unless a
        ranking chooses among several orders per budget (:meth:`prefix_orders`) or searches each
        budget on its own (``exact``)."""
        return self.prefixes(batch, coverage, budgets), list(budgets)

    def surrogate_ranked(self, batch: RoutingBatch) -> torch.Tensor:
        """``[T]`` bool: the tree-layers of ``batch`` whose shortlists this ranking searched on a
        surrogate's predicted expert outputs ``Ê_i(h_t)`` (the token-aware path; replay's
        ``surrogate_ranked`` column). False for every ranking that reads routing alone; the
        sketch family says where it ran its surrogate, and where it fell back."""
        return torch.zeros(batch.size, dtype=torch.bool, device=batch.device)

    def predicted(self, batch: RoutingBatch, rows: torch.Tensor) -> RoutingBatch:
        """Tree-layers ``rows`` (where :meth:`surrogate_ranked`) with the surrogate's predicted
        expert terms in place of true ones (replay's ``predicted_rse``); only the sketch family
        predicts outputs."""
        raise RankingError(f"ranking {self.name} predicts no expert outputs")

    def memo_key(self) -> tuple | None:
        """What makes two instances answer alike on the same batch, or None where they may not
        (a stateful ranking, an offline one, one that reads more than routing and calibration):
        the class, its version and its calibration object (:class:`Same`)."""
        if self.stateful or not self.runtime:
            return None
        return type(self), self.version, Same(self.calibration)

    def batch_order(self, batch: RoutingBatch, coverage: Coverage, max_budget: int
                    ) -> torch.Tensor:
        """:meth:`order`, computed once per batch for both coverage policies where the order
        does not read the coverage (``order_reads_coverage`` False)."""
        key = None if self.order_reads_coverage else self.memo_key()
        if key is None:
            return self.order(batch, coverage, max_budget)
        return batch.memo(("order", key, max_budget),
                          lambda: self.order(batch, coverage, max_budget))

    def prefix_orders(self, batch: RoutingBatch, coverage: Coverage, max_budget: int
                      ) -> list[torch.Tensor]:
        """The orders whose prefixes are the shortlists: :meth:`order` (selected experts first
        under truncation), or several, of which :meth:`prefix_errors` picks per budget."""
        order = self.batch_order(batch, coverage, max_budget)
        if self.selected_first and isinstance(coverage, Truncation):
            order = selected_first(order, batch)
        return [order]

    def prefix_errors(self, batch: RoutingBatch):
        """``(keep, idx, w) → [T, *E, M]`` errors to choose among :meth:`prefix_orders` by
        (rankings with several orders only)."""
        raise NotImplementedError(f"ranking {self.name} has one order")

    def prefixes(self, batch: RoutingBatch, coverage: Coverage, budgets) -> torch.Tensor:
        """``keep [T, B, N]`` for ``budgets`` (a list, or ``[T, B]`` per row): the prefixes of
        :meth:`prefix_orders`, the one with the least :meth:`prefix_errors` where there are
        several (ties to the first)."""
        most = int(torch.as_tensor(budgets).max())
        masks = [prefix_masks(o, budgets, batch.n)
                 for o in self.prefix_orders(batch, coverage, most)]
        if len(masks) == 1:
            return masks[0]
        return best_shortlists(batch, coverage, masks, self.prefix_errors(batch))

    @classmethod
    def shortlists_each(cls, instances: list[Ranking], batch: RoutingBatch, coverage: Coverage,
                        budgets: list[int]) -> torch.Tensor:
        """``keep [T, len(budgets), N]`` where instance j answers budget j alone: rankings that
        observe outputs keep one state per budget (:meth:`observe_outputs`). One call each here;
        a ranking may answer them together."""
        return torch.stack([ranking.shortlists(batch, coverage, [b])[0][:, 0]
                            for ranking, b in zip(instances, budgets)], 1)

    def skipped(self, n: int, budgets: list[int]) -> list[int]:
        """Budgets this ranking cannot evaluate for N experts (reported, never silent): its
        line's ``subset_limit`` (:func:`policy.index.skipped_budgets`)."""
        return index.skipped_budgets(self.name, n, budgets)


class Registry(Mapping):
    """Ranking classes by name, the names those of :data:`policy.index.RANKINGS`: looking one up
    imports its module (which registers the class) the first time; ``in`` and iterating list
    the names without importing anything, ``items()``/``values()`` import every ranking."""

    def __init__(self) -> None:
        self.classes: dict[str, type[Ranking]] = {}  # registered so far (modules imported)

    def __getitem__(self, name: str) -> type[Ranking]:
        if name not in self.classes:
            entry = index.RANKINGS[name]  # KeyError for an unknown name, as a dict
            importlib.import_module(entry.module)
            if name not in self.classes:
                raise ValueError(f"module {entry.module} registers no ranking {name!r} "
                                 "(policy.index says it does)")
        return self.classes[name]

    def __contains__(self, name: object) -> bool:
        return name in index.RANKINGS

    def __iter__(self) -> Iterator[str]:
        return iter(index.RANKINGS)

    def __len__(self) -> int:
        return len(index.RANKINGS)


REGISTRY = Registry()


FACTS = ("runtime", "version", "needs_calibration", "uses_calibration", "artifact",
         "stateful", "needs_hidden", "token_aware_starts", "observes_outputs",
         "observes_output_vectors")  # what a ranking's line in policy.index says (the last
# two, and needs_hidden, derived from the inputs it declares: policy.index.INPUTS)


def register(cls: type[Ranking]) -> type[Ranking]:
    """Class decorator: ``cls`` becomes :func:`get`'s answer for ``cls.name``, with the
    :data:`FACTS` of its line in :mod:`policy.index` (the one place that says them)."""
    entry = index.RANKINGS.get(cls.name)
    if entry is None:
        raise ValueError(f"ranking {cls.name!r} has no line in policy.index.RANKINGS")
    if entry.module != cls.__module__:
        raise ValueError(f"ranking {cls.name!r} is defined in {cls.__module__}, policy.index "
                         f"says {entry.module}")
    if cls.name in REGISTRY.classes:
        raise ValueError(f"ranking {cls.name!r} registered twice")
    declared = [f for f in FACTS if f in vars(cls)]
    if declared:
        raise ValueError(f"ranking {cls.name!r} declares {', '.join(declared)}; policy.index "
                         "holds it")
    for fact in FACTS:
        setattr(cls, fact, getattr(entry, fact))
    REGISTRY.classes[cls.name] = cls
    return cls


def names(*, runtime: bool | None = None) -> list[str]:
    """Every ranking (runtime ones first), optionally only runtime or only offline; from
    :mod:`policy.index`, importing none."""
    return index.ranking_names(runtime=runtime)


def summary(name: str) -> str:
    """The ranking's one-line description (kept in :mod:`policy.index` for instant --help)."""
    return index.RANKINGS[name].summary


def get(name: str) -> type[Ranking]:
    """The ranking class called ``name``, its module imported on first use."""
    if name not in index.RANKINGS:
        raise RankingError(f"unknown ranking {name!r}; use one of {', '.join(names())}")
    return REGISTRY[name]


class Same:
    """A key part equal only to one for the same object, which it keeps alive (so its id is not
    reused while a key holds it); calibration statistics are neither hashable nor comparable by
    value."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return type(other) is Same and other.obj is self.obj


def batch_shortlists(ranking: Ranking, batch: RoutingBatch, coverage: Coverage,
                     budgets: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``ranking.shortlists(batch, coverage, budgets)``, once per batch for
    instances with one :meth:`Ranking.memo_key`: a replay of coact and the oracle's coact start
    (open-loop replay scores every task of a batch on the same object)."""
    key = ranking.memo_key()
    if key is None:
        return ranking.shortlists(batch, coverage, budgets)
    return batch.memo(("shortlists", key, coverage.name, tuple(budgets)),
                      lambda: ranking.shortlists(batch, coverage, budgets))


def mass_tiebreak(batch: RoutingBatch) -> torch.Tensor:
    """``10⁻¹² · s_i / Σ s``, ``[T, N]`` float64: added to a score, it orders experts the score
    cannot tell apart (no tree token routes to them) by router mass, and changes nothing else."""
    mass = batch.mass().double()
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30) * 1e-12


def by_mass(scores: torch.Tensor) -> torch.Tensor:
    """Expert ids by decreasing score, ties to the lower id: ``[T, N] → [T, N]``."""
    return torch.argsort(scores, dim=-1, descending=True, stable=True)


def selected_first(order: torch.Tensor, batch: RoutingBatch) -> torch.Tensor:
    """``order [T, L]`` made a full order ``[T, N]`` in which every expert of the union U (some
    real tree token selected it) comes first, in ``order``'s order, then the rest: the experts
    ``order`` leaves out follow by router mass. Under truncation an expert outside U contributes
    nothing, so a prefix holding one while a selected expert waits only wastes budget."""
    t, length = order.shape
    n = batch.n
    rank = torch.full((t, n), n, dtype=torch.long, device=order.device)
    rank.scatter_(1, order, torch.arange(length, device=order.device).expand(t, length))
    fallback = torch.empty_like(rank)
    fallback.scatter_(1, by_mass(batch.mass()), torch.arange(n, device=order.device).expand(t, n))
    key = (~batch.union()).long() * (2 * n) + torch.where(rank < n, rank, n + fallback)
    return torch.argsort(key, dim=-1, stable=True)


def by_squared_mass(batch: RoutingBatch) -> torch.Tensor:
    """Expert ids by squared mixing mass ``A_ii = Σ_t ḡ_i(t)²``, ties by router mass."""
    w = batch.dense_weights().double()  # [T, M, N]
    return by_mass((w * w).sum(1) + mass_tiebreak(batch))


class SubstitutionAware:
    """For calibrated rankings whose order fits the *truncation* error: under substitution keep,
    per tree-layer and budget, whichever prefix of the ranking's own order, squared mixing mass
    and router mass has the lowest error *predicted* from the calibration's mean Gram
    (:func:`policy.substitution.predicted_sq_errors`); ties to the ranking's own order.

    Truncation drops the experts left out; substitution runs S's best instead, renormalised
    (at B = k every token runs all of S), which a truncation fit misjudges. On tiny-qwen3-moe with
    out-of-domain calibration coact's own order closed 42% of the router→oracle gap at B = 8
    under substitution, squared mass 83%, this choice 90%. (The oracle's substitution greedy run
    on the predicted terms, as a fourth candidate, overfit the prediction: 67%.) Runtime-legal:
    router scores and calibration statistics only. Mix in before :class:`Ranking`."""

    def prefix_orders(self, batch, coverage, max_budget):
        if isinstance(coverage, Truncation):
            return super().prefix_orders(batch, coverage, max_budget)
        return [self.batch_order(batch, coverage, max_budget), by_squared_mass(batch),
                by_mass(batch.mass())]

    def prefix_errors(self, batch):
        gram = self.mean_gram(batch)  # [T, N, N]
        predict = predictor(batch, gram)  # the terms once for every candidate
        return lambda keep, idx, w: predict(idx, w)

    def mean_gram(self, batch: RoutingBatch) -> torch.Tensor:
        """``G [T, N, N]`` float64 for the batch's layers: the calibration means."""
        return self.calibration.mean_gram(batch.layers).to(batch.device).double()


def help_text(*, runtime: bool | None = None) -> str:
    """One line per ranking, for --help."""
    return index.ranking_help(runtime=runtime)
