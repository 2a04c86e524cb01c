"""What a replay is asked and what is stored already: everything ``replay`` decides before torch
loads (and, for a replay whose every cell is stored, all it needs: :func:`stored_outcome`).

Importing this module imports neither torch nor the model code; :mod:`replay.run` re-exports
its names. The rankings' and coverage policies' facts that results are keyed by (versions, what
they need, budgets they skip) live in :mod:`policy`, which imports torch: :func:`policy_facts`
keeps them in a small cache keyed by the digest of the ``policy`` package's source, so a replay
answered from stored results never imports torch once the cache holds them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from moe_spec.catalog import Catalog, Run, location
from moe_spec.catalog.results import UnitResults
from moe_spec.errors import UserError
from moe_spec.replay import modes
from moe_spec.replay.modes import ReplayMode, storage_note, stored_layers  # noqa: F401 - (re-exported)

TABLES = {name: mode.table for name, mode in modes.MODES.items()}

# the paper's budget grids (MoE-Spec, Fig. 5) by number of experts
SWEEPS = {64: list(range(8, 57, 8)), 128: [16, 24, 32, 48, 64], 8: list(range(2, 8))}


class ReplayError(UserError, RuntimeError):
    """Bad or missing input; the message is one line for the user."""


def parse_budgets(spec: str, n: int) -> list[int]:
    """``24``, ``8,16,32``, ``8:56:8`` (inclusive) or ``sweep`` (the paper's grid for N)."""
    if spec == "sweep":
        if n in SWEEPS:
            return SWEEPS[n]
        step = max(1, n // 8)
        return list(range(step, n, step))
    try:
        if ":" in spec:
            parts = [int(x) for x in spec.split(":")]
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] < 1):
                raise ValueError(spec)
            lo, hi, *st = parts
            values = list(range(lo, hi + 1, st[0] if st else 1))
        else:
            values = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ReplayError(f"cannot read --budget {spec!r}; use 24, 8,16,32, 8:56:8 or sweep") \
            from None
    bad = [b for b in values if not 1 <= b <= n]
    if bad or not values:
        raise ReplayError(f"--budget {spec!r} is out of range: budgets must be within 1..{n}")
    return sorted(set(values))


@dataclass(frozen=True)
class ReplayRequest:
    rankings: tuple[str, ...] = ("router", "oracle")
    coverages: tuple[str, ...] = ("truncation", "substitution")
    budgets: tuple[int, ...] = (24,)
    layers: tuple[int, ...] | None = None  # None: every MoE layer
    mode: ReplayMode | str = "open"  # a mode object, or its --mode name
    batch_size: int = 1  # > 1: one shortlist per (virtual) batch pass (replay.virtual_batch)
    batch_seed: int = 0  # how b = 1 runs' prompts are grouped into virtual batches

    def __post_init__(self):
        object.__setattr__(self, "mode", modes.batched(self.mode, self.batch_size,
                                                       self.batch_seed))


@dataclass
class ReplayOutcome:
    units: list[UnitResults] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)  # runs answered entirely from stored results
    skipped: dict[str, list[int]] = field(default_factory=dict)  # ranking -> budgets it cannot do
    notes: list[str] = field(default_factory=list)  # what partially stored runs lack
    tree_layers: int = 0  # computed now (open loop)
    trees: int = 0  # re-verified now (closed loop)
    seconds: float = 0.0
    start_seconds: float = 0.0  # of which: starting Ray actors and loading their models


UNIT_IDENTITY = ("mode", "ranking", "coverage", "calibration", "batch_size", "batch_seed")
# (the rest of a key is versions)


def run_layers_noted(run, layers: list[int], mode: ReplayMode | str,
                     outcome: ReplayOutcome) -> list[int]:
    """The layers of ``run`` a replay in ``mode`` can score (open loop: those whose MoE inputs
    the storage policy kept), noting in ``outcome`` what the policy left out. A routing-only
    run (imported top-k ids) has nothing to replay: refused in one line."""
    if getattr(run, "routing_only", False):
        raise ReplayError(run.refusal("nothing to replay (no hidden states: no error to measure)"))
    return modes.get(mode).scored_layers(run, layers, outcome.notes)


def unit_key(mode: ReplayMode | str, ranking, cover, calibration: list[Run],
             means: int | None = None, dtype: str = "float32") -> dict:
    """What makes results comparable; calibration only where the ranking uses it, with the
    version of how statistics become means (results of an older definition are not reused),
    and the dtype the model was loaded in where it is not float32 (weights rounded to bf16 give
    other numbers). ``ranking``: a :class:`policy.rankings.Ranking` class or its
    :class:`RankingFacts`; ``cover``: anything with the coverage's ``name``; ``means``:
    MEANS_VERSION (read from :mod:`policy.calibration` when not given)."""
    if means is None and (ranking.needs_calibration or ranking.uses_calibration):
        from moe_spec.policy.calibration import MEANS_VERSION as means
    mode = modes.get(mode)
    key = dict(mode=mode.name, ranking=ranking.name, coverage=cover.name, calibration=[],
               **mode.key())
    if ranking.version != 1:  # (version 1 is left out: keys of unchanged rankings stay as they were)
        key["version"] = ranking.version
    if ranking.needs_calibration or (ranking.uses_calibration and calibration):
        key.update(calibration=sorted([r.name, r.run_id] for r in calibration),
                   means=means)
    dtype = str(dtype).removeprefix("torch.")
    if dtype != "float32":
        key["dtype"] = dtype
    return key


def stored_variants(out: Path, table: str, run: Run) -> list[tuple[dict, "UnitResults"]]:
    """(unit key, its results) of every result unit stored for ``run`` in ``table``."""
    found = []
    base = location.root(out) / table
    from moe_spec.catalog import partition_value
    folder = base / f"model={partition_value(run.model)}" / f"bench={run.bench}" / \
        f"run={run.name}"
    for path in sorted(folder.glob("config=*/_config.json")):
        try:
            unit = json.loads(path.read_text())["unit"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(unit, dict):
            found.append((unit, UnitResults(out, table, run, unit)))
    return found


def calibrated_variant(catalog: Catalog, out: Path, run: Run, key: dict,
                       wanted: set) -> UnitResults | None:
    """For a unit asked without calibration (``key``) whose ranking can use one: a stored
    variant that differs only by its calibration (runs still current) and holds every
    ``wanted`` cell; the most recently computed. None when there is none."""
    current = {r.name: r.run_id for r in catalog.runs(model=run.model, roles=None)}
    best = None
    for unit, results in stored_variants(out, results_table(key), run):
        cal = unit.get("calibration") or []
        rest = {k: v for k, v in unit.items() if k not in ("calibration", "means", "layout")}
        mine = {k: v for k, v in key.items() if k not in ("calibration", "means", "layout")}
        if not cal or rest != mine or any(current.get(n) != rid for n, rid in cal):
            continue
        blocks = results.complete_blocks()
        done = set().union(*(b.cells() for b in blocks)) if blocks else set()
        if wanted <= done:
            stamp = max((b.committed_at or "" for b in blocks), default="")
            if best is None or stamp > best[0]:
                best = (stamp, results)
    return None if best is None else best[1]


def stored_calibrated(catalog: Catalog, out: Path, run: Run, unit: UnitResults, ranking,
                      calibration: list[Run], layers: list[int] | None,
                      budgets: list[int]) -> UnitResults | None:
    """For a ranking that can use calibration, asked without: a stored calibrated variant of
    ``run`` holding every cell asked for, when the uncalibrated ``unit`` does not (the design
    card's ``replay --ranking oracle`` after a calibrated sweep); else None. ``ranking``: its
    class or its :class:`RankingFacts`."""
    if calibration or ranking.needs_calibration or not ranking.uses_calibration:
        return None
    wanted = {(layer, b) for layer in (layers or [None]) for b in budgets}
    done = set().union(*(b.cells() for b in unit.complete_blocks()))
    if wanted <= done:
        return None
    return calibrated_variant(catalog, out, run, unit.unit, wanted)


def answered_note(name: str, cover: str, run: Run, other: UnitResults) -> str:
    """What replay says when a stored calibrated variant answers for an uncalibrated request."""
    return (f"{name}, {cover}, run {run.name}: answered from the stored variant "
            f"{variant_text(other.unit)} (pass --calibration to choose one)")


def results_table(key: dict) -> str:
    """The result table a unit key's mode writes."""
    mode = modes.get(key["mode"])
    if key.get("batch_size", 1) > 1:
        mode = modes.batched(mode, key["batch_size"], key.get("batch_seed", 0))
    return mode.table


def variant_text(unit: dict) -> str:
    """A unit key in words: ranking (version), coverage, calibration, dtype, batch seed."""
    words = [unit.get("ranking", "?") + (f" v{unit['version']}" if unit.get("version") else ""),
             unit.get("coverage", "?")]
    cal = unit.get("calibration") or []
    words.append("calibrated on " + ", ".join(c[0] for c in cal) if cal else "no calibration")
    if unit.get("dtype"):
        words.append(f"model in {unit['dtype']}")
    if unit.get("batch_size", 1) > 1:
        words.append(f"batches of {unit['batch_size']} (seed {unit.get('batch_seed', 0)})")
    return ", ".join(words)


def summary_frame(outcome: ReplayOutcome, request: ReplayRequest):
    """Mean metrics per run × ranking × coverage × budget over the requested cells (a polars
    DataFrame; runs are never pooled: their settings may differ), or None when no cell is
    stored."""
    import polars as pl
    frames = []
    for u in outcome.units:
        files = u.parts(list(request.layers) if request.layers else None, list(request.budgets))
        if files:
            frames.append(location.read_frame(files).with_columns(run=pl.lit(u.run.name)))
    if not frames:
        return None
    df = pl.concat(frames, how="diagonal_relaxed")
    df = df.filter(pl.col("budget").is_in(list(request.budgets)))
    if request.layers and "layer" in df.columns:
        df = df.filter(pl.col("layer").is_in(list(request.layers)))
    keys = ["run", "ranking", "coverage", "budget"]
    return df.group_by(keys).agg(request.mode.summary_aggregates()).sort(keys)


# --- the policy facts results are keyed by, without importing torch -----------------------------
FACTS_VERSION = 1  # of the cache files' layout
@dataclass(frozen=True)
class RankingFacts:
    """What :func:`unit_key` and the planner read from a ranking class."""

    name: str
    version: int
    needs_calibration: bool
    uses_calibration: bool
    artifact: str | None
    skipped: tuple[int, ...]  # budgets 1..N the ranking cannot evaluate for these N
    limit: int | None = None  # of subsets searched (exact), named when budgets are skipped


@dataclass(frozen=True)
class Named:
    name: str  # a coverage policy, for unit_key


@dataclass(frozen=True)
class PolicyFacts:
    rankings: dict[str, RankingFacts]
    min_budget: dict[str, int]  # coverage -> smallest budget for this top-k
    means: int  # policy.calibration.MEANS_VERSION


def policy_digest() -> str:
    """Digest of the ``policy`` package's source: the facts change only with it."""
    from moe_spec import policy
    h = hashlib.sha256()
    for root in policy.__path__:
        for path in sorted(Path(root).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe-spec-workbench"


def policy_facts(n: int, k: int) -> PolicyFacts:
    """The rankings' and coverage policies' facts for N experts and top-k: from the cache when
    it holds this policy source's, else from :mod:`policy` (importing torch) and cached."""
    path = cache_dir() / f"policy-facts-v{FACTS_VERSION}-{policy_digest()}-N{n}-k{k}.json"
    try:
        raw = json.loads(path.read_text())
        return PolicyFacts({name: RankingFacts(**{**f, "skipped": tuple(f["skipped"])})
                            for name, f in raw["rankings"].items()},
                           raw["min_budget"], raw["means"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from moe_spec.policy import coverage, rankings
    from moe_spec.policy.calibration import MEANS_VERSION
    facts = PolicyFacts(
        {name: RankingFacts(name, cls.version, cls.needs_calibration, cls.uses_calibration,
                            cls.artifact, tuple(cls().skipped(n, list(range(1, n + 1)))),
                            getattr(cls, "limit", None))
         for name, cls in rankings.REGISTRY.items()},
        {name: cover.min_budget(k) for name, cover in coverage.COVERAGES.items()}, MEANS_VERSION)
    try:
        from moe_spec.catalog import atomic
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, dict(rankings={name: dict(vars(f), skipped=list(f.skipped))
                                               for name, f in facts.rankings.items()},
                                     min_budget=facts.min_budget, means=facts.means))
    except OSError:
        pass  # a cache that cannot be written costs the next replay a second, nothing else
    return facts


def stored_outcome(catalog: Catalog, runs: list[Run], request: ReplayRequest,
                   calibration: list[str], out: Path, facts: PolicyFacts,
                   dtype: str = "float32") -> ReplayOutcome | None:
    """The outcome of ``request`` when every cell it asks for is stored already (complete
    blocks of the current captures), found without the model, torch or writing anything; None
    when anything is missing (or cannot be told from the manifests), and
    :func:`replay.run.replay` plans and computes it. Mirrors that function's units."""
    manifest = runs[0].manifest
    try:
        n, moe = manifest["num_experts"], list(manifest["moe_layers"])
    except KeyError:
        return None
    layers = list(request.layers) if request.layers else moe
    if not set(layers) <= set(moe) or any(r.manifest.get("moe_layers") != moe for r in runs) \
            or any(r.manifest.get("num_experts") != n for r in runs):
        return None  # said in one line once the model is loaded
    cal = catalog.calibration_runs(calibration, runs[0].model, set().union(
        *(r.prompt_keys() for r in runs))) if calibration else []
    mode = request.mode
    outcome = ReplayOutcome()
    for run in runs:
        run_layers = run_layers_noted(run, layers, mode, outcome)
        if not run_layers:
            continue
        for name in request.rankings:
            ranking = facts.rankings[name]
            for cov_name in request.coverages:
                budgets = [b for b in request.budgets if b >= facts.min_budget[cov_name]]
                skip = [b for b in budgets if b in ranking.skipped]
                if skip:
                    outcome.skipped.setdefault(name, sorted(set(skip)))
                budgets = [b for b in budgets if b not in skip]
                if not budgets:
                    continue
                key = unit_key(mode, ranking, Named(cov_name), cal, facts.means, dtype)
                unit = UnitResults(out, mode.table, run, key)
                if ranking.artifact and not (unit.folder / ranking.artifact).exists():
                    return None
                other = stored_calibrated(catalog, out, run, unit, ranking, cal,
                                          mode.cell_layers(run_layers), budgets)
                if other is not None:  # the design card's `replay --ranking oracle` after a
                    outcome.notes.append(answered_note(name, cov_name, run, other))  # sweep
                    unit = other
                else:
                    done = set().union(*(b.cells() for b in unit.complete_blocks()))
                    wanted = {(layer, b) for layer in (mode.cell_layers(run_layers) or [None])
                              for b in budgets}
                    if not wanted <= done:
                        return None
                outcome.units.append(unit)
        outcome.reused.append(run.name)
    return outcome
