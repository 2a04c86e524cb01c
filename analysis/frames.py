"""Every computed frame the report and the dashboard draw, by name, in one place.

Each entry of :data:`ANALYSES` takes a connection from :func:`analysis.sql.connect` and returns a
polars frame grouped by model and benchmark; :data:`NEEDS` says which view it reads (routing
unless listed). The cost-model frames (projected speedup, calibration, MoESD efficiency) need a
run's manifest or the profile points and are separate functions.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import polars as pl

from moe_spec.analysis import cost, replay_views, routing
from moe_spec.analysis.sql import matching, views
from moe_spec.catalog import partition_value, replay_metrics
from moe_spec.catalog.replay_metrics import CLOSED_TABLE, OPEN_TABLE
from moe_spec.catalog.runs import profile_parts
from moe_spec.policy import index


@functools.lru_cache(maxsize=16)
def model_shape(location: str) -> cost.ModelShape | None:
    """The cost model's view of a captured model, from its config alone (no weights): the local
    ``config.json`` read as is where it names every width (instant), else through transformers
    (hub ids, or a config that leaves values at the family's defaults)."""
    import json
    try:
        raw = json.loads((Path(location) / "config.json").read_text())
        return cost.ModelShape.from_config(raw)  # (read by moe.families.facts)
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    from transformers import AutoConfig
    try:
        return cost.ModelShape.from_config(AutoConfig.from_pretrained(location))
    except (OSError, ValueError):
        return None


def real_target(manifest: dict, model: str) -> tuple[str, cost.ModelShape] | None:
    """(checkpoint, shape) of the real checkpoint the captured family stands for, or None: the
    registry's family (``moe.families.lookup``) for the ``model_type`` of the manifest
    (routing-only imports) or of the captured model's config, else for the model's name."""
    from moe_spec.moe import families, models, shapes
    model_type = manifest.get("model_type") or \
        families.facts(models.read_config(manifest["model_location"])).model_type
    family = families.lookup(model_type, manifest.get("model") or model)
    real = shapes.REAL_SHAPES.get(family.alias) if family else None
    return None if real is None else (real.checkpoint,
                                      cost.ModelShape.from_config(real.build_config()))


def selection_charges(manifest: dict, model: str) -> dict[str, dict[str, float]]:
    """Per shape (the captured model's, and its family's real checkpoint's), every ranking's own
    bytes per layer in experts of that shape (:meth:`cost.ModelShape.overhead_experts`): what
    the experts-saved tables subtract (:func:`analysis.replay_views.net_saved`)."""
    shapes = []
    captured = model_shape(manifest["model_location"])
    if captured is not None:
        shapes.append(("captured shape", captured))
    real = real_target(manifest, model)
    if real is not None:
        shapes.append((f"{real[0]} shape", real[1]))
    return {label: {name: shape.overhead_experts(name) for name in index.RANKINGS}
            for label, shape in shapes}


def draft_seconds(hidden: int, intermediate: int, vocab: int, depth: int, hw: cost.Hardware,
                  bytes_per_param: float = 2.0) -> float:
    """Memory-bound time of ``depth + 1`` EAGLE-3 draft forwards (fc 3H→H, one decoder layer,
    the draft LM head): ``(H·(7H + 3I) + H·V) · b`` bytes each."""
    return (depth + 1) * (hidden * (7 * hidden + 3 * intermediate) + hidden * vocab) \
        * bytes_per_param / hw.bandwidth


@functools.cache
def real_targets() -> dict[str, cost.ModelShape]:
    """The registry's real checkpoints as cost-model shapes, by checkpoint name (the speedup
    projection's targets)."""
    from types import SimpleNamespace

    from moe_spec.moe.shapes import REAL_SHAPES  # each entry lists every width the cost model reads
    return {s.checkpoint: cost.ModelShape.from_config(SimpleNamespace(**s.config))
            for s in REAL_SHAPES.values()}


# The quality bound a projected speedup is headlined at (stated wherever a headline is shown):
# closed-loop replay's share of trees whose accepted path is unchanged under the budget, or, where
# only open-loop replay exists, its mean reconstruction error (router ranking).
PATH_BOUND = 0.9
RSE_BOUND = 0.05


def t_interval(mean: float, sd: float | None, n: int) -> tuple[float, float]:
    """The 95% Student-t interval of a mean, ``mean ± t₀.₉₇₅,ₙ₋₁ · sd / √n`` (NaN with n < 2)."""
    from scipy.stats import t
    if mean is None or sd is None or n < 2 or not np.isfinite(sd):
        return float("nan"), float("nan")
    half = float(t.ppf(0.975, n - 1)) * sd / np.sqrt(n)
    return mean - half, mean + half


def replayed_rankings(con, model: str, bench: str) -> pl.DataFrame:
    """(ranking, coverage, open, closed): every ranking and coverage replayed on a dataset, open
    loop and closed loop, router first (the speedup page's and the frontier's choices)."""
    part = partition_value(model)
    present = views(con)
    found: dict[tuple[str, str], dict] = {}
    for table, loop in ((OPEN_TABLE, "open"), (CLOSED_TABLE, "closed")):
        if table not in present:
            continue
        for ranking, cover in con.execute(
                f"SELECT DISTINCT ranking, coverage FROM {table} WHERE model = ? AND bench = ?",
                [part, bench]).fetchall():
            found.setdefault((ranking, cover), dict(ranking=ranking, coverage=cover, open=False,
                                                    closed=False))[loop] = True
    rows = sorted(found.values(), key=lambda r: (r["ranking"] != "router", r["ranking"],
                                                 r["coverage"] != "substitution"))
    return pl.DataFrame(rows, schema=dict(ranking=pl.String, coverage=pl.String,
                                          open=pl.Boolean, closed=pl.Boolean))


def missing_replay(con, model: str, bench: str, ranking: str, coverage: str | None) -> str | None:
    """What is missing to measure a budget's quality under ``ranking`` (and ``coverage``), in
    words — "no replay at all of this dataset", "no router replay (replayed: oracle, coact)",
    "no router replay with truncation coverage (…)" — or None when one exists."""
    found = replayed_rankings(con, model, bench)
    if found.is_empty():
        return "no replay at all of this dataset"
    mine = found.filter(pl.col("ranking") == ranking)
    others = ", ".join(dict.fromkeys(found["ranking"].to_list()))
    if mine.is_empty():
        return f"no {ranking} replay (replayed: {others})"
    if coverage and mine.filter(pl.col("coverage") == coverage).is_empty():
        return (f"no {ranking} replay with {coverage} coverage (replayed: "
                f"{', '.join(mine['coverage'].to_list())})")
    return None


def routing_statistics(con, model: str, bench: str, run: str | None = None,
                       ranking: str = "router", coverage: str | None = None) -> dict | None:
    """What a capture says about routing, independent of the model's size: unique experts per
    layer per tree (as a share of N), tree size, prefix length, and τ under each fixed budget
    (adaptive ones: :func:`mode_speedup_frame`) from closed-loop replay (``ranking``,
    substitution unless ``coverage``) of the *same* trees, with the captured τ of those trees
    for B = N. ``quality`` holds, per budget, what the budget
    costs: closed-loop ``path_unchanged`` (share of trees whose accepted path survives) and
    ``kl`` (mean KL per node), and open-loop ``rse`` (mean RSE of ``ranking``, ``coverage``, or
    substitution where replayed, else truncation); ``quality_source`` says which of them exist
    and ``missing`` what is not there (:func:`missing_replay`). Intervals (95%, Student t over
    trees, trees of a prompt taken as independent: optimistic): ``tau_ci`` of the unbudgeted τ,
    ``taus_ci[B]`` of closed loop's τ(B), ``ratio_ci[B]`` of τ(B)/τ(N) from the per-tree
    differences (paired: the same trees)."""
    part = partition_value(model)
    where, params = matching(dict(model=part, bench=bench, **({"run": run} if run else {})))
    row = con.execute(f"""SELECT avg(accepted_length), avg(prefix_len), avg(list_avg(
                          unique_experts)), any_value(nodes), count(*),
                          stddev_samp(accepted_length) FROM trees
                          WHERE {where} AND budget IS NULL""", params).fetchall()[0]
    if row[0] is None:
        return None
    n = con.execute(f"SELECT any_value(num_experts) FROM summary_layers WHERE {where}",
                    params).fetchall()[0][0]
    if n is None:
        return None
    stats = dict(tau=row[0], prefix=row[1], unique=row[2], nodes=int(row[3]), trees=row[4],
                 num_experts=int(n), taus={}, tau_source="unbudgeted capture", quality={},
                 quality_source=None, ranking=ranking, coverage=coverage,
                 tau_ci=t_interval(row[0], row[5], row[4]), taus_ci={}, ratio_ci={},
                 missing=missing_replay(con, model, bench, ranking, coverage))
    present = views(con)
    if OPEN_TABLE in present:
        fixed = f"{replay_views.budget_mode(con, OPEN_TABLE)} = '{replay_views.FIXED}'"
        rows = con.execute(f"""SELECT coverage, budget, avg(rse) FROM {OPEN_TABLE} WHERE {where}
                               AND ranking = ? AND {fixed} GROUP BY ALL""",
                           [*params, ranking]).fetchall()
        by = {c: {int(b): r for cc, b, r in rows if cc == c} for c in {r[0] for r in rows}}
        rse = by.get(coverage) if coverage else (by.get("substitution") or by.get("truncation"))
        for b, r in (rse or {}).items():
            stats["quality"][b] = dict(rse=r)
        if rse:
            stats["quality_source"] = "open-loop replay"
            stats["coverage"] = coverage or ("substitution" if by.get("substitution")
                                             else "truncation")
    if CLOSED_TABLE in present:
        cover = stats["coverage"] or "substitution"
        rows = con.execute(f"""SELECT budget, avg(accepted_length), avg(captured_accepted_length),
                               avg(path_unchanged::DOUBLE), avg(mean_kl),
                               stddev_samp(accepted_length), count(*),
                               avg(accepted_length - captured_accepted_length),
                               stddev_samp(accepted_length - captured_accepted_length)
                               FROM {CLOSED_TABLE} WHERE {where} AND ranking = ?
                               AND coverage = ? AND {replay_views.budget_mode(con, CLOSED_TABLE)}
                               = '{replay_views.FIXED}' GROUP BY budget""",
                           [*params, ranking, cover]).fetchall()
        if rows:
            stats["taus"] = {int(b): t for b, t, *_ in rows}
            stats["tau"] = float(np.mean([c for _, _, c, *_ in rows]))  # the same trees' τ
            stats["tau_source"] = "closed-loop replay"
            stats["coverage"] = stats["coverage"] or "substitution"
            for b, tau, captured, path, kl, sd, count, diff, diff_sd in rows:
                stats["quality"].setdefault(int(b), {}).update(path_unchanged=path, kl=kl)
                stats["taus_ci"][int(b)] = t_interval(tau, sd, count)
                lo, hi = t_interval(diff, diff_sd, count)
                stats["ratio_ci"][int(b)] = (1 + lo / captured, 1 + hi / captured)
            stats["quality_source"] = "closed-loop replay"
    return stats


def target_budget(budget: int, captured_experts: int, target_experts: int) -> int:
    """The target's budget for a captured one, by share of N: ``B_t = round(B · N_t / N)``."""
    return int(round(budget * target_experts / captured_experts))


def speedup_frame(stats: dict, target: cost.ModelShape, hardware: list[cost.Hardware],
                  depth: int = 7, draft: tuple[int, int, int] | None = None,
                  calibration: tuple[cost.Calibration, cost.Hardware] | None = None
                  ) -> pl.DataFrame:
    """Projected speedup over autoregressive decoding vs the *target's* budget, the capture's
    routing statistics put on a ``target`` shape (N_t experts, top-k k_t):

        B_t          = round(B · N_t / N)                 (budgets mapped by share of N)
        E_t(B_t)     = clip(min(B, U) / N · N_t, k_t, N_t)  (experts loaded per layer)
        speedup(B_t) = τ(B) · T_AR / (T_draft + T_verify(E_t))   (cost.projected_speedup)

    with B a budget of the captured model (N experts, U unique experts per layer per tree), τ(B)
    from closed-loop replay (the captured τ at B = N), times from the roofline of ``target`` on
    each hardware profile. Budgets with B_t < k_t are left out (the target cannot verify with
    fewer experts than it routes to); where two captured budgets map to one B_t, the one whose
    share of N is nearest B_t / N_t stays. ``draft`` is the draft head's (hidden, intermediate,
    vocabulary); by default one decoder layer of the target's width with a 32k draft vocabulary.
    ``speedup_low``/``speedup_high``: the 95% interval from τ's (speedup is linear in τ; the
    cost model itself is taken as exact): closed loop's τ(B) where measured, else the
    unbudgeted τ's (:func:`routing_statistics`).
    Each row says whether the verify pass is memory-bound (bandwidth matters) or
    compute-bound (it does not), what the budget costs in quality (``path_unchanged``, ``kl``,
    ``rse``; see :func:`routing_statistics`) and whether that is ``within_bound``
    (:func:`within_bound`). ``calibration`` = (fit, the profile it was fitted on) adds rows for
    the capturing device (``hardware`` "capturing device (calibrated)"): T_AR, T_verify =
    α·T_mem + β·T_flop + γ, T_draft = α·(draft memory time) + (depth + 1)·γ."""
    n_c, n_t, k_t = stats["num_experts"], target.num_experts, target.top_k
    quality = stats.get("quality", {})
    budgets = sorted(stats["taus"]) or sorted(quality) or sorted(
        {max(1, round(f * n_c)) for f in np.linspace(0.125, 1.0, 8)})
    if n_c not in budgets:
        budgets.append(n_c)
    chosen: dict[int, int] = {}  # target budget -> captured budget
    for b in budgets:
        b_t = target_budget(b, n_c, n_t)
        if b_t < k_t:
            continue
        old = chosen.get(b_t)
        if old is None or abs(b / n_c - b_t / n_t) < abs(old / n_c - b_t / n_t) or b == n_c:
            chosen[b_t] = b
    hidden, inter, vocab = draft or (target.hidden, 4 * target.hidden, 32000)
    profiles = [(hw, None) for hw in hardware]
    if calibration is not None:
        profiles.append(calibration[::-1])
    rows = []
    for hw, cal in profiles:
        t_draft = draft_seconds(hidden, inter, vocab, depth, hw, target.bytes_per_param)
        if cal is not None:
            t_draft = cal.alpha * t_draft + (depth + 1) * cal.gamma
        for b_t, b in sorted(chosen.items()):
            loaded = float(np.clip(min(b, stats["unique"]) / n_c * n_t, k_t, n_t))
            tau = stats["taus"].get(b, stats["tau"])
            _, mem, comp = cost.pass_time(target, hw, stats["nodes"], int(stats["prefix"]),
                                          loaded)
            q = dict(path_unchanged=1.0, kl=0.0, rse=0.0) if b == n_c else quality.get(b, {})
            speed = cost.projected_speedup(target, hw, tau, loaded, stats["nodes"],
                                           int(stats["prefix"]), t_draft, cal)
            lo, hi = stats.get("taus_ci", {}).get(b) or stats.get("tau_ci") or (np.nan, np.nan)
            rows.append(dict(
                ranking=stats.get("ranking", "router"), coverage=stats.get("coverage"),
                missing=stats.get("missing"),
                hardware="capturing device (calibrated)" if cal else hw.name,
                budget=b_t, target_experts=n_t, target_top_k=k_t, captured_budget=b,
                num_experts=n_c, budget_share=b / n_c, experts_loaded=loaded, tau=tau,
                tau_source=stats["tau_source"] if b in stats["taus"] or b == n_c
                else "unbudgeted capture",
                path_unchanged=q.get("path_unchanged"), kl=q.get("kl"), rse=q.get("rse"),
                speedup=speed, speedup_low=speed * lo / tau, speedup_high=speed * hi / tau,
                bound="memory" if mem >= comp else "compute"))
    for r in rows:
        r.update(quality=quality_text(r), within_bound=within_bound(r))
    return pl.DataFrame(rows, schema_overrides=dict(path_unchanged=pl.Float64, kl=pl.Float64,
                                                    rse=pl.Float64, within_bound=pl.Boolean,
                                                    coverage=pl.String, missing=pl.String))


def mode_loads(con, model: str, bench: str, ranking: str, coverage: str) -> pl.DataFrame:
    """(budget_mode, budget, experts_loaded, count): how many of one ranking's replayed
    tree-layers loaded each number of experts, per budget mode and budget (B̄ for an adaptive
    mode): open loop's rows (one per tree-layer) where replayed, else closed loop's lists (one
    entry per MoE layer of a tree)."""
    part = partition_value(model)
    present = views(con)
    for table, loads in ((OPEN_TABLE, "experts_loaded"),
                         (CLOSED_TABLE, "unnest(experts_loaded)")):
        if table not in present:
            continue
        found = con.sql(f"""
            SELECT mode AS budget_mode, budget, n AS experts_loaded, count(*) AS count FROM (
              SELECT {replay_views.budget_mode(con, table)} AS mode, budget, {loads} AS n
              FROM {table} WHERE model = ? AND bench = ? AND ranking = ? AND coverage = ?)
            GROUP BY ALL ORDER BY ALL""", params=[part, bench, ranking, coverage]).pl()
        if found.height:
            return found
    return pl.DataFrame(schema=dict(budget_mode=pl.String, budget=pl.Int64,
                                    experts_loaded=pl.Int64, count=pl.Int64))


def adaptive_curves(con, model: str, bench: str) -> list[tuple[str, str]]:
    """(ranking, coverage) of every curve of a dataset replayed under an adaptive budget mode
    (open or closed loop), router first: what the report draws fixed vs adaptive for."""
    part = partition_value(model)
    found = set()
    for table in (OPEN_TABLE, CLOSED_TABLE):
        if table in views(con):
            found |= set(con.execute(f"""
                SELECT DISTINCT ranking, coverage FROM {table} WHERE model = ? AND bench = ?
                AND {replay_views.budget_mode(con, table)} != '{replay_views.FIXED}'""",
                [part, bench]).fetchall())
    return sorted(found, key=lambda rc: (rc[0] != "router", rc))


def mode_quality(con, model: str, bench: str, ranking: str, coverage: str) -> dict:
    """(budget_mode, budget) -> what the budget costs and τ under it: open loop's mean ``rse``,
    closed loop's ``tau`` (its 95% interval ``tau_ci``, Student t over trees),
    ``path_unchanged`` and ``kl``, each where replayed; ``price``, an adaptive mode's λ at that
    B̄ (:func:`replay_views.price`: one per cell of the default view; null for fixed)."""
    part = partition_value(model)
    present = views(con)
    out: dict[tuple[str, int], dict] = {}
    args = [part, bench, ranking, coverage]
    where = "model = ? AND bench = ? AND ranking = ? AND coverage = ?"
    if OPEN_TABLE in present:
        for mode, b, rse, lam in con.execute(f"""
                SELECT {replay_views.budget_mode(con, OPEN_TABLE)}, budget, avg(rse),
                       max({replay_views.price(con, OPEN_TABLE)})
                FROM {OPEN_TABLE} WHERE {where} GROUP BY ALL""", args).fetchall():
            out.setdefault((mode, int(b)), {}).update(rse=rse, price=lam)
    if CLOSED_TABLE in present:
        for mode, b, tau, sd, n, path, kl, lam in con.execute(f"""
                SELECT {replay_views.budget_mode(con, CLOSED_TABLE)}, budget,
                       avg(accepted_length), stddev_samp(accepted_length), count(*),
                       avg(path_unchanged::DOUBLE), avg(mean_kl),
                       max({replay_views.price(con, CLOSED_TABLE)})
                FROM {CLOSED_TABLE} WHERE {where} GROUP BY ALL""", args).fetchall():
            q = out.setdefault((mode, int(b)), {})
            q.update(tau=tau, tau_ci=t_interval(tau, sd, n), path_unchanged=path, kl=kl)
            q["price"] = q.get("price") if q.get("price") is not None else lam
    return out


def mode_speedup_frame(con, model: str, bench: str, stats: dict, target: cost.ModelShape,
                       hardware: list[cost.Hardware], depth: int = 7) -> pl.DataFrame:
    """Projected speedup against the mean experts loaded per layer, fixed and adaptive budgets
    alike (issue 63), for the ranking and coverage of ``stats`` (:func:`routing_statistics`):
    one row per budget mode × budget (B, or the mean B̄ an adaptive mode asked) × hardware, and
    the unbudgeted pass (``budget_mode`` "none (B = N)").

        n_t          = n · N_t / N            (each replayed tree-layer's load n, by share of N)
        T_verify     = Σ_ℓ max(bytes(n_ℓ) / BW, flops / peak)   (cost.pass_time on the loads'
                                                                  distribution: each layer its own)
        speedup      = τ · T_AR / (T_draft + T_verify)          (cost.projected_speedup)

    ``experts_loaded``: the mean of n_t (the x axis), ``experts_p10``/``experts_p90`` its
    spread; ``price``, an adaptive mode's λ at that B̄ (null for fixed); τ from closed-loop
    replay of the same mode and budget where replayed (interval from its trees), else the
    unbudgeted τ (the rows say so in ``tau_source``). Quality and the bound as
    :func:`speedup_frame` (``within_bound``, ``quality``), per mode: a mode replayed closed
    loop is judged by the share of unchanged paths (a budget closed loop did not replay: not
    measured), one replayed open loop only by its mean RSE (``judged_by``: "closed", "open")."""
    ranking, coverage = stats.get("ranking", "router"), stats.get("coverage")
    loads = mode_loads(con, model, bench, ranking, coverage) if coverage else None
    n_c, n_t, k_t = stats["num_experts"], target.num_experts, target.top_k
    quality = mode_quality(con, model, bench, ranking, coverage) if coverage else {}
    points = []  # (mode, budget, loads on the target, τ, τ interval, τ source, quality)
    for (mode, budget), g in (loads.group_by(["budget_mode", "budget"], maintain_order=True)
                              if loads is not None and loads.height else []):
        sample = np.repeat(g["experts_loaded"].to_numpy().astype(float) * n_t / n_c,
                           g["count"].to_numpy())
        q = quality.get((mode, int(budget)), {})
        closed = q.get("tau") is not None
        points.append((mode, int(budget), sample, q["tau"] if closed else stats["tau"],
                       q["tau_ci"] if closed else stats["tau_ci"],
                       "closed-loop replay" if closed else "unbudgeted capture", q))
    points.append(("none (B = N)", n_c, np.array([stats["unique"] * n_t / n_c]), stats["tau"],
                   stats["tau_ci"], stats["tau_source"], {}))
    hidden, inter, vocab = target.hidden, 4 * target.hidden, 32000
    rows = []
    for hw in hardware:
        t_draft = draft_seconds(hidden, inter, vocab, depth, hw, target.bytes_per_param)
        for mode, budget, sample, tau, (lo, hi), source, q in points:
            speed = cost.projected_speedup(target, hw, tau, sample, stats["nodes"],
                                           int(stats["prefix"]), t_draft)
            _, mem, comp = cost.pass_time(target, hw, stats["nodes"], int(stats["prefix"]),
                                          sample)
            unbudgeted = mode == "none (B = N)"
            rows.append(dict(
                ranking=ranking, coverage=coverage, hardware=hw.name, budget_mode=mode,
                budget=budget, price=q.get("price"),
                captured_budget=n_c if unbudgeted else budget, num_experts=n_c,
                target_experts=n_t, target_top_k=k_t, experts_loaded=float(sample.mean()),
                experts_p10=float(np.percentile(sample, 10)),
                experts_p90=float(np.percentile(sample, 90)), tau=tau, tau_source=source,
                path_unchanged=q.get("path_unchanged"), kl=q.get("kl"), rse=q.get("rse"),
                speedup=speed, speedup_low=speed * lo / tau, speedup_high=speed * hi / tau,
                bound="memory" if mem >= comp else "compute"))
    closed = {mode for (mode, _), q in quality.items() if q.get("tau") is not None}
    for r in rows:
        # a mode replayed closed loop is judged by the path at the budgets closed loop measured
        # (elsewhere: not measured), as :func:`speedup_frame` is; one replayed open loop only,
        # by its RSE (``judged_by`` says which)
        r.update(quality=quality_text(r), within_bound=within_bound(r),
                 judged_by="closed" if r["budget_mode"] in closed else "open")
        if r["judged_by"] == "closed" and r["path_unchanged"] is None \
                and r["captured_budget"] != n_c:
            r["within_bound"] = None
    return pl.DataFrame(rows, schema_overrides=dict(path_unchanged=pl.Float64, kl=pl.Float64,
                                                    rse=pl.Float64, within_bound=pl.Boolean,
                                                    coverage=pl.String, price=pl.Float64))


def mode_headlines(frame: pl.DataFrame, hardware: str | None = None) -> pl.DataFrame:
    """Per budget mode of a :func:`mode_speedup_frame`, on ``hardware`` (default: the frame's
    first): the fastest budget within the quality bound (:func:`within_bound`; the unbudgeted
    pass, always within, when none is faster), the same matched-quality rule as
    :func:`headline`, never a budget outside it."""
    hardware = hardware or frame["hardware"][0]
    mine = frame.filter(pl.col("hardware") == hardware)
    plain = mine.filter(pl.col("budget_mode") == "none (B = N)")
    rows = []
    budgeted = mine.filter(pl.col("budget_mode") != "none (B = N)")
    for (mode,), g in budgeted.sort(pl.col("budget_mode") != replay_views.FIXED,
                                    "budget_mode").group_by(["budget_mode"],
                                                            maintain_order=True):
        ok = pl.concat([g.filter(pl.col("within_bound").fill_null(False)), plain])
        best = ok.sort(pl.col("speedup").round(3), "experts_loaded").row(-1, named=True)
        rows.append(dict(best, budget_mode=mode, at=best["budget_mode"],
                         judged_by=g["judged_by"][0]))
    return pl.DataFrame(rows) if rows else pl.DataFrame()


MODE_SPEEDUP_NOTE = (
    "x: the mean of the experts each replayed tree-layer loaded (open loop), mapped by share of "
    "N onto the target;<br>each MoE layer is charged its own load (Σ_ℓ max(memory, compute)). "
    "τ from closed loop of the same mode and budget where replayed,<br>else the unbudgeted τ; "
    "bars: 95% CI from τ. Filled: within the bound the mode is judged by (closed-loop path<br>"
    f"unchanged ≥ {PATH_BOUND:.0%} where the mode was replayed closed loop, at those budgets; "
    f"else open-loop RSE ≤ {RSE_BOUND:g}); open: outside it or not measured.")


def mode_headline_rows(frame: pl.DataFrame, hardware: str | None = None) -> list[dict]:
    """:func:`mode_headlines` as shown (the Speedup page's table and the report's): per budget
    mode, its fastest budget within the bound it is judged by, the mean and p10–p90 of experts
    loaded per layer there beside it (what B̄ achieved), an adaptive mode's price λ there
    (:func:`price_text`), τ, the quality and the speedup beside its interval."""
    judged = {"closed": f"closed-loop path unchanged ≥ {PATH_BOUND:.0%}",
              "open": f"open-loop RSE ≤ {RSE_BOUND:g}"}
    out = []
    for r in mode_headlines(frame, hardware).iter_rows(named=True):
        plain = r["at"] == "none (B = N)"
        out.append({
            "budget mode": r["budget_mode"], "judged by": judged[r["judged_by"]],
            "fastest within the bound": "no budget (B = N)" if plain
            else f"{budget_letter(r['budget_mode'])} = {r['budget']}",
            "mean experts per layer (p10–p90)":
                f"{r['experts_loaded']:.1f} ({r['experts_p10']:.1f}–{r['experts_p90']:.1f})",
            "price λ": "—" if plain else price_text(r["budget_mode"], r.get("price")),
            "τ": f"{r['tau']:.2f} ({r['tau_source']})", "quality there": r["quality"],
            f"speedup on {r['hardware']} (95% CI from τ)":
                f"{r['speedup']:.2f}× ({speedup_interval(r)})"})
    return out


def budget_letter(mode: str) -> str:
    """How a budget of ``mode`` is named: B (one at every layer) or B̄ (an adaptive mode's mean
    asked)."""
    return "B" if mode in (replay_views.FIXED, "none (B = N)") else "B̄"


def price_text(mode: str, price: float | None) -> str:
    """An adaptive budget's price λ as shown (4 significant digits): "—" for a fixed budget
    (no price), "not stored" for adaptive rows without one."""
    if budget_letter(mode) == "B":
        return "—"
    return "not stored" if price is None or price != price else f"{price:.4g}"


MATCHED_QUALITY = (f"matched quality: the ranking's mean open-loop RSE at the budget ≤ "
                   f"{RSE_BOUND:g} (one rule for every ranking; B = N, unbudgeted EAGLE, always "
                   "matches); gain = projected throughput at the fastest such budget / at B = N "
                   "on the same shape and hardware, with τ under the budget from closed loop "
                   "where it replayed the ranking (accepted length, path and KL shown), else the "
                   "unbudgeted τ")


def frontier_table(con, model: str, bench: str, target: cost.ModelShape,
                   hardware: list[cost.Hardware], depth: int = 7,
                   rankings: pl.DataFrame | None = None) -> pl.DataFrame:
    """MoE-Spec's headline per replayed ranking and coverage of a dataset: the throughput gain
    over unbudgeted EAGLE at matched quality (:data:`MATCHED_QUALITY`) on ``target`` and each
    profile of ``hardware``, from :func:`speedup_frame`. Throughput ∝ speedup
    over AR on one shape and device, so gain = speedup(B*) / speedup(N). Interval (95%): from
    τ(B*)/τ(N) on the same trees (closed loop, paired; :func:`routing_statistics`); with open
    loop only τ is not measured under the budget, the unbudgeted τ cancels and the gain is the
    cost model's (interval = the value). One row per (ranking, coverage, hardware)."""
    rankings = replayed_rankings(con, model, bench) if rankings is None else rankings
    rows = []
    for r in rankings.iter_rows(named=True):
        stats = routing_statistics(con, model, bench, ranking=r["ranking"],
                                   coverage=r["coverage"])
        if stats is None:
            continue
        frame = speedup_frame(stats, target, hardware, depth)
        for hw in hardware:
            mine = frame.filter(pl.col("hardware") == hw.name)
            ok = mine.filter((pl.col("captured_budget") == pl.col("num_experts"))
                             | (pl.col("rse") <= RSE_BOUND))
            best = ok.sort(pl.col("speedup").round(3), "budget").row(-1, named=True)
            plain = mine.filter(pl.col("captured_budget") == pl.col("num_experts")
                                ).row(0, named=True)
            gain = best["speedup"] / plain["speedup"]
            lo, hi = stats["ratio_ci"].get(best["captured_budget"], (1.0, 1.0)) \
                if best["captured_budget"] != best["num_experts"] else (1.0, 1.0)
            ratio = best["tau"] / plain["tau"]
            rows.append(dict(
                model=model, bench=bench, ranking=r["ranking"], coverage=stats["coverage"],
                quality_source=stats["quality_source"] or "none", hardware=hw.name,
                budget=best["budget"], target_experts=best["target_experts"],
                captured_budget=best["captured_budget"], num_experts=best["num_experts"],
                quality=best["quality"], tau=best["tau"], tau_source=best["tau_source"],
                gain=gain, gain_low=gain * lo / ratio, gain_high=gain * hi / ratio))
    return pl.DataFrame(rows, schema_overrides=dict(coverage=pl.String))


def frontier_markdown_rows(table: pl.DataFrame, with_model: bool = True) -> list[dict]:
    """:func:`frontier_table` as shown (the Speedup page's table and bench/frontier.py's block):
    one row per (model, benchmark, ranking, coverage, hardware), the gain always beside its
    interval."""
    rows = []
    for r in table.iter_rows(named=True):
        lo, hi = r["gain_low"], r["gain_high"]
        gain = f"{r['gain']:.2f}×" + (
            " (B = N: no budget both matches and is faster)"
            if r["captured_budget"] == r["num_experts"]
            else " (exact under the cost model: τ not measured under the budget)"
            if r["tau_source"] != "closed-loop replay"
            else f" (95% CI {lo:.2f}–{hi:.2f}×)" if lo == lo and hi == hi
            else " (no interval: fewer than 2 trees)")
        budget = ("none (B = N)" if r["captured_budget"] == r["num_experts"]
                  else f"{r['budget']} of {r['target_experts']}")
        rows.append({**({"model": r["model"], "bench": r["bench"]} if with_model else {}),
                     "ranking": r["ranking"], "coverage": r["coverage"] or "",
                     "quality from": r["quality_source"], "hardware": r["hardware"],
                     "budget at matched quality": budget, "quality there": r["quality"],
                     "τ there": f"{r['tau']:.2f} ({r['tau_source']})",
                     "throughput gain over EAGLE": gain})
    return rows


def speedup_interval(row: dict) -> str:
    """"95% CI 1.10–1.35×" of a projected speedup (τ's interval through the cost model), or
    why there is none: no speedup is shown bare."""
    lo, hi = row.get("speedup_low"), row.get("speedup_high")
    if lo is None or hi is None or lo != lo or hi != hi:
        return "no interval: fewer than 2 trees"
    return f"95% CI {lo:.2f}–{hi:.2f}×"


def quality_kind(frame: pl.DataFrame) -> str:
    """Which quality a speedup frame's budgets carry: "closed" (closed-loop path unchanged),
    "open" (open-loop RSE only) or "none"."""
    budgeted = frame.filter(pl.col("captured_budget") != pl.col("num_experts"))
    if budgeted["path_unchanged"].is_not_null().any():
        return "closed"
    if budgeted["rse"].is_not_null().any():
        return "open"
    return "none"


def within_bound(row: dict) -> bool | None:
    """Whether a budget stays within the stated quality bound: closed-loop path unchanged ≥
    :data:`PATH_BOUND` where closed-loop replay measured it, else open-loop RSE ≤
    :data:`RSE_BOUND`; None where neither was measured (no budget, B = N, is always within)."""
    if row["captured_budget"] == row["num_experts"]:
        return True
    if row.get("path_unchanged") is not None:
        return row["path_unchanged"] >= PATH_BOUND
    if row.get("rse") is not None:
        return row["rse"] <= RSE_BOUND
    return None


def bound_text(kind: str, missing: str | None = None, ranking: str = "router") -> str:
    """The quality bound in words, for a frame's :func:`quality_kind`; with no quality, what is
    missing (:func:`missing_replay`: "no router replay (replayed: oracle)", "no replay at
    all of this dataset")."""
    return {"closed": f"closed-loop path unchanged ≥ {PATH_BOUND:.0%}",
            "open": f"open-loop RSE ≤ {RSE_BOUND:g} (no closed-loop replay of {ranking}: τ "
                    "under a budget is not measured; the unbudgeted τ is assumed)",
            "none": f"{missing or f'no {ranking} replay'}: the quality of a budget under "
                    f"{ranking} is not measured"}[kind]


def frame_bound_text(frame: pl.DataFrame) -> str:
    """:func:`bound_text` for a speedup frame (its ranking and what it misses)."""
    first = frame.row(0, named=True)
    return bound_text(quality_kind(frame), first.get("missing"), first.get("ranking") or "router")


def quality_text(row: dict) -> str:
    """What a budget costs in quality, in words (beside every projected speedup)."""
    if row["captured_budget"] == row["num_experts"]:
        return "no budget (B = N)"
    parts = []
    if row.get("path_unchanged") is not None:
        parts.append(f"path unchanged {row['path_unchanged']:.0%}")
    if row.get("kl") is not None:
        parts.append(f"KL {row['kl']:.3g}")
    if row.get("rse") is not None:
        parts.append(f"open-loop RSE {row['rse']:.3g}")
    return ", ".join(parts) or "quality not measured"


def mapping_note(frame: pl.DataFrame) -> str:
    """How the frame's budgets were put on the target, and what was left out."""
    r = frame.row(0, named=True)
    n_c, n_t, k_t = r["num_experts"], r["target_experts"], r["target_top_k"]
    if n_c == n_t:
        return f"B of the captured {n_c} experts; budgets below top-{k_t} not shown."
    return (f"Budgets mapped by share of N: B (of {n_t}) = round(B_captured · {n_t}/{n_c}); "
            f"τ and quality are the capture's at B_captured. Budgets below the target's top-{k_t} "
            "are not shown.")


def speedup_note(frame: pl.DataFrame, sep: str = "<br>") -> str:
    """The caption of a speedup figure: how budgets were mapped, the quality bound and how the
    points show it."""
    kind = quality_kind(frame)
    labels = {"closed": "labels: closed-loop path unchanged; ",
              "open": "labels: open-loop RSE; ", "none": ""}[kind]
    return (f"{mapping_note(frame)}{sep}Quality bound: {frame_bound_text(frame)}.{sep}"
            f"Point {labels}"
            "filled marker: within the bound; open marker: outside it or not measured.")


def headline(frame: pl.DataFrame, hardware: str | None = None) -> dict:
    """The projected speedup to lead with: the best on ``hardware`` (default: the frame's first)
    among budgets within the quality bound (:func:`within_bound`), never the most aggressive
    budget regardless of quality. Returns ``row`` (that budget's row), ``bound`` (the bound in
    words), ``kind`` (:func:`quality_kind`) and ``note`` (what the pick rests on, or why only
    B = N is left)."""
    hardware = hardware or frame["hardware"][0]
    mine = frame.filter(pl.col("hardware") == hardware)
    kind = quality_kind(frame)
    ok = mine.filter(pl.col("within_bound").fill_null(False))
    # B = N is always within the bound; of equal speedups the larger budget (better quality)
    row = ok.sort(pl.col("speedup").round(3), "budget").row(-1, named=True)
    note = ""
    bound = frame_bound_text(frame)
    if kind == "none":
        note = f"{bound.split(':')[0]}, so only B = N (no budget) is measured"
    elif row["captured_budget"] == row["num_experts"]:
        short = bound.split(" (")[0]
        note = (f"the budgets that keep {short} are no faster than none" if ok.height > 1
                else f"no budget keeps {short}")
    return dict(row=row, bound=bound, kind=kind, note=note)


# Every frame-valued analysis, by name, and the table it needs; the report and the app share it.
def batch_regime(con) -> pl.DataFrame:
    """Per model, benchmark and batch size b (sequences in a verification pass; b = 1 for runs
    captured one sequence at a time, schema 2 included): mean unique experts per MoE layer over
    the pass's union of b trees, tokens verified per pass (b·M), median verification seconds,
    passes; MoESD's uniform ``N(t)`` at the same t beside it. Unbudgeted passes only."""
    from moe_spec.analysis.routing import moesd_uniform
    columns = set(con.sql("DESCRIBE trees").pl()["column_name"].to_list())
    if "batch_size" in columns:
        pass_id = "coalesce(t.batch_pass, -1)"
        single = "CASE WHEN t.batch_pass IS NULL THEN {} END"
        tokens = "coalesce(t.batch_tokens, t.nodes)"
        unique = "list_avg(coalesce(t.batch_unique_experts, t.unique_experts))"
    else:  # schema 2 only: every pass is one tree
        pass_id, single, tokens = "-1", "{}", "t.nodes"
        unique = "list_avg(t.unique_experts)"
    # a pass is binned by the b its run was captured with (a b = 4 run's last passes, as its
    # queue drains, hold fewer sequences but are still b = 4 passes)
    t = con.sql(f"""
        WITH passes AS (
          SELECT model, bench, run, {pass_id} AS pass, {single.format('t.prompt_index')} AS p,
                 {single.format('t.step')} AS s, any_value(coalesce(r.batch_size, 1))
                 AS batch_size, any_value({tokens}) AS tokens,
                 any_value({unique}) AS unique_experts,
                 any_value(t.verify_seconds) AS seconds, any_value(r.num_experts) AS n,
                 any_value(r.top_k) AS k
          FROM trees t JOIN runs r USING (model, bench, run)
          WHERE t.budget IS NULL GROUP BY ALL)
        SELECT model, bench, batch_size, avg(tokens) AS tokens,
               avg(unique_experts) AS unique_experts, median(seconds) AS seconds,
               count(*) AS passes, any_value(n) AS n, any_value(k) AS k
        FROM passes GROUP BY ALL ORDER BY model, bench, batch_size""").pl()
    if not t.height:
        return t
    return t.with_columns(uniform=pl.Series([float(moesd_uniform(int(n), int(k), np.array([x]))[0])
                                             for n, k, x in zip(t["n"], t["k"], t["tokens"])]))


def routing_warnings(runs: pl.DataFrame) -> list[tuple[str, str]]:
    """(model, one line) for each model of ``runs`` (``model``, ``model_location`` columns)
    whose quality record says its routing is near-uniform (:func:`moe.models.near_uniform_routing`;
    models without a record, e.g. hub checkpoints, are not judged)."""
    from moe_spec.moe.models import near_uniform_routing, quality_record
    found = []
    for model, location in runs.select("model", "model_location").unique(
            maintain_order=True).iter_rows():
        record = quality_record(location) if location else None
        line = near_uniform_routing(record) if record else None
        if line:
            found.append((model, line))
    return found


def batch_speedup(con) -> pl.DataFrame:
    """``profile-batch``'s measured speedup per model, benchmark, profile run, measurement, b and
    budget (null: none), by :func:`analysis.timing.speedups`: the median of the paired
    per-repeat ratios ``AR s/token / EAGLE s/token`` over equal work (the same tokens every
    way; ``paired`` false: a measurement stored before, the ratio of medians), with its 95%
    interval, EAGLE's seconds per token and per verification pass with theirs, τ, and whether
    the decodings compared did equal work. Every measurement is a row set of its own;
    :func:`analysis.timing.latest` is the default pick."""
    from moe_spec.analysis import timing
    return timing.speedups(con.sql("SELECT * FROM batch_profile").pl())


def batch_pass_points(passes: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """The warm-up rule (:func:`analysis.warmup.drop`) per decoding — (mode, batch_size, budget,
    repeat where stored) — on ``profile-batch`` passes, then one point per measured (sequences,
    γ): (batch_size = the pass's sequences, gamma, seconds = median kept verify seconds, passes
    = kept passes); and the passes the rule dropped."""
    from moe_spec.analysis import warmup
    decoding = [c for c in ("mode", "batch_size", "budget", "repeat") if c in passes.columns]
    kept, dropped = warmup.drop(passes, "verify_seconds", decoding, "pass_index")
    points = kept.group_by(pl.col("pass_sequences").alias("batch_size"), "gamma").agg(
        seconds=pl.col("verify_seconds").median(), passes=pl.len().cast(pl.Int64)
    ).sort("batch_size", "gamma")
    return points, dropped


def batch_fit(con, model: str, bench: str, run: str, speed: pl.DataFrame) -> dict | None:
    """MoESD's pass-time model ``T(b, γ) ≈ c₀ + c₁·E(bγ) + c₂·bγ`` fitted to one profile run's
    unbudgeted verification passes after the warm-up rule (:func:`batch_pass_points`;
    ``dropped``), subject to the sample check of :func:`analysis.moesd.fit` (``refused``: "not
    fitted: only 1 pass at b = 2 (need 5)", then ``predicted`` is empty and nothing may be drawn;
    ``left_out``: points with too few passes), and the verification-only speedup it predicts per
    b, ``τ(b) · T(b, 1) / T(b, M)``; None without passes."""
    from moe_spec.analysis import moesd
    from moe_spec.analysis.timing import LEGACY
    columns = set(con.sql("DESCRIBE batch_profile_passes").pl()["column_name"].to_list())
    repeat = ", repeat" if "repeat" in columns else ""
    mine = speed.filter((pl.col("model") == partition_value(model)) & (pl.col("bench") == bench)
                        & (pl.col("run") == run) & pl.col("budget").is_null())
    measured = mine["measurement"][0] if mine.height and "measurement" in mine.columns else None
    one = "" if measured is None else (  # one measurement's passes: never several pooled
        " AND coalesce(measurement, ?) = ?" if "measurement" in columns else " AND ? = ?")
    one_params = [] if measured is None else [LEGACY, measured]
    passes = con.sql(f"""
        SELECT mode, batch_size, budget{repeat}, pass_index, pass_sequences, gamma, verify_seconds
        FROM batch_profile_passes
        WHERE model = ? AND bench = ? AND run = ?
          AND budget IS NULL{one}""", params=[partition_value(model), bench, run, *one_params]).pl()
    if passes.is_empty() or not mine.height:
        return None
    points, dropped = batch_pass_points(passes)
    n, k = int(mine["n"][0]), int(mine["k"][0])
    coef = moesd.fit(points, n, k)
    gamma = int(points.filter(pl.col("gamma") > 1)["gamma"].max() or 1)
    out = dict(coef=coef, points=points, gamma=gamma, dropped=dropped, refused=coef["refused"],
               left_out=coef["left_out"], predicted=mine.select("batch_size", "tau").clear()
               .with_columns(predicted=pl.lit(None, pl.Float64)))
    if coef["refused"]:  # no prediction: nothing to draw
        return out

    def seconds(b: int, g: int) -> float:
        return coef["c0"] + coef["c1"] * float(moesd.moesd_uniform(n, k, np.array([b * g]))[0]) \
            + coef["c2"] * b * g

    out["predicted"] = mine.select("batch_size", "tau").with_columns(predicted=pl.Series([
        r["tau"] * seconds(r["batch_size"], 1) / seconds(r["batch_size"], gamma)
        for r in mine.iter_rows(named=True)]))
    return out


def capture_batch_fit(con, model: str, bench: str) -> dict | None:
    """MoESD's pass-time model fitted to batched captures' unbudgeted verification passes (the
    Batch regime page): the warm-up rule per run (:func:`analysis.warmup.drop`), then one point
    per b (the b a run was captured with) — γ = mean tokens a pass / b, seconds = median kept
    verify seconds, passes kept — and :func:`analysis.moesd.fit` with its sample check.
    dict(coef, points, dropped) or None without passes."""
    from moe_spec.analysis import moesd, warmup
    columns = set(con.sql("DESCRIBE trees").pl()["column_name"].to_list())
    if "batch_pass" in columns:
        pass_id, tokens = "coalesce(t.batch_pass, -1)", "coalesce(t.batch_tokens, t.nodes)"
        single = "CASE WHEN t.batch_pass IS NULL THEN {} END"
    else:
        pass_id, tokens, single = "-1", "t.nodes", "{}"
    t = con.sql(f"""
        WITH passes AS (
          SELECT t.run, {pass_id} AS pass, {single.format('t.prompt_index')} AS p,
                 {single.format('t.step')} AS s, any_value(coalesce(r.batch_size, 1)) AS b,
                 any_value({tokens}) AS tokens, any_value(t.verify_seconds) AS seconds,
                 any_value(r.num_experts) AS n, any_value(r.top_k) AS k
          FROM trees t JOIN runs r USING (model, bench, run)
          WHERE t.budget IS NULL AND t.model = ? AND t.bench = ?
          GROUP BY ALL)
        SELECT *, row_number() OVER (PARTITION BY run ORDER BY pass, p, s) AS pass_order
        FROM passes""", params=[partition_value(model), bench]).pl()
    if t.is_empty():
        return None
    kept, dropped = warmup.drop(t, "seconds", ["run"], "pass_order")
    points = kept.group_by("b").agg(
        gamma=pl.col("tokens").mean() / pl.col("b").first(), seconds=pl.col("seconds").median(),
        passes=pl.len().cast(pl.Int64)).rename({"b": "batch_size"}).sort("batch_size")
    coef = moesd.fit(points, int(t["n"][0]), int(t["k"][0]))
    return dict(coef=coef, points=points, dropped=dropped)


def batch_projection(speed: pl.DataFrame, shape: cost.ModelShape, hw: cost.Hardware,
                     tree_tokens: int, prefix: int = 512) -> pl.DataFrame:
    """The roofline's verification-only speedup vs b on a real shape and device
    (:func:`analysis.cost.projected_batch_speedup`), with the measured τ at each b and budget;
    experts per pass from MoESD's uniform ``N(t)`` (an assumption: real routing is skewed, so
    fewer experts load) capped at the budget."""
    from moe_spec.analysis.routing import moesd_uniform
    rows = []
    for r in speed.iter_rows(named=True):
        b = int(r["batch_size"])
        spec = float(moesd_uniform(shape.num_experts, shape.top_k, np.array([b * tree_tokens]))[0])
        ar = float(moesd_uniform(shape.num_experts, shape.top_k, np.array([b]))[0])
        if r["budget"] is not None:
            spec = min(spec, float(r["budget"]))
        rows.append(dict(batch_size=b, budget=r["budget"], projected=cost.projected_batch_speedup(
            shape, hw, b, r["tau"], tree_tokens, prefix, spec, ar)))
    return pl.DataFrame(rows, schema=dict(batch_size=pl.Int64, budget=pl.Int64,
                                          projected=pl.Float64))


# every replay table's frame, under the name its record gives it (catalog.replay_metrics):
# its curves (replay_views.curves), unless a function of its own draws it
REPLAY_FRAMES = {t.frame: t.name for t in replay_metrics.TABLES.values() if t.frame}
_OWN_DRAWING = {"batch_errors": replay_views.batch_error_vs_budget}  # b = 1 from replay_open too
ANALYSES = {
    "tails": routing.heavy_tails_by_layer,
    "coverage": routing.coverage_curve,
    "growth": routing.activation_growth,
    "balance": routing.load_balance,
    **{name: _OWN_DRAWING.get(name) or functools.partial(replay_views.curves, table=table)
       for name, table in REPLAY_FRAMES.items()},
    "batch": batch_regime,
    "batch_speed": batch_speedup,
    "saved_open": replay_views.experts_saved_open,
    "saved_closed": replay_views.experts_saved_closed,
}
NEEDS = {"tails": "summary_layers", "coverage": "summary_layers", "growth": "summary_layers",
         "balance": "summary_layers",  # routing summaries: captures' and routing-only runs'
         **REPLAY_FRAMES, "batch": "trees", "batch_speed": "batch_profile",
         "saved_open": replay_metrics.OPEN_TABLE, "saved_closed": replay_metrics.CLOSED_TABLE}


def all_frames(con) -> dict[str, pl.DataFrame]:
    """Every analysis once, over all data (grouped by model and bench)."""
    present = views(con)
    return {name: fn(con) for name, fn in ANALYSES.items() if NEEDS.get(name, "routing") in present}


def _pass_order(con) -> str:
    """SQL numbering each ``trees`` row's verification pass within its run, in the order the run
    verified them: by batched pass where there is one (its trees share a number), else by
    (prompt, step) — the order the warm-up rule (:mod:`analysis.warmup`) needs."""
    columns = set(con.sql("DESCRIBE trees").pl()["column_name"].to_list())
    if "batch_pass" not in columns:  # schema 2: one tree a pass
        return "dense_rank() OVER (PARTITION BY t.run ORDER BY t.prompt_index, t.step)"
    return ("dense_rank() OVER (PARTITION BY t.run ORDER BY t.batch_pass, CASE WHEN t.batch_pass "
            "IS NULL THEN t.prompt_index END, CASE WHEN t.batch_pass IS NULL THEN t.step END)")


def calibration_passes(shape: cost.ModelShape, hw: cost.Hardware, t: pl.DataFrame):
    """:func:`analysis.cost.calibrate` on the passes of ``t`` (run, pass_order, measured, nodes,
    prefix_len, experts_loaded) that the warm-up rule keeps (:func:`analysis.warmup.drop`, per
    run); (kept frame with ``predicted``, Calibration with the count dropped)."""
    from moe_spec.analysis import warmup
    kept, dropped = warmup.drop(t, "measured", ["run"], "pass_order")
    cal = cost.calibrate(shape, hw, kept["measured"], kept["nodes"], kept["prefix_len"],
                         kept["experts_loaded"], dropped=dropped)
    if cal.refused:
        return kept.with_columns(predicted=pl.lit(None, pl.Float64)), cal
    parts = np.array([cost.pass_time(shape, hw, n, p, e)[1:] for n, p, e in
                      zip(kept["nodes"], kept["prefix_len"], kept["experts_loaded"])])
    return kept.with_columns(predicted=pl.Series(cal.predict(parts[:, 0], parts[:, 1]))), cal


def calibration_frame(con, model: str, bench: str, manifest: dict,
                      hw: cost.Hardware = cost.PROFILES["A100-80G"]):
    """Calibration of the roofline (datasheet shape of ``hw``) to this dataset's measured verify
    times after the warm-up rule (:func:`calibration_passes`); (measured vs predicted frame,
    Calibration) or None without passes or a readable config. A Calibration with too few passes
    is ``refused`` (its verdict says "not fitted: only N passes (need 5)")."""
    t = con.sql(f"""SELECT t.run, {_pass_order(con)} AS pass_order,
                    t.verify_seconds AS measured, t.nodes, t.prefix_len,
                    list_avg(t.experts_loaded) AS experts_loaded FROM trees t
                    WHERE t.model = ? AND t.bench = ?""",
                params=[partition_value(model), bench]).pl()
    if t.height == 0:
        return None
    shape = model_shape(manifest["model_location"])
    if shape is None:
        return None
    return calibration_passes(shape, hw, t)


def efficiency_frame(root: Path | None, model: str) -> pl.DataFrame | None:
    """MoESD η(b, γ) with regimes from ``profile-target`` points, if any were stored."""
    from moe_spec.analysis import moesd
    if root is None:
        return None
    parts = profile_parts(root, model)
    if not parts:
        return None
    from moe_spec.catalog import schema
    from moe_spec.catalog.location import read_frame
    points = read_frame([parts[-1]])
    points = points.rename(schema.renamed(schema.PROFILE_TABLE, points.columns))  # older files
    n, k = int(points["num_experts"][0]), int(points["top_k"][0])
    eff = moesd.efficiency(points.select("batch_size", "gamma", "seconds"))
    coef = moesd.fit(points, n, k)
    return eff.with_columns(regime=pl.Series(moesd.regime(eff["batch_size"] * eff["gamma"], n, k,
                                                          coef)))


def frontier_frame(con, model: str, bench: str, shape: cost.ModelShape,
                   hw: cost.Hardware) -> pl.DataFrame | None:
    """Speedup over plain EAGLE against task quality, one point per budgeted run (MoE-Spec online
    mode) that ``evaluate`` paired with its unbudgeted twin:

        speedup_vs_eagle = [τ_B / (T_draft + T_verify(E_B))] / [τ / (T_draft + T_verify(U))]

    with τ_B, E_B the budgeted run's accepted length and experts loaded per layer (each layer of
    each pass its own load, :func:`cost.pass_time`: an adaptive budget's vary), τ, U the
    twin's accepted length and unique experts; T_verify from the roofline of ``shape`` on ``hw``,
    the budgeted run's charged its ranking's selection overhead (:meth:`cost.ModelShape.overhead`;
    the draft cost is the same on both sides and is left out). Quality: the budgeted run's mean
    score and the share of its outputs identical to the twin's."""
    if "quality" not in views(con) or "trees" not in views(con):
        return None
    part = partition_value(model)
    pairs = con.sql("""
        SELECT q.run, any_value(q.twin_run) AS twin, avg(q.score) AS quality,
               avg(q.twin_score) AS twin_quality, avg(q.exact_match::DOUBLE) AS agreement,
               any_value(q.metric) AS metric
        FROM quality q WHERE q.model = ? AND q.bench = ?
        AND q.twin_run IS NOT NULL GROUP BY q.run""", params=[part, bench]).pl()
    if pairs.height == 0:
        return None
    trees = con.sql("""
        SELECT run, any_value(budget) AS budget, any_value(ranking) AS ranking,
               any_value(coverage) AS coverage, avg(accepted_length) AS tau,
               avg(list_avg(experts_loaded)) AS loaded, avg(list_avg(unique_experts)) AS uniq,
               avg(prefix_len) AS prefix, any_value(nodes) AS nodes
        FROM trees WHERE model = ? AND bench = ? GROUP BY run""", params=[part, bench]).pl()
    own = pairs.join(trees, on="run")
    twin = trees.select(pl.col("run").alias("twin"), pl.col("tau").alias("twin_tau"),
                        pl.col("uniq").alias("twin_uniq"))
    # each layer of each pass charged its own load (an adaptive budget's vary: cost.pass_time)
    loads = con.sql("""
        SELECT run, n, count(*) AS count FROM (SELECT run, unnest(experts_loaded) AS n
        FROM trees WHERE model = ? AND bench = ?) WHERE n IS NOT NULL GROUP BY ALL""",
                    params=[part, bench]).pl()
    rows = []
    for r in own.join(twin, on="twin").iter_rows(named=True):
        mine = loads.filter(pl.col("run") == r["run"])
        sample = np.repeat(mine["n"].to_numpy().astype(float), mine["count"].to_numpy()) \
            if mine.height else r["loaded"]
        t_b = cost.pass_time(shape, hw, int(r["nodes"]), int(r["prefix"]), sample,
                             overhead=shape.overhead(r["ranking"]))[0]  # sketch's surrogate
        t_0 = cost.pass_time(shape, hw, int(r["nodes"]), int(r["prefix"]), r["twin_uniq"])[0]
        rows.append(dict(r, speedup_vs_eagle=(r["tau"] / t_b) / (r["twin_tau"] / t_0),
                         hardware=hw.name))
    return pl.DataFrame(rows) if rows else None
