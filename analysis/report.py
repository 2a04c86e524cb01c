"""``report``: one self-contained HTML file per dataset (model × benchmark) and capture setting
with every figure, and ``index.html`` listing them (where there are several).

    report --traces traces --out reports/

File names are stable (:func:`report_names`): ``<model>_<bench>.html`` for a dataset's first
setting, ``<model>_<bench>_<run>.html`` for another (after a run of it); names written once are
kept in the folder's stamp, so adding a run or a setting never renames a report.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import duckdb
import jinja2
import plotly.graph_objects as go
import plotly.io as pio
import polars as pl
from markupsafe import Markup

from moe_spec import console
from moe_spec.analysis import coactivation, cost, figures, replay_views, summaries
from moe_spec.analysis.frames import (
    MODE_SPEEDUP_NOTE,
    adaptive_curves,
    all_frames,
    batch_fit,
    batch_projection,
    calibration_frame,
    efficiency_frame,
    frontier_frame,
    headline,
    mapping_note,
    mode_headline_rows,
    mode_speedup_frame,
    model_shape,
    real_target,
    real_targets,
    routing_statistics,
    selection_charges,
    speedup_frame,
    speedup_interval,
    speedup_note,
)
from moe_spec.analysis.sql import DEFAULT_VARIANT_RULE, connect, views
from moe_spec.catalog import Catalog, atomic, dataset_version, location, partition_value, schema
from moe_spec.catalog.replay_metrics import gap_closed
from moe_spec.catalog.runs import add_legacy_argument, allow_legacy
from moe_spec.errors import UserError, fail
from moe_spec.moe import shapes
from moe_spec.policy import index


def routing_figures(con, frames: dict, model: str, bench: str, manifest: dict) -> list:
    """Heavy tails, coverage, growth, co-activation (first and last MoE layer), load balance:
    what the routing summaries hold, for captures and routing-only runs alike."""
    part = partition_value(model)
    pick = lambda name: frames[name].filter((pl.col("model") == part)  # noqa: E731
                                            & (pl.col("bench") == bench))
    n = manifest["num_experts"]
    figs = [figures.heavy_tails(pick("tails"), n), figures.coverage(pick("coverage")),
            figures.growth(pick("growth"), n)]
    for layer in (manifest["moe_layers"][0], manifest["moe_layers"][-1]):
        c = coactivation.coactivation(con, layer, n,
                                      match=dict(model=part, bench=bench))
        figs.append(figures.coactivation(
            c.matrix, coactivation.cluster_order(c.matrix),
            f"Co-activation, layer {layer}: lift, all pairs, cluster order (concentration "
            f"{c.concentration:.1f}×)", lift=c.lift))
    figs.append(figures.load_balance(pick("balance")))
    return figs


def routing_only_section(runs: list) -> dict:
    """A routing-only group's key numbers, its truncation-coverage table and figure
    (:mod:`analysis.ids`, from the first run of the group), and what to say about it."""
    from moe_spec.analysis import ids
    run = runs[0]
    figs = ids.figures(run)
    n = figs.num_experts
    trunc = ids.truncation(figs)
    mean = trunc.group_by("budget").agg(pl.col("static_outside").mean(),
                                        pl.col("frequency_outside").mean()).sort("budget")
    table = Table(["budget B", "static: outside the run's top-B", "frequency: outside each "
                   "pass's top-B"],
                  [[b, f"{s:.2%}", f"{f:.2%}"] for b, s, f in mean.iter_rows()],
                  frozenset({0, 1, 2}))
    source = run.manifest.get("source") or {}
    note = (f"Routing-only: imported from {source.get('engine') or run.source_format} "
            f"({source.get('version')}) — top-k expert ids per token and MoE layer, no router "
            "probabilities, trees or hidden states. Every figure counts routed tokens instead of "
            "router mass; a \"tree\" is a batch pass ("
            + ("the source's recorded forward passes" if figs.batching == "recorded" else
               f"virtual batches of b = {figs.batch_size} consecutive requests at the same "
               "decode step") + "). Replay does not apply (nothing to recompute).")
    if len(runs) > 1:
        note += f" Key numbers and truncation coverage are run {run.name}'s (of {len(runs)})."
    return dict(note=note, table=table, numbers=ids.key_numbers(figs),
                figure=figures.truncation_coverage(trunc, n))


def dataset_figures(con, frames: dict, model: str, bench: str, manifest: dict,
                    root: Path | None = None) -> list:
    n = manifest["num_experts"]
    part = partition_value(model)
    pick = lambda name: frames[name].filter((pl.col("model") == part)  # noqa: E731
                                            & (pl.col("bench") == bench))
    figs = routing_figures(con, frames, model, bench, manifest)
    if "errors" in frames and pick("errors").height:
        curves = pick("errors")
        fixed = replay_views.fixed_only(curves)
        if fixed.height:
            figs.append(figures.error_vs_budget(fixed, n))
        if set(curves["budget_mode"]) != {replay_views.FIXED}:
            figs.append(figures.error_vs_experts(curves, n))
        if {"oracle", "router"} <= set(fixed["ranking"]):
            figs.append(figures.oracle_gap(replay_views.oracle_gap(curves)))
    if "closed" in frames and pick("closed").height:
        figs.append(figures.closed_loop(pick("closed"), n))
    figs += batch_figures(con, frames, model, bench, n)
    stats = routing_statistics(con, model, bench)
    captured_shape = model_shape(manifest["model_location"])
    if stats is not None and captured_shape is not None:
        for name, target in [("the captured shape", captured_shape), *(
                (f"{s.checkpoint}", cost.ModelShape.from_config(s.build_config()))
                for s in shapes.REAL_SHAPES.values())]:
            sp = speedup_frame(stats, target, list(cost.PROFILES.values()),
                               manifest["settings"].get("depth", 7))
            figs.append(figures.speedup(sp, f"Projected speedup on {name} "
                                            f"(τ from {stats['tau_source']})", speedup_note(sp),
                                        headline(sp)["row"]["budget"]))
    figs += [fig for fig, *_ in adaptive_projections(con, model, bench, manifest)]
    fitted = calibration_frame(con, model, bench, manifest)
    if fitted is not None and fitted[1].usable:  # an unusable fit is reported in words only
        frame, cal = fitted
        figs.append(figures.calibration(frame, (
            f"Cost model calibrated on {cal.points} measured verification passes: "
            f"T = {cal.alpha:.3g}·T_mem + {cal.beta:.3g}·T_flop + {cal.gamma * 1e3:.3g} ms, "
            f"relative RMSE {cal.relative_rmse:.1%}, R² {cal.r2:.2f}")))
    eta = efficiency_frame(root, model)
    if eta is not None:
        figs.append(figures.efficiency(eta))
    shape = model_shape(manifest["model_location"])
    front = frontier_frame(con, model, bench, shape, cost.PROFILES["H100-SXM"]) if shape else None
    if front is not None:
        flat = front["quality"].drop_nulls().n_unique() <= 1
        figs.append(figures.frontier(front, "agreement" if flat else "quality"))
    return figs


def batch_figures(con, frames: dict, model: str, bench: str, n: int) -> list:
    """The batch regime: experts a pass loads vs b (batched captures at two or more b), the error
    of a budget shared by each pass's trees (replay --batch-size, substitution), and
    profile-batch's measured speedup vs b with MoESD's fit and the roofline projection for
    OLMoE on an H100 (the latest profile run of this dataset)."""
    part = partition_value(model)
    figs = []
    batch = frames.get("batch")
    if batch is not None and batch.height:
        mine = batch.filter((pl.col("model") == part) & (pl.col("bench") == bench))
        if mine["batch_size"].n_unique() >= 2:
            figs.append(figures.batch_regime(mine, n))
    errors = frames.get("batch_errors")
    if errors is not None and errors.height:
        mine = errors.filter((pl.col("model") == part) & (pl.col("bench") == bench))
        if mine.height and mine["batch_size"].max() > 1:
            cover = "substitution" if "substitution" in set(mine["coverage"]) else \
                mine["coverage"][0]
            figs.append(figures.batch_errors(mine.filter(pl.col("coverage") == cover), n))
    speed = frames.get("batch_speed")
    if speed is not None and speed.height:
        mine = speed.filter((pl.col("model") == part) & (pl.col("bench") == bench))
        if mine.height:
            from moe_spec.analysis import timing
            run = mine["run"][-1]
            mine = timing.latest(mine.filter(pl.col("run") == run))  # one measurement
            fit = batch_fit(con, model, bench, run, mine)
            name, target = next(iter(real_targets().items()))
            hw = "H100-SXM"
            projection = batch_projection(mine, target, cost.PROFILES[hw],
                                          fit["gamma"] if fit else 63)
            shown = fit if fit and not fit["refused"] else None  # a refused fit is never drawn
            fig = figures.batch_speedup(mine, shown, projection, f"{name} on {hw}")
            if fit:  # the fit's sample and the warm-up rule, in words on the figure
                from moe_spec.analysis import warmup
                left = fit["left_out"]
                said = fit["refused"] or (
                    f"fitted to {fit['coef']['points']} (b, γ) points" + (
                        f"; left out: {', '.join(left[:4])}{' …' if len(left) > 4 else ''}"
                        if left else ""))
                fig.add_annotation(text=f"MoESD's pass-time model {said}<br>{fit['dropped']} "
                                        f"passes dropped as warm-up ({warmup.RULE_SHORT})",
                                   showarrow=False, xref="paper", yref="paper", x=0.01, y=0.99,
                                   xanchor="left", yanchor="top", align="left",
                                   bgcolor="rgba(255,255,255,0.8)", font=dict(size=10))
            figs.append(fig)
    return figs


def key_numbers(con, frames: dict, model: str, bench: str, runs: list) -> list[tuple[str, str]]:
    """The figures a reader wants first: τ, unique experts, gap closed, projected speedup."""
    part = partition_value(model)
    row = con.execute("""SELECT avg(accepted_length), avg(list_avg(unique_experts)),
                          count(*), count(DISTINCT run) FROM trees WHERE model = ?
                          AND bench = ? AND budget IS NULL""", [part, bench]).fetchall()[0]
    n = runs[0].manifest["num_experts"]
    out = [("mean accepted length τ", f"{row[0]:.2f}" if row[0] else "—"),
           ("unique experts per layer per tree", f"{row[1]:.1f} of {n}" if row[1] else "—"),
           ("verification trees", f"{row[2]} in {row[3]} run(s)")]
    curves = frames.get("errors")
    if curves is not None:
        c = replay_views.fixed_only(curves).filter((pl.col("model") == part) & (pl.col("bench") == bench))
        mid = sorted(set(c["budget"]))[len(set(c["budget"])) // 2] if c.height else -1
        head = headline_ranking(set(c["ranking"]))
        pick = {r: c.filter((pl.col("ranking") == r) & (pl.col("budget") == mid)
                            & (pl.col("coverage") == "truncation"))["rse"]
                for r in ("router", "oracle", head)}
        if all(v.len() for v in pick.values()) and pick["router"][0] > pick["oracle"][0]:
            gap = gap_closed(pick["router"][0], pick["oracle"][0], pick[head][0])
            out.append((f"router→oracle gap {head} closes at one budget, B = {mid} (the sweep's "
                        f"middle; truncation, mean RSE: (router − {head}) / (router − oracle), "
                        "not averaged over budgets)", f"{gap:.0%}"))
    projection = headline_projection(con, model, bench, runs[0].manifest)
    if projection is not None:
        where, sp, top = projection
        row = top["row"]
        value = (f"{row['speedup']:.2f}× ({speedup_interval(row)}) at B = {row['budget']} of "
                 f"{row['target_experts']}")
        value += " (no budget)" if row["captured_budget"] == row["num_experts"] else \
            f" ({row['quality']})"
        out.append((f"best projected speedup over AR on H100 ({where}) within the quality "
                    f"bound: {top['bound']}", value + (f"; {top['note']}" if top["note"] else "")))
    return out


def adaptive_projections(con, model: str, bench: str, manifest: dict) -> list:
    """(figure, per-mode headline rows, target name) of each ranking × coverage replayed under an adaptive
    budget: projected speedup on H100 against the mean experts loaded per layer, fixed vs
    adaptive (:func:`analysis.frames.mode_speedup_frame`), on the family's real checkpoint (the
    captured shape when there is none)."""
    shape = model_shape(manifest["model_location"])
    if shape is None:
        return []
    real = real_target(manifest, model)
    where, target = (real[0], real[1]) if real else ("the captured shape", shape)
    hw = cost.PROFILES["H100-SXM"]
    out = []
    for ranking, coverage in adaptive_curves(con, model, bench):
        stats = routing_statistics(con, model, bench, ranking=ranking, coverage=coverage)
        if stats is None:
            continue
        frame = mode_speedup_frame(con, model, bench, stats, target, [hw],
                                   manifest.get("settings", {}).get("depth", 7))
        fig = figures.speedup_vs_experts(
            frame, f"Projected speedup on {where}, {ranking} ({coverage}): fixed vs adaptive",
            MODE_SPEEDUP_NOTE)
        out.append((fig, [dict(ranking=ranking, coverage=coverage, **r)
                          for r in mode_headline_rows(frame)], where))
    return out


def adaptive_table(con, model: str, bench: str, manifest: dict) -> dict | None:
    """Per ranking × coverage × budget mode, the fastest budget within the quality bound on
    H100 and its mean experts per layer (fixed vs adaptive, :func:`adaptive_projections`), as a
    table for the template (or None without adaptive results)."""
    found = adaptive_projections(con, model, bench, manifest)
    rows = [r for _, mine, _ in found for r in mine]
    if not rows:
        return None
    return dict(where=found[0][2], table=Table(list(rows[0]), [list(r.values()) for r in rows],
                                               frozenset({len(rows[0]) - 1})))


def headline_ranking(replayed: set[str]) -> str:
    """The ranking the report's key numbers feature: the one :mod:`policy.index` recommends
    (``RECOMMENDED``), else its choice without a surrogate, whichever was replayed first in that
    order (the recommended one when neither was)."""
    choices = (index.RECOMMENDED, index.RECOMMENDED_WITHOUT_SURROGATE)
    return next((r for r in choices if r in replayed), index.RECOMMENDED)


def headline_projection(con, model: str, bench: str, manifest: dict):
    """(target name, speedup frame on H100, :func:`analysis.frames.headline`) for the real
    checkpoint of the captured family (the captured shape when there is none), or None. The
    family is the registry's (``moe.families.lookup``) for the ``model_type`` of the manifest
    (routing-only imports) or of the captured model's config, else for the model's name."""
    stats = routing_statistics(con, model, bench)
    shape = model_shape(manifest["model_location"])
    if stats is None or shape is None:
        return None
    real = real_target(manifest, model)
    target = real[1] if real else shape
    sp = speedup_frame(stats, target, [cost.PROFILES["H100-SXM"]],
                       manifest.get("settings", {}).get("depth", 7))
    return (real[0] if real else "the captured shape"), sp, headline(sp)


@dataclass(frozen=True)
class Table:
    """An HTML table for the template: header cells, rows of cells (any value, shown as text),
    the columns aligned right and the rows in bold (by index)."""

    head: list
    rows: list[list]
    right: frozenset[int] = field(default_factory=frozenset)
    bold: frozenset[int] = field(default_factory=frozenset)


def projection_section(con, model: str, bench: str, manifest: dict) -> dict:
    """Every projected speedup of the headline target with the quality its budget costs, how
    budgets were mapped (``projection``), and whether the cost model's calibration is usable
    (``calibration``): what the template draws, each None where there is nothing to say."""
    section = dict(projection=None, calibration=None)
    projection = headline_projection(con, model, bench, manifest)
    if projection is not None:
        where, sp, top = projection
        head = [f"B (of {sp['target_experts'][0]})", f"captured B (of {sp['num_experts'][0]})",
                "τ", "τ from", "quality at this budget", "within bound",
                "speedup on H100 (95% CI from τ)"]
        rows, bold = [], set()
        for i, r in enumerate(sp.sort("budget").iter_rows(named=True)):
            rows.append([r["budget"], r["captured_budget"], f"{r['tau']:.2f}", r["tau_source"],
                         r["quality"], {True: "yes", False: "no", None: "unknown"}[r["within_bound"]],
                         f"{r['speedup']:.2f}× ({speedup_interval(r)})"])
            if r["budget"] == top["row"]["budget"]:
                bold.add(i)
        section["projection"] = dict(where=where, bound=top["bound"], note=mapping_note(sp),
                                     table=Table(head, rows, frozenset({6}), frozenset(bold)))
    fitted = calibration_frame(con, model, bench, manifest)
    if fitted is not None:
        from moe_spec.analysis import warmup
        section["calibration"] = dict(verdict=f"{fitted[1].verdict}; {warmup.RULE}",
                                      usable=fitted[1].usable)
    return section


def ablation_table(frames: dict, model: str, bench: str) -> dict | None:
    """Where the replay holds router, oracle and ablation steps: the share of the router→oracle
    gap each step closes (``replay_views.ablation``), as a table for the template (or None)."""
    curves = frames.get("errors")
    if curves is None:
        return None
    gaps = replay_views.ablation(curves.filter((pl.col("model") == partition_value(model))
                                               & (pl.col("bench") == bench)))
    if gaps.is_empty():
        return None
    steps = gaps.columns[2:]
    rows = [[r["coverage"], r["budget"], *("—" if r[s] is None else f"{r[s]:.0%}" for s in steps)]
            for r in gaps.iter_rows(named=True)]
    return dict(note=replay_views.ABLATION_NOTE,
                table=Table(["coverage", "B", *steps], rows, frozenset(range(2, 2 + len(steps)))))


def experts_saved_table(frames: dict, model: str, bench: str, manifest: dict | None = None
                        ) -> dict | None:
    """Experts each ranking saves vs router at matched quality, open loop and, where replayed,
    closed loop (``replay_views.experts_saved_display``), and, for a ranking with bytes of its
    own, net of them at the captured and the real shape (``frames.selection_charges``), as a
    table for the template (or None)."""
    part = partition_value(model)
    mine = [f.filter((pl.col("model") == part) & (pl.col("bench") == bench))
            for f in (frames.get("saved_open"), frames.get("saved_closed")) if f is not None]
    mine = [f for f in mine if f.height]
    if not mine:
        return None
    charges = selection_charges(manifest, model) if manifest else None
    table = replay_views.experts_saved_display(pl.concat(mine), charges)
    pct = lambda v: "—" if v is None or v != v else f"{v:.0%}"  # noqa: E731 (NaN: none inside)
    nets = [c for c in table.columns if c.startswith("net, ")]
    head = ["loop", "matched on", "coverage", "ranking", "experts saved (mean share)",
            "95% interval", *nets, "router budgets inside", "per router budget: B → B_X (saved)"]
    rows = [[r["loop"], r["matched on"], r["coverage"], r["ranking"], pct(r["saved"]),
             f"{pct(r['saved_lo'])} – {pct(r['saved_hi'])}", *(pct(r[c]) for c in nets),
             r["router budgets inside"], r["per router budget: B → B_X (saved)"]]
            for r in table.iter_rows(named=True)]
    note = replay_views.SAVED_NOTE + (" " + replay_views.NET_NOTE if nets else "")
    return dict(note=note, table=Table(head, rows, frozenset({4, *range(6, 6 + len(nets))})))


def _dtype(value) -> str:
    """A dtype as a reader writes it: ``float32``, not ``torch.float32``."""
    return str(value or "").removeprefix("torch.")


def settings_table(runs: list) -> Table:
    """Every complete run of the dataset, calibration runs included (with their role)."""
    rows = []
    for r in runs:
        s = r.settings
        if r.routing_only:
            rows.append([r.name, r.role, r.manifest.get("prompts_total"), "—",
                         f"routing-only: imported from {r.source_format}", "—", "—", "—", "—"])
            continue
        rows.append([r.name, r.role, r.manifest.get("prompts_total"), s.get("max_new_tokens"),
                     f"{s.get('total_tokens')}/{s.get('depth')}/{s.get('tree_top_k')}",
                     s.get("temperature"), s.get("budget") or "—", _dtype(r.manifest.get("dtype")),
                     _dtype((r.manifest.get("storage") or {}).get("dtype"))])
    return Table(["run", "role", "prompts", "new tokens", "tree (nodes/depth/top-k)",
                  "temperature", "budget", "model dtype", "stored as"], rows)


TEMPLATES = Path(__file__).parent / "templates"  # the report's page: report.html.j2


@cache
def template(name: str = "report.html.j2") -> jinja2.Template:
    """The report's page, autoescaped: every value put in it is text (a model name, a manifest
    field, a table cell, a figure title), never markup, whatever it holds."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template(name)


@cache
def plotly_escapes_json() -> bool:
    """Whether plotly writes ``<`` and ``>`` in a figure's JSON as ``\\u003c`` / ``\\u003e``.
    The JSON sits in a ``<script>``, where only ``</script`` (and ``<!--``) mean anything to
    the HTML parser, and both need a ``<``: so no title, trace name or label can end it."""
    probe = pio.to_json(go.Figure(layout=dict(title=dict(text="</script><!--"))), validate=False)
    return "<" not in probe and ">" not in probe


def figure_html(fig: go.Figure, include_plotlyjs: bool) -> Markup:
    """A figure as plotly embeds it (a div and its script), safe to put in the page: its
    strings are inside JSON with ``<`` and ``>`` escaped (:func:`plotly_escapes_json`)."""
    if not plotly_escapes_json():
        raise RuntimeError("this plotly does not escape '<' in a figure's JSON; install "
                           "plotly>=5.20 (pyproject.toml's range)")
    return Markup(pio.to_html(fig, include_plotlyjs=include_plotlyjs, full_html=False))


STAMP = ".report-stamp.json"  # in --out: what the reports there were written from


def report_stamp(traces: Path, roles: tuple[str, ...], variants: tuple[str, ...] = ()) -> str:
    """What a report depends on: the traces (:func:`catalog.dataset_version`), the roles, the
    replay variants picked and the code that draws it (this package's sources)."""
    h = hashlib.sha256(f"{dataset_version(traces)}:{','.join(roles)}:{','.join(variants)}"
                       .encode())
    for source in sorted([*Path(__file__).parent.glob("*.py"), *TEMPLATES.glob("*.j2")]):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def unchanged(traces: Path, out: Path, roles: tuple[str, ...], variants: tuple[str, ...] = ()
              ) -> list[Path] | None:
    """The reports in ``out`` if they were written from exactly these traces, roles, variants
    and code (nothing to do), else None."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None
    paths = [out / name for name in stamp.get("reports", [])] if isinstance(stamp, dict) else []
    if not paths or stamp.get("stamp") != report_stamp(traces, roles, variants) \
            or not all(p.is_file() for p in paths):
        return None
    return paths


def setting_key(model: str, bench: str, runs: list) -> str:
    """A setting's identity for its report's name: dataset and the capture setting (never the
    runs in it, so adding a run to a setting keeps its name)."""
    digest = hashlib.sha256(json.dumps(runs[0].setting, sort_keys=True, default=str).encode())
    return f"{partition_value(model)}/{bench}/{digest.hexdigest()[:12]}"


def report_names(out: Path, groups: dict[tuple[str, str], list[list]]) -> dict[str, str]:
    """setting key (:func:`setting_key`) -> its report's file name, stable: a name written
    before (kept in ``out``'s stamp) stays; a new setting gets ``<model>_<bench>.html`` when no
    other setting of the dataset holds it, else ``<model>_<bench>_<run>.html`` after the first
    (by name) of its runs. Adding a run or a setting never renames a report."""
    try:
        stamp = json.loads((out / STAMP).read_text())
        known = dict(stamp.get("names") or {}) if isinstance(stamp, dict) else {}
    except (OSError, ValueError):
        known = {}
    names = {}
    for (model, bench), settings in groups.items():
        for runs in settings:
            key = setting_key(model, bench, runs)
            if isinstance(known.get(key), str):
                names[key] = known[key]
    for (model, bench), settings in groups.items():
        for runs in settings:  # most prompts first: the dataset's plain name, on a fresh --out
            key = setting_key(model, bench, runs)
            if key in names:
                continue
            taken = set(names.values()) | set(known.values())
            base = f"{partition_value(model)}_{bench}"
            name = f"{base}.html"
            if name in taken:
                name = f"{base}_{min(r.name for r in runs)}.html"
            if name in taken:
                name = f"{base}_{key.rsplit('/', 1)[1]}.html"
            names[key] = name
    return {**known, **names}


def write_report(traces: Path, out: Path, roles: tuple[str, ...] = ("evaluation",),
                 variants: tuple[str, ...] = ()) -> list[Path]:
    """One HTML file per dataset (model × benchmark) and capture setting of the complete runs in
    ``roles`` (named by :func:`report_names`), and, where there are several, ``index.html``
    listing them: key numbers,
    run settings, a table of contents, then every figure; replay results of the ``variants``
    picked, else the default rule's (:data:`analysis.sql.DEFAULT_VARIANT_RULE`)."""
    from moe_spec.analysis.compare import differing_keys, setting_words
    summaries.ensure(traces)  # routing summaries of new or changed runs, once
    if not {"trees", schema.ROUTING_IDS} & set(views(connect(traces, roles=roles))):
        raise FileNotFoundError(f"no complete {'/'.join(roles)} traces under {traces}; run "
                                "`capture` (or `import-routing`) first")
    written, index = [], []
    out.mkdir(parents=True, exist_ok=True)
    runs = Catalog(traces).runs(roles=roles, kinds=None)
    every_role = Catalog(traces).runs(roles=None, kinds=None)  # calibration runs too
    groups = setting_groups(runs)
    names = report_names(out, groups)
    for (model, bench), settings in groups.items():
        differ = differing_keys([g[0].setting for g in settings])
        for mine in settings:  # one report per capture setting: never pooled
            path = out / names[setting_key(model, bench, mine)]
            label = setting_words(mine[0].setting, differ)
            con = connect(traces, roles=roles, runs=tuple(r.name for r in mine),
                          variants=variants)
            frames = all_frames(con)
            run = mine[0]
            listed = [r for r in every_role if r.model == model and r.bench == bench]
            if run.routing_only:  # ids only: routing figures by counts, no trees or replay
                ids_part = routing_only_section(mine)
                figs = [figures.as_ids_only(f) for f in
                        routing_figures(con, frames, model, bench, run.manifest)]
                figs.append(ids_part["figure"])
                numbers = ids_part["numbers"]
                extra = dict(projection=None, calibration=None, ablation=None, saved=None,
                             adaptive=None)
            else:
                ids_part = None
                figs = dataset_figures(con, frames, model, bench, run.manifest, traces)
                numbers = key_numbers(con, frames, model, bench, mine)
                extra = dict(**projection_section(con, model, bench, run.manifest),
                             ablation=ablation_table(frames, model, bench),
                             saved=experts_saved_table(frames, model, bench, run.manifest),
                             adaptive=adaptive_table(con, model, bench, run.manifest))
            html = template().render(
                variants=variants_note(con, variants),
                model=model if len(settings) == 1 else
                f"{model} ({label}: runs {', '.join(r.name for r in mine)})", bench=bench,
                numbers=numbers, routing_only=ids_part,
                runs=settings_table(listed), **extra,
                figures=[dict(title=f.layout.title.text or f"figure {i + 1}",
                              html=figure_html(f, include_plotlyjs=(i == 0)))
                         for i, f in enumerate(figs)])
            atomic.write_bytes(path, html.encode("utf-8"))
            written.append(path)
            index.append(dict(file=path.name, dataset=f"{model} / {bench}", setting=label,
                              runs=", ".join(r.name for r in mine)))
    if len(index) > 1:  # several reports: a page that lists them
        atomic.write_bytes(out / INDEX, template("index.html.j2").render(
            reports=index, rule=DEFAULT_VARIANT_RULE, variants=", ".join(variants))
            .encode("utf-8"))
    atomic.write_bytes(out / STAMP, json.dumps(dict(
        stamp=report_stamp(traces, roles, variants), names=names,
        reports=[p.name for p in written])).encode())
    return written


INDEX = "index.html"  # in --out: every report written there, by dataset and setting


def check_variants(traces: Path, chosen: tuple[str, ...]) -> None:
    """Refuse, in one line, a ``--variant`` that names no stored replay variant (a calibration
    run's name or a variant hash)."""
    if not chosen:
        return
    con = connect(traces)
    known: set[str] = set()
    if "variants" in views(con):
        for variant, calibration in con.execute(
                "SELECT DISTINCT variant, calibration FROM variants").fetchall():
            known |= {variant, calibration}
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise UserError(f"--variant {unknown[0]} names no stored replay variant (a calibration "
                        "run's name or a variant hash); `query \"SELECT * FROM variants\"` "
                        "lists them")


def variants_note(con, chosen: tuple[str, ...] = ()) -> str | None:
    """Where a curve of these runs has more than one stored replay variant: which each curve
    draws, and how to draw another (the report's note); None where every curve has one."""
    from moe_spec.analysis.sql import several_variants, variant_label
    rows = several_variants(con)
    if not rows:
        return None
    curves = len({(r["table_name"], r["ranking"], r["coverage"], r["batch_size"]) for r in rows})
    drawn = "; ".join(variant_label(r) for r in rows if r["shown_by_default"])
    return (f"{curves} curve(s) have more than one stored variant ({len(rows)} in all); each "
            f"draws one whole variant — {'the one picked (--variant), else ' if chosen else ''}"
            f"{DEFAULT_VARIANT_RULE}. Drawn: {drawn}. `report --variant CAL_OR_HASH` draws "
            "another; `query \"SELECT * FROM variants\"` lists them.")


def setting_groups(runs: list) -> dict[tuple[str, str], list[list]]:
    """(model, bench) -> its runs grouped by capture setting (:attr:`catalog.Run.setting`), the
    group with most prompts first (then the one captured one sequence at a time): a report draws
    one group, never several pooled."""
    grouped: dict[tuple[str, str], dict[str, list]] = {}
    for r in runs:
        key = json.dumps(r.setting, sort_keys=True, default=str)
        grouped.setdefault((r.model, r.bench), {}).setdefault(key, []).append(r)
    return {k: sorted(g.values(), key=lambda rs: (
        -sum(len(r.manifest.get("prompt_ids", [])) for r in rs),
        rs[0].setting.get("batch_size", 1) != 1))  # then the plain capture (b = 1)
            for k, g in grouped.items()}


def write_comparison(traces: Path, out: Path, names: list[str],
                     roles: tuple[str, ...] | None = None, variants: tuple[str, ...] = ()
                     ) -> Path:
    """``report --compare``: the named runs side by side (:mod:`analysis.compare`): their
    settings diffed, key numbers, and the same figures with one line per run."""
    from moe_spec.analysis import compare
    found = {r.name: r for r in Catalog(traces).runs(roles=roles, names=names, kinds=None)}
    missing = [n for n in names if n not in found]
    if missing:
        raise FileNotFoundError(f"no complete run {missing[0]} under {traces} to compare; "
                                "`query \"SELECT run FROM runs\" --role all` lists them")
    runs = [found[n] for n in names]
    summaries.ensure(traces)
    con = connect(traces, roles=roles, runs=tuple(names), variants=variants)
    diff = compare.settings_diff(runs)
    numbers = compare.key_numbers(con)
    figs = compare.compare_figures(con, runs=names) + compare.ids_figures(runs)
    missing = compare.left_out(con, names, "router", "truncation")
    rule = DEFAULT_VARIANT_RULE + (
        f". Left out of the error figure: run(s) {', '.join(missing)} (no open-loop replay of "
        "router, truncation)" if missing else "")
    html = template("compare.html.j2").render(
        runs=names, rule=rule,
        diff=dict(head=diff.columns, rows=diff.rows()),
        numbers=dict(head=numbers.columns, rows=[[f"{v:.3f}" if isinstance(v, float) else v
                                                  for v in row] for row in numbers.rows()]),
        figures=[dict(title=f.layout.title.text, html=figure_html(f, include_plotlyjs=(i == 0)))
                 for i, f in enumerate(figs)])
    out.mkdir(parents=True, exist_ok=True)
    label = "_vs_".join(names)
    if len(label) > 120:
        label = hashlib.sha256(label.encode()).hexdigest()[:12]
    path = out / f"compare_{label}.html"
    atomic.write_bytes(path, html.encode("utf-8"))
    return path


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(prog="report", description="Write one self-contained HTML report "
                                "per captured dataset (model × benchmark) with every figure.",
                               examples="""
                                   report --traces traces --out reports
                                   report --traces traces --role calibration
                                   report --traces traces --compare demo-eval other-run
                                   report --traces traces --variant cal-gsm8k
                                   report --traces traces --threads 2""")
    p.add_argument("--traces", default="traces", help="traces root: a folder or "
                                                      "s3://bucket/prefix")
    location.add_storage_options_argument(p)
    p.add_argument("--out", type=Path, default=Path("reports"), help="folder for the HTML files")
    p.add_argument("--role", default="evaluation", choices=("evaluation", "calibration", "all"),
                   help="which runs the figures draw (calibration runs are never pooled into "
                        "evaluation figures unless asked)")
    p.add_argument("--compare", nargs="+", default=None, metavar="RUN",
                   help="instead: one HTML putting these runs side by side (settings diffed, "
                        "key numbers, the same figures with a line per run)")
    p.add_argument("--variant", nargs="+", default=[], metavar="CAL_OR_HASH",
                   help="replay variants to draw instead of the default rule's, one per curve: "
                        "a calibration run's name or a variant hash (`query \"SELECT * FROM "
                        "variants\"` lists them; default: one whole variant per curve, the one "
                        "covering the most layers and budgets)")
    p.add_argument("--force", action="store_true",
                   help="rewrite reports even when the traces and the report code are unchanged")
    console.threads.add_argument(p, what="DuckDB and the numeric libraries")
    add_legacy_argument(p)
    args = p.parse_args(argv)
    console.threads.apply(args.threads, torch=False)
    allow_legacy(args)
    roles = ("evaluation", "calibration") if args.role == "all" else (args.role,)
    variants = tuple(args.variant)
    try:
        args.traces = location.from_args(args.traces, args.storage_options)
        atomic.check_outside(args.out, args.traces, "--out")
        check_variants(args.traces, variants)
        if args.compare:
            if len(args.compare) < 2:
                raise UserError("--compare needs two or more runs")
            print(f"wrote {write_comparison(args.traces, args.out, args.compare, None, variants)}")
            return 0
        kept = None if args.force else unchanged(args.traces, args.out, roles, variants)
        if kept is not None:
            for path in kept:
                print(f"unchanged {path} (same traces and report code; --force rewrites)")
            return 0
        written = write_report(args.traces, args.out, roles, variants)
    except FileNotFoundError as exc:  # no traces to report on
        return fail("report", exc)
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0]
        return fail("report", f"a trace table could not be read ({first[:200]}); recapture the "
                    "affected run")
    except atomic.UnsafeTarget as exc:  # an --out inside the traces, a link
        return fail("report", exc)
    except OSError as exc:
        return fail("report", f"cannot write to {args.out}: {exc.strerror or exc}; choose a "
                    "writable --out")
    except UserError as exc:
        return fail("report", exc)
    for path in written:
        print(f"wrote {path}")
    if len(written) > 1:
        print(f"wrote {args.out / INDEX} (every report, by dataset and setting)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
