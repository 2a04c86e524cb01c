"""What a replay is asked and what is stored already: the one plan ``replay`` makes before torch
loads (and, for a replay whose every cell is stored, all it needs).

    plan(catalog, runs, request, calibration, out, n, k, layers)  →  ReplayPlan
        per run × ranking × coverage: its result unit, the budgets it evaluates (those the
        coverage accepts for top-k and the ranking can do for N), and what is stored: every
        cell, a stored calibrated variant that answers for it, or cells still missing
    ReplayPlan.complete   → the answer without the model (:func:`manifest_plan`)
    otherwise             → :func:`replay.run.replay` executes the plan: locks the pending units
                            and computes their missing blocks (the same plan, when the loaded
                            model has the N, k, layers and dtype it was made for: a command
                            plans once)

Importing this module imports neither torch nor the model code; :mod:`replay.run` re-exports
its names. The facts results are keyed by (a ranking's version, whether it needs or uses
calibration, the file it saves, the budgets it skips; a coverage's smallest budget) are read from
:mod:`policy.index`, their one owner, which imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_spec.catalog import Catalog, Run, location
from moe_spec.catalog.results import UnitResults
from moe_spec.catalog.runs import CatalogError, read_json_file
from moe_spec.errors import UserError
from moe_spec.policy import index
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
    budget_mode: str = index.FIXED  # or adaptive:<predictor>[+cap][+pace|+pace-run]: means B̄
    pass_cap: float | None = None  # adaptive with a cap: a pass's total ≤ cap · B̄ · L
    pace: float | None = None  # adaptive, paced: η of the running deficit (policy.adaptive)

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


UNIT_IDENTITY = ("mode", "ranking", "coverage", "calibration", "batch_size", "budget_mode")
SIDE_BY_SIDE = ("batch_seed", "token_aware_starts", "dtype", "pass_cap", "pace")  # variants of
# one definition, kept together (the views choose one a cell: analysis.sql); the rest of a key is versions: a
# unit of a newer one supersedes every older unit of the same identity, whatever its variant


def run_layers_noted(run, layers: list[int], mode: ReplayMode | str,
                     outcome: ReplayOutcome) -> list[int]:
    """The layers of ``run`` a replay in ``mode`` can score (open loop: those whose MoE inputs
    the storage policy kept), noting in ``outcome`` what the policy left out. A routing-only
    run (imported top-k ids) has nothing to replay: refused in one line."""
    if getattr(run, "routing_only", False):
        raise ReplayError(run.refusal("nothing to replay (no hidden states: no error to measure)"))
    return modes.get(mode).scored_layers(run, layers, outcome.notes)


def unit_key(mode: ReplayMode | str, ranking: str, coverage: str, calibration: list[Run],
             dtype: str = "float32", surrogate_sums: bool = False,
             budget_mode: str = index.FIXED, pass_cap: float | None = None,
             pace: float | None = None) -> dict:
    """What makes results comparable; calibration only where the ranking uses it, with the
    version of how statistics become means (results of an older definition are not reused),
    and the dtype the model was loaded in where it is not float32 (weights rounded to bf16 give
    other numbers); for a ranking with ``token_aware_starts`` (the oracle), whether the
    calibration carried the surrogate's sums (``surrogate_sums``:
    :func:`policy.index.surrogate_sums` of the rankings replayed together), so that it started
    from the token-aware rankings too. An adaptive ``budget_mode`` (its price λ calibrated on
    the calibration runs, whatever the ranking) adds the mode, the calibration and any
    ``pass_cap`` and ``pace``; fixed budgets leave the key as it was (results stored before the budget mode
    existed are fixed). The ranking's facts come from its line in :mod:`policy.index`."""
    entry = index.RANKINGS[ranking]
    mode = modes.get(mode)
    key = dict(mode=mode.name, ranking=ranking, coverage=coverage, calibration=[],
               **mode.key())
    if entry.version != 1:  # (version 1 is left out: keys of unchanged rankings stay as they were)
        key["version"] = entry.version
    if entry.needs_calibration or (entry.uses_calibration and calibration):
        key.update(calibration=sorted([r.name, r.run_id] for r in calibration),
                   means=index.MEANS_VERSION)
        if entry.token_aware_starts and surrogate_sums:
            key["token_aware_starts"] = True
    if budget_mode != index.FIXED:
        key.update(budget_mode=budget_mode,
                   calibration=sorted([r.name, r.run_id] for r in calibration))
        if pass_cap is not None:
            key["pass_cap"] = pass_cap
        if pace is not None:
            key["pace"] = pace
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
            unit = read_json_file(path, "replay result config", "")["unit"]
        except (CatalogError, KeyError, TypeError):
            continue
        if isinstance(unit, dict):
            found.append((unit, UnitResults(out, table, run, unit)))
    return found


CALIBRATION_FIELDS = ("calibration", "means", "layout", "token_aware_starts")  # key fields
# that follow from a calibration: an uncalibrated request may be answered whatever they say


def calibrated_variant(catalog: Catalog, out: Path, run: Run, key: dict,
                       wanted: set) -> UnitResults | None:
    """For a unit asked without calibration (``key``) whose ranking can use one: a stored
    variant that differs only by its calibration (runs still current) and holds every
    ``wanted`` cell: the oracle's with the token-aware starts where there is one (the stronger
    search, as the default views prefer), then the most recently computed. None when there is
    none."""
    current = {r.name: r.run_id for r in catalog.runs(model=run.model, roles=None)}
    best = None
    for unit, results in stored_variants(out, results_table(key), run):
        cal = unit.get("calibration") or []
        rest = {k: v for k, v in unit.items() if k not in CALIBRATION_FIELDS}
        mine = {k: v for k, v in key.items() if k not in CALIBRATION_FIELDS}
        if not cal or rest != mine or any(current.get(n) != rid for n, rid in cal):
            continue
        blocks = results.complete_blocks()
        done = set().union(*(b.cells() for b in blocks)) if blocks else set()
        if wanted <= done:
            rank = (bool(unit.get("token_aware_starts")),
                    max((b.committed_at or "" for b in blocks), default=""))
            if best is None or rank > best[0]:
                best = (rank, results)
    return None if best is None else best[1]


def stored_calibrated(catalog: Catalog, out: Path, run: Run, unit: UnitResults, ranking: str,
                      calibration: list[Run], wanted: set, done: set) -> UnitResults | None:
    """For a ranking that can use calibration, asked without: a stored calibrated variant of
    ``run`` holding every ``wanted`` cell, when the uncalibrated ``unit`` does not (``done``:
    its stored cells; the design card's ``replay --ranking oracle`` after a calibrated sweep);
    else None."""
    entry = index.RANKINGS[ranking]
    if calibration or entry.needs_calibration or not entry.uses_calibration or wanted <= done:
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
    if unit.get("token_aware_starts"):
        words.append("with the token-aware starts")
    if unit.get("dtype"):
        words.append(f"model in {unit['dtype']}")
    if unit.get("batch_size", 1) > 1:
        words.append(f"batches of {unit['batch_size']} (seed {unit.get('batch_seed', 0)})")
    if unit.get("budget_mode", index.FIXED) != index.FIXED:
        extra = ([f"pass cap {unit['pass_cap']:g}·B̄·L"] if unit.get("pass_cap") else []) + (
            [f"pace η {unit['pace']:g}"] if unit.get("pace") is not None else [])
        words.append(f"budgets {unit['budget_mode']}" + (f" ({', '.join(extra)})" if extra else ""))
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


# --- the plan -------------------------------------------------------------------------------------
@dataclass
class UnitPlan:
    """One ranking × coverage of one run: its result unit, the budgets it evaluates, and what is
    stored as planned: ``answered_by`` a stored calibrated variant holding every cell (then
    nothing is computed for it), else ``missing`` whether a cell (or the file the ranking saves
    beside its results) is not stored yet."""

    ranking: str
    coverage: str
    unit: UnitResults
    budgets: list[int]
    answered_by: UnitResults | None = None
    missing: bool = False


@dataclass
class RunPlan:
    run: Run
    layers: list[int]  # the layers the run can be scored at (storage policy applied)
    units: list[UnitPlan]

    @property
    def pending(self) -> bool:
        return any(u.missing for u in self.units)


@dataclass
class ReplayPlan:
    """Every run's units (:func:`plan`) and what planning noted (skipped budgets, notes)."""

    request: ReplayRequest
    calibration: list[Run]
    out: Path  # where results are written
    runs: list[RunPlan]
    outcome: ReplayOutcome  # skipped and notes so far; units and reuse added when answered
    made_for: tuple = ()  # (N, k, layers, dtype) it was planned for (:meth:`fits`)

    def fits(self, n: int, k: int, layers: list[int], dtype: str) -> bool:
        """Whether this plan answers for a model of N = ``n`` experts, top-``k``, MoE
        ``layers`` loaded in ``dtype`` (the loaded model agrees with the manifests it was made
        from): then executing it needs no second plan."""
        return self.made_for == (n, k, list(layers), str(dtype).removeprefix("torch."))

    @property
    def complete(self) -> bool:
        """Every cell asked for is stored: the answer needs neither the model nor torch."""
        return not any(r.pending for r in self.runs)

    def stored(self) -> ReplayOutcome:
        """The outcome of a complete plan: its units (or the variants answering for them)."""
        outcome = self.outcome
        for run in self.runs:
            outcome.units += [u.answered_by or u.unit for u in run.units]
            outcome.reused.append(run.run.name)
        return outcome


def plan(catalog: Catalog, runs: list[Run], request: ReplayRequest, calibration: list[Run],
         out: Path, *, n: int, k: int, layers: list[int], dtype: str = "float32") -> ReplayPlan:
    """The plan of ``request`` over ``runs`` for N = ``n`` experts, top-``k`` routing and the
    model's MoE ``layers`` (those the request names, else all): per run the layers it can be
    scored at, per ranking × coverage the budgets it evaluates (the rest noted as skipped) and
    what is stored; reads manifests and result folders only (no model, no torch, no writes)."""
    mode = request.mode
    outcome = ReplayOutcome()
    unknown = [r for r in request.rankings if r not in index.RANKINGS]
    if unknown:
        raise ReplayError(f"unknown ranking(s) {', '.join(unknown)}; use one of "
                          f"{', '.join(index.ranking_names())}")
    for name in request.rankings:
        if request.batch_size > 1 and index.RANKINGS[name].stateful:
            outcome.notes.append(f"{name} keeps one state per batch of {request.batch_size}, "
                                 "carried across that batch's passes (capture --batch-size "
                                 "refuses stateful rankings online)")
    found = []
    sums = index.surrogate_sums(request.rankings)  # what calibration_stats attaches
    for run in runs:
        run_layers = run_layers_noted(run, layers, mode, outcome)
        if run_layers:
            found.append(RunPlan(run, run_layers, [
                unit for name in request.rankings for cov_name in request.coverages
                if (unit := plan_unit(catalog, out, run, mode, mode.cell_layers(run_layers),
                                      name, cov_name, request.budgets, calibration, n, k, dtype,
                                      outcome, sums, request)) is not None]))
    return ReplayPlan(request, calibration, out, found, outcome,
                      (n, k, list(layers), str(dtype).removeprefix("torch.")))


def plan_unit(catalog: Catalog, out: Path, run: Run, mode: ReplayMode, cell_layers, name: str,
              cov_name: str, budgets, calibration: list[Run], n: int, k: int, dtype: str,
              outcome: ReplayOutcome, surrogate_sums: bool = False,
              request: ReplayRequest | None = None) -> UnitPlan | None:
    """One ranking × coverage of ``run`` (None when it evaluates no budget asked for)."""
    budgets = [b for b in budgets if b >= index.min_budget(cov_name, k)]
    skip = index.skipped_budgets(name, n, budgets)
    if skip:
        outcome.skipped.setdefault(name, sorted(set(skip)))
    budgets = [b for b in budgets if b not in skip]
    if not budgets:
        return None
    adaptive = dict(budget_mode=request.budget_mode, pass_cap=request.pass_cap,
                    pace=request.pace) if request else {}
    unit = UnitResults(out, mode.table, run, unit_key(mode, name, cov_name, calibration, dtype,
                                                      surrogate_sums, **adaptive))
    wanted = {(layer, b) for layer in (cell_layers or [None]) for b in budgets}
    done = set().union(*(b.cells() for b in unit.complete_blocks()))
    other = stored_calibrated(catalog, out, run, unit, name, calibration, wanted, done)
    if other is not None:
        outcome.notes.append(answered_note(name, cov_name, run, other))
        return UnitPlan(name, cov_name, unit, budgets, answered_by=other)
    artifact = index.RANKINGS[name].artifact
    missing = not wanted <= done or bool(artifact and not (unit.folder / artifact).exists())
    return UnitPlan(name, cov_name, unit, budgets, missing=missing)


def manifest_plan(catalog: Catalog, runs: list[Run], request: ReplayRequest,
                  calibration: list[Run], out: Path, dtype: str = "float32") -> ReplayPlan | None:
    """The plan of ``request`` from the manifests alone (N, k and the MoE layers), without the
    model, torch or writing anything: complete (:attr:`ReplayPlan.complete`) when every cell it
    asks for is stored already (complete blocks of the current captures), its answer then
    :meth:`ReplayPlan.stored`; otherwise :func:`replay.run.replay` executes this same plan once
    the model is loaded. None when the manifests cannot tell (then the loaded model plans).
    ``calibration``: the calibration runs, resolved once by the caller."""
    manifest = runs[0].manifest
    try:
        n, k, moe = manifest["num_experts"], manifest["top_k"], list(manifest["moe_layers"])
    except KeyError:
        return None
    layers = list(request.layers) if request.layers else moe
    if not set(layers) <= set(moe) or any(r.manifest.get("moe_layers") != moe for r in runs) \
            or any(r.manifest.get("num_experts") != n for r in runs):
        return None  # said in one line once the model is loaded
    return plan(catalog, runs, request, calibration, out, n=n, k=k, layers=layers, dtype=dtype)
