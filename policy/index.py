"""What the policy package offers, by name, without importing torch: the one source of truth.

Each ranking is one line of :data:`RANKINGS`: the module that defines it (imported on demand by
:func:`policy.rankings.get`), whether it works inside a verification pass, its one-line summary,
and the facts its results are keyed by: its version, whether it needs (or can use) calibration,
the file it saves beside its results, the budgets it cannot evaluate; then whether its
calibration collects examples, its step in the ablation ladder and what a CLI says when it skips
budgets. Command-line parsers build their choices and ``--help`` from this table and replay plans
from it (which results are stored, which are missing) without importing torch;
:func:`policy.rankings.register` gives each class the facts its line holds and refuses a class
that declares one itself. To add a ranking: its module under ``policy/rankings/`` (a
``@register``-ed :class:`policy.rankings.Ranking` subclass) and one line here.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

from moe_spec.policy import overhead as overheads

EXACT_LIMIT = 5000  # subsets an exhaustive search may score per tree-layer: C(N, B) ≤ this
MEANS_VERSION = 2  # how calibration statistics become means (policy.calibration), part of a
# calibrated result's key; 2: an expert calibration never selected gets its layer's mean energy


class Input(NamedTuple):
    """Something a ranking reads (its line's :attr:`Entry.inputs`), and what that asks of the
    one calibration step (:func:`policy.calibration.calibrate`)."""

    summary: str
    calibration: str | None = None  # "module:function" ``(stats, runs, model, read) -> stats``:
    # what a calibration for a ranking reading this input also collects (None: nothing more)


# Everything a ranking may read. Router scores, calibration statistics and a fitted artifact
# every line derives from its keyed facts (needs_calibration, uses_calibration, artifact); the
# others a ranking declares in its line's ``inputs``. Callers ask :meth:`Entry.needs` (or the
# class facts derived from it), never a ranking's name.
INPUTS: dict[str, Input] = {
    "router": Input("the tree tokens' router scores, weights and selected experts (every ranking)"),
    "calibration": Input("calibration statistics: expert-output Gram, selection counts, "
                         "per-prompt energy moments, examples (policy.calibration)"),
    "artifact": Input("a model fitted on the calibration statistics, saved beside its results"),
    "moe_inputs": Input("the tree tokens' MoE inputs h_t (RoutingBatch.hidden: open- and "
                        "closed-loop replay and the online budget attach them to every batch); "
                        "its calibration carries the surrogate's least-squares sums",
                        calibration="moe_spec.policy.rankings.sketch:with_surrogate_sums"),
    "executed_outputs": Input("the inner products of the outputs of the experts earlier passes "
                              "executed (Ranking.observe_outputs; one state per budget)"),
    "executed_output_vectors": Input("those executed outputs themselves, not only their inner "
                                     "products (open-loop replay then gathers them)"),
}


class Entry(NamedTuple):
    module: str  # the module that registers the ranking, imported on first use
    runtime: bool  # usable inside a verification pass (needs router scores only)
    summary: str  # one line, shown in --help
    version: int = 1  # raised when what it returns changes: stored results of an older
    # definition are never reused (the history is kept beside its line)
    needs_calibration: bool = False  # fit() needs calibration statistics
    uses_calibration: bool = False  # fit() uses calibration when given, without needing it;
    # its results are then keyed by the calibration runs
    artifact: str | None = None  # the file fit() learns, saved beside its results
    stateful: bool = False  # its orders depend on earlier passes of the prompt (observe())
    subset_limit: int | None = None  # evaluates budget B only while C(N, B) ≤ this
    examples: bool = False  # its calibration collects examples (oracle orders) to learn from
    ablation_step: int | None = None  # place in the ablation ladder analysis shows (1 = first)
    skip_message: str | None = None  # why the CLI skips budgets; ``{limit}``: the class's limit
    overhead: Callable[[int, int], overheads.Overhead] | None = None  # (N, H) -> what it adds
    # to every verification pass (policy.overhead); None: nothing
    token_aware_starts: bool = False  # starts from the token-aware rankings' shortlists where
    # the calibration carries those sums: its results are keyed by whether it did
    inputs: tuple[str, ...] = ()  # what it reads beyond router scores, calibration and its
    # artifact (names of INPUTS): "moe_inputs", "executed_outputs", ...

    def needs(self) -> frozenset[str]:
        """Every input (:data:`INPUTS`) the ranking reads: router scores, calibration where it
        needs or uses one, its artifact, and what its line declares."""
        return frozenset({"router", *self.inputs}
                         | ({"calibration"} if self.needs_calibration or self.uses_calibration
                            else set()) | ({"artifact"} if self.artifact else set()))

    @property
    def needs_hidden(self) -> bool:
        """Reads the tree tokens' MoE inputs h_t; its calibration then carries the surrogate's
        least-squares sums (:func:`surrogate_sums`)."""
        return "moe_inputs" in self.inputs

    @property
    def observes_outputs(self) -> bool:
        """Reads what earlier passes executed (``observe_outputs``)."""
        return "executed_outputs" in self.inputs

    @property
    def observes_output_vectors(self) -> bool:
        """... the executed outputs themselves, not only their inner products."""
        return "executed_output_vectors" in self.inputs


RANKINGS: dict[str, Entry] = {
    "router": Entry("moe_spec.policy.rankings.router", True,
                    "router mass summed over the tree's tokens (MoE-Spec)"),
    "static": Entry("moe_spec.policy.rankings.static", True,
                    "calibration selection counts per layer (input-independent)",
                    needs_calibration=True),
    "coact": Entry("moe_spec.policy.rankings.coact", True,
                   "co-activation-aware: mixing weights x calibration expert-output Gram "
                   "(this project; under substitution, predicted substitution error)",
                   version=3, needs_calibration=True, ablation_step=3),
    # 2: substitution picks by the predicted substitution error; 3: under truncation, selected
    # experts first
    "sqmass": Entry("moe_spec.policy.rankings.sqmass", True,
                    "squared mixing mass sum_t g_i(t)^2 (coact with G = I: ablation)",
                    version=2, ablation_step=1),  # 2: under truncation, selected experts first
    "coact-diag": Entry("moe_spec.policy.rankings.coact_diag", True,
                        "squared mixing mass x calibration output energy G_ii (coact "
                        "without co-activation: ablation)", version=2,
                        needs_calibration=True, ablation_step=2),
    # 2: under truncation, selected experts first
    "coact-online": Entry("moe_spec.policy.rankings.coact_online", True,
                          "coact with G refined from the outputs of experts the prompt's "
                          "earlier passes executed", version=3, needs_calibration=True,
                          stateful=True, ablation_step=4,
                          inputs=("executed_outputs",)),  # versions: coact's
    "coact-prior": Entry("moe_spec.policy.rankings.coact_prior", True,
                         "coact-online with each expert's calibration energy shrunk toward its "
                         "layer mean, the strength chosen per layer from the calibration's "
                         "prompt-to-prompt energy spread", version=3,
                         needs_calibration=True, stateful=True,
                         inputs=("executed_outputs",)),  # versions: coact's
    "learned": Entry("moe_spec.policy.rankings.learned", True,
                     "gradient-boosted score per expert from router and calibration "
                     "features, trained to reproduce the oracle's order", version=4,
                     needs_calibration=True, artifact="learned.skops", examples=True,
                     ablation_step=5),
    # 2: substitution picks by the predicted substitution error; 3: under truncation, selected
    # experts first; 4: the oracle orders it learns from, under group-limited substitution, by
    # the incremental greedy and screened swaps (oracle 8)
    "sketch": Entry("moe_spec.policy.rankings.sketch", True,
                    "the oracle's search on expert outputs predicted from the tree tokens' MoE "
                    "inputs h_t by rank-r calibration surrogates (without surrogate or h_t: "
                    "coact-prior's shortlists, with a warning; bench/sketch_gap.py)",
                    version=3, needs_calibration=True, artifact="sketch.npz", inputs=("moe_inputs",),
                    overhead=lambda n, h: overheads.surrogate(n, h, overheads.SKETCH_RANK)),
    # 2: the surrogate's rank 16 -> 4 (policy.overhead.SKETCH_RANK: the same gap closed, a
    # quarter of the bytes); 3 (and sketch-post, sketch-gated 2): the oracle's search it runs,
    # under group-limited substitution, by the incremental greedy and screened swaps (oracle 8)
    "sketch-post": Entry("moe_spec.policy.rankings.sketch_post", True,
                         "sketch whose surrogates learn during the prompt: the posterior mean of "
                         "the calibration fit and each expert's last executed (h, E(h)) pairs",
                         version=2, needs_calibration=True, artifact="sketch.npz",
                         stateful=True, overhead=lambda n, h: overheads.posterior_surrogate(
                             n, h, overheads.SKETCH_RANK, overheads.POSTERIOR_WINDOW),
                         inputs=("moe_inputs", "executed_outputs", "executed_output_vectors")),
    "sketch-gated": Entry("moe_spec.policy.rankings.sketch_gated", True,
                          "sketch on tree-layers whose MoE inputs lie near its calibration's "
                          "(novelty under the calibration's input covariance <= 3), "
                          "coact-prior's shortlists elsewhere", version=2,
                          needs_calibration=True, stateful=True,
                          overhead=lambda n, h: overheads.gated_surrogate(n, h),
                          inputs=("moe_inputs", "executed_outputs")),
    "previous": Entry("moe_spec.policy.rankings.previous", True,
                      "experts loaded by the previous pass at the layer first, then router mass",
                      version=2, stateful=True),  # 2: under truncation, selected experts first
    # examples: the oracle starts from every runtime ranking's shortlist, learned's included
    "oracle": Entry("moe_spec.policy.rankings.oracle", False,
                    "best shortlist found with every expert's output (offline reference): exact "
                    "where C(N,B) is small, else every runtime ranking's shortlist and the "
                    "greedies, improved by swaps", version=8, uses_calibration=True,
                    examples=True, token_aware_starts=True),
    # 2: substitution takes the best of three candidates, 3: of four, 4: exact search where it
    # fits, every runtime ranking's shortlist as a start, then swap local search, 5: the swaps
    # screened in closed form (all of them, not the 12 strongest outside), then verified;
    # 6: sketch-post (stateful, token-aware) among the stateful starts where the calibration
    # carries the surrogate's sums; 7: sketch-gated likewise; 8: its key says whether those
    # token-aware starts ran (token_aware_starts; earlier keys did not, so a weaker cell could
    # answer for a stronger one), and group-limited substitution (DeepSeek) is searched like
    # every rule: the incremental greedy and every swap screened in closed form, in the
    # token's substitution order (was: every candidate scored, swaps among the 12 strongest;
    # 18x faster and a lower error at every budget on tiny-deepseek-v3)
    # uses_calibration: fitted with calibration it also starts from the calibrated runtime
    # rankings' shortlists
    "exact": Entry("moe_spec.policy.rankings.exact", False,
                   "exhaustive search over all B-subsets while C(N, B) is small (offline only)",
                   subset_limit=EXACT_LIMIT,
                   skip_message="C(N, B) exceeds its limit of {limit} subsets"),
}

# The runtime ranking to use when in doubt (issue 40; docs/results.md, "sketch-gated"): with a
# calibration of several domains it is sketch (the gate lets every tree-layer through: the same
# cells and net saving to 0.03 experts), which closed more of the gap than coact-prior in every
# cell measured and kept 83-90% of the oracle's saving net of its own bytes at the real shapes;
# with one distant benchmark it holds tiny-olmoe's cells where sketch missed (worst 58%) and
# keeps more of the oracle's saving than sketch and coact-prior on tiny-olmoe and tiny-gpt-oss,
# but not on tiny-qwen3-moe under substitution (43% against coact-prior's 56%), where its
# coact-prior fallback is weak. --help says so.
RECOMMENDED = "sketch-gated"
# The one to use where no surrogate can be read (the tree's MoE inputs are not at hand when the
# shortlist is chosen, or the surrogate's bytes cannot be afforded: at a tiny model's shape they
# outweigh what it saves): it held across domains at the tightest budgets with a calibration of
# one distant benchmark and costs no bytes (issue 28; docs/results.md, "One selector across
# domains").
RECOMMENDED_WITHOUT_SURROGATE = "coact-prior"

COVERAGES: dict[str, str] = {
    "truncation": "natural top-k, experts outside the budget dropped (weights not renormalised)",
    "substitution": "the model's own routing rule within the budget (needs B >= k)",
}

SKIPPED = "the ranking cannot evaluate them"  # a skip_message for rankings that name none


def skipped_budgets(name: str, n: int, budgets) -> list[int]:
    """The budgets of ``budgets`` ranking ``name`` cannot evaluate for N = ``n`` experts (those
    past its ``subset_limit``), reported by the CLIs, never silently dropped."""
    limit = RANKINGS[name].subset_limit
    return [b for b in budgets if limit is not None and math.comb(n, b) > limit]


def overhead(name: str, n: int, hidden: int) -> overheads.Overhead:
    """What ranking ``name`` adds to every verification pass of a model with N = ``n`` experts of
    hidden size ``hidden`` (:mod:`policy.overhead`; nothing for most rankings, and for names this
    table does not hold, e.g. a routing-only import's)."""
    entry = RANKINGS.get(name)
    if entry is None or entry.overhead is None:
        return overheads.NONE
    return entry.overhead(n, hidden)


def min_budget(coverage: str, k: int) -> int:
    """The smallest budget coverage policy ``coverage`` evaluates for top-k routing: k under
    substitution (every token runs k experts of S), 1 under truncation."""
    if coverage not in COVERAGES:
        raise ValueError(f"unknown coverage {coverage!r}; use one of {', '.join(COVERAGES)}")
    return k if coverage == "substitution" else 1


def surrogate_sums(rankings) -> bool:
    """Whether a replay or capture of ``rankings`` attaches the surrogate's least-squares sums
    to its calibration statistics: when one of them reads the tree tokens' MoE inputs
    (``needs_hidden``). Those sums are large (N·H·(H+1) float64 numbers a layer), so they are
    collected only then; a ranking with ``token_aware_starts`` (the oracle) starts from the
    token-aware rankings' shortlists only then, and its results' key says so."""
    return any(RANKINGS[r].needs_hidden for r in rankings if r in RANKINGS)


def calibration_steps(rankings) -> list[str]:
    """What a calibration for ``rankings`` collects beyond the statistics every calibration
    has: the :attr:`Input.calibration` step of each input one of them reads, in
    :data:`INPUTS`' order, each once (``module:function`` names, imported by
    :func:`policy.calibration.calibrate`)."""
    needed = set().union(*(RANKINGS[r].needs() for r in rankings if r in RANKINGS))
    return [i.calibration for name, i in INPUTS.items() if name in needed and i.calibration]


def ranking_names(*, runtime: bool | None = None) -> list[str]:
    """Rankings (runtime ones first, then by name), optionally only runtime or only offline."""
    found = [n for n, e in RANKINGS.items() if runtime is None or e.runtime == runtime]
    return sorted(found, key=lambda n: (not RANKINGS[n].runtime, n))


RECOMMENDATION_TAGS = {RECOMMENDED: " [recommended]",
                       RECOMMENDED_WITHOUT_SURROGATE: " [recommended without a surrogate]"}


def ranking_help(*, runtime: bool | None = None) -> str:
    """One clause per ranking, for --help; the :data:`RECOMMENDED` one and the
    :data:`RECOMMENDED_WITHOUT_SURROGATE` one say so."""
    return "; ".join(f"{n}: {RANKINGS[n].summary}" + RECOMMENDATION_TAGS.get(n, "")
                     for n in ranking_names(runtime=runtime))


def needs_examples(rankings) -> bool:
    """Whether a calibration for these rankings collects examples (some ranking's ``examples``)."""
    return any(RANKINGS[name].examples for name in rankings if name in RANKINGS)


def ablation_ladder() -> tuple[str, ...]:
    """The rankings with an ablation step, in the ladder's order (analysis's ablation table)."""
    steps = {name: e.ablation_step for name, e in RANKINGS.items() if e.ablation_step is not None}
    return tuple(sorted(steps, key=steps.__getitem__))


def skip_reason(name: str, limit: int | None = None) -> str:
    """What the CLI says when ``name`` skips budgets: its ``skip_message`` (``{limit}`` filled
    in), or :data:`SKIPPED`."""
    message = RANKINGS[name].skip_message if name in RANKINGS else None
    return SKIPPED if message is None else message.format(limit=limit)


def coverage_help() -> str:
    return "; ".join(f"{n}: {s}" for n, s in COVERAGES.items())


# --- budget modes (issue 63): the key column ``budget_mode`` of every replay result row ---------
FIXED = "fixed"  # the same B at every layer of every pass (and how rows stored before read)
ADAPTIVE = "adaptive"  # the price rule of policy.adaptive, at a mean budget B̄
CAP_SUFFIX = "+cap"  # with a hard cap on a pass's total
PACE_SUFFIX = "+pace"  # paced: the price follows a running deficit (policy.adaptive, pacing)
# whose deficit a paced rule keeps: each prompt's (restarted with it), or the run's (carried
# from prompt to prompt in the order they are served); the run's is its own budget mode
PACE_SCOPES: dict[str, str] = {"prompt": PACE_SUFFIX, "run": "+pace-run"}
# gain predictors of the adaptive mode by name, for the command lines without torch
# (policy.adaptive.PREDICTORS owns them; tests/test_adaptive_replay.py checks the two agree)
GAIN_PREDICTORS: dict[str, str] = {
    "mass": "the router mass share of the ranking's next expert",
    "calibrated": "that mass scaled per layer and budget to the error on the calibration run "
                  "(every expert's output computed there)",
    "surrogate": "the error the sketch family's surrogate predicts for the ranking's own "
                 "shortlists (calibrated mass where none ran)",
}


def adapts(ranking: str, executes: bool = False) -> bool:
    """Whether ``ranking`` can run adaptive budgets: it ranks every budget B_min..N of a layer
    at once (no budget-limited search). A ranking that learns from what earlier passes executed
    (coact-online, coact-prior, sketch-gated, sketch-post) adapts only where the adaptive
    budget's own passes execute (``executes``: closed-loop replay, capture's online budget):
    there its one state per mean budget B̄ observes exactly what its layers ran at their own
    B_l. Open-loop replay executes nothing, so it would have no such state to keep."""
    entry = RANKINGS[ranking]
    learns = bool({"executed_outputs", "executed_output_vectors"} & entry.needs())
    return entry.subset_limit is None and (executes or not learns)


def budget_mode(predictor: str | None = None, cap: bool = False,
                paced: str | None = None) -> str:
    """``fixed``, or ``adaptive:<predictor>`` (``+cap`` with a pass cap, then ``+pace`` when
    paced per prompt, ``+pace-run`` over the run: ``paced`` is a :data:`PACE_SCOPES` name)."""
    if predictor is None:
        return FIXED
    return f"{ADAPTIVE}:{predictor}" + (CAP_SUFFIX if cap else "") + (
        PACE_SCOPES[paced] if paced else "")


def carries_across_prompts(mode: str | None) -> bool:
    """Whether a budget mode keeps state from one prompt to the next (paced over the run): a
    prompt's results then depend on the prompts before it, so a replay interrupted part way
    computes its block again from the first prompt rather than resuming prompt by prompt."""
    return budget_mode_parts(mode)[2] == "run"


def budget_mode_parts(mode: str | None) -> tuple[str | None, bool, str | None]:
    """``(predictor, capped, paced)`` of a budget mode name, ``paced`` the :data:`PACE_SCOPES`
    name or None (None: fixed, as a missing one reads)."""
    if mode in (None, FIXED):
        return None, False, None
    kind, _, rest = mode.partition(":")
    paced = next((scope for scope, suffix in PACE_SCOPES.items() if rest.endswith(suffix)), None)
    rest = rest.removesuffix(PACE_SCOPES[paced]) if paced else rest
    capped = rest.endswith(CAP_SUFFIX)
    predictor = rest.removesuffix(CAP_SUFFIX)
    if kind != ADAPTIVE or predictor not in GAIN_PREDICTORS:
        raise ValueError(f"unknown budget mode {mode!r}")
    return predictor, capped, paced
