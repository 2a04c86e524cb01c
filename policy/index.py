"""What the policy package offers, by name, without importing torch.

Command-line parsers build their choices and ``--help`` from this table, so ``--help`` stays
instant; the classes themselves register in :mod:`policy.rankings` and :mod:`policy.coverage`
(imported when a run starts) and a test checks both agree. To add a ranking: its module under
``policy/rankings/``, its import in ``policy/rankings/__init__.py`` and one line here.
"""

from __future__ import annotations

from typing import NamedTuple


class Entry(NamedTuple):
    runtime: bool  # usable inside a verification pass (needs router scores only)
    summary: str  # one line, shown in --help


RANKINGS: dict[str, Entry] = {
    "router": Entry(True, "router mass summed over the tree's tokens (MoE-Spec)"),
    "static": Entry(True, "calibration selection counts per layer (input-independent)"),
    "coact": Entry(True, "co-activation-aware: mixing weights x calibration expert-output Gram "
                         "(this project; under substitution, predicted substitution error)"),
    "sqmass": Entry(True, "squared mixing mass sum_t g_i(t)^2 (coact with G = I: ablation)"),
    "coact-diag": Entry(True, "squared mixing mass x calibration output energy G_ii (coact "
                              "without co-activation: ablation)"),
    "coact-online": Entry(True, "coact with G refined from the outputs of experts the prompt's "
                                "earlier passes executed"),
    "learned": Entry(True, "gradient-boosted score per expert from router and calibration "
                           "features, trained to reproduce the oracle's order"),
    "previous": Entry(True, "experts loaded by the previous pass at the layer first, then "
                            "router mass"),
    "oracle": Entry(False, "best shortlist found with every expert's output (offline "
                           "reference): exact where C(N,B) is small, else every runtime "
                           "ranking's shortlist and the greedies, improved by swaps"),
    "exact": Entry(False, "exhaustive search over all B-subsets while C(N, B) is small "
                          "(offline only)"),
}

COVERAGES: dict[str, str] = {
    "truncation": "natural top-k, experts outside the budget dropped (weights not renormalised)",
    "substitution": "the model's own routing rule within the budget (needs B >= k)",
}


def ranking_names(*, runtime: bool | None = None) -> list[str]:
    """Rankings (runtime ones first, then by name), optionally only runtime or only offline."""
    found = [n for n, e in RANKINGS.items() if runtime is None or e.runtime == runtime]
    return sorted(found, key=lambda n: (not RANKINGS[n].runtime, n))


def ranking_help(*, runtime: bool | None = None) -> str:
    """One clause per ranking, for --help."""
    return "; ".join(f"{n}: {RANKINGS[n].summary}" for n in ranking_names(runtime=runtime))


def coverage_help() -> str:
    return "; ".join(f"{n}: {s}" for n, s in COVERAGES.items())
