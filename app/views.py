"""What every dashboard page shares: the dataset a session looks at, the role choice, the
dataset and setting pickers, selectors kept in the URL, and the no-data screen. No computation of
their own beyond wiring (all numbers come from :mod:`analysis` through :mod:`app.data`).

The pages themselves are ``app/screens/<name>.py``, one module each (:mod:`app.screens`).
Analysis pages draw evaluation runs by default; a sidebar selector switches the role.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import polars as pl
import streamlit as st

from moe_spec.analysis import figures
from moe_spec.analysis.compare import differing_keys, is_import, setting_words
from moe_spec.app import data
from moe_spec.catalog import partition_value
from moe_spec.catalog.schema import ROUTING_ONLY  # a run's kind when imported from a serving engine


def dataset() -> data.Dataset:
    """The traces this session looks at, fresh if a run landed since the last interaction."""
    root = st.session_state["root"]
    ds, problem = data.current(root)
    if ds is None:
        no_data(root, problem)
        st.stop()
    return ds


def role_choice(key: str) -> tuple[str, ...]:
    """The role(s) a page draws (evaluation unless the user picks otherwise)."""
    choice = st.sidebar.selectbox("Runs to draw", ["evaluation", "calibration", "all roles"],
                                  key=f"{key}_role",
                                  help="analyses draw evaluation runs; calibration runs are never "
                                       "pooled into them unless you choose so here")
    return ("evaluation", "calibration") if choice == "all roles" else (choice,)


def role_runs(ds: data.Dataset, roles: tuple[str, ...]) -> pl.DataFrame:
    """The complete runs of ``roles``."""
    return ds.runs.filter(pl.col("role").is_in(list(roles)))


def url_select(container, label: str, options: list, key: str, param: str, index: int = 0,
               **kw):
    """A selectbox whose choice lives in the URL (``?param=value``): a deep link restores it,
    and picking another option updates the address bar."""
    options = list(options)
    labels = [str(o) for o in options]
    wanted = st.query_params.get(param)
    if key not in st.session_state and wanted in labels:
        index = labels.index(wanted)
    value = container.selectbox(label, options, index=min(index, max(len(options) - 1, 0)),
                                key=key, **kw)
    if value is not None:
        st.query_params[param] = str(value)
    return value


def fresh_selection(key: str, options: list) -> None:
    """Drop a widget's stale state: when its options changed since the last rerun (another
    dataset, setting or variant), its kept selection starts over, never showing a choice the
    page no longer offers."""
    seen = f"{key}__options"
    if st.session_state.get(seen) != [str(o) for o in options]:
        st.session_state.pop(key, None)
        st.session_state[seen] = [str(o) for o in options]


def url_multiselect(label: str, options: list, key: str, param: str):
    """A multiselect (all options by default) kept in the URL as ``?param=a,b``; a selection
    kept from other options is dropped (:func:`fresh_selection`)."""
    default = list(options)
    fresh_selection(key, options)
    wanted = st.query_params.get(param)
    if key not in st.session_state and wanted is not None:
        default = [o for o in options if str(o) in wanted.split(",")] or default
    value = st.multiselect(label, options, default=default, key=key)
    st.query_params[param] = ",".join(str(v) for v in value)
    return value


def dataset_picker(ds: data.Dataset, key: str, roles=("evaluation",),
                   prefer: set | None = None, runs: pl.DataFrame | None = None
                   ) -> tuple[str, str] | None:
    """The dataset (model / benchmark) a page draws; starts at the first one in ``prefer`` (the
    datasets that have what the page shows) unless the URL names one. ``runs``: the runs to pick
    among (default: every complete run of ``roles``)."""
    every = role_runs(ds, roles)
    pairs = sorted({(r["model"], r["bench"]) for r in (every if runs is None else runs)
                    .iter_rows(named=True)})
    if not pairs:
        st.info(f"No complete {' or '.join(roles)} run yet." if runs is None or not imported(
            every).height else f"No complete {' or '.join(roles)} capture with "
            "verification trees yet (routing-only runs have none); capture one, e.g. "
            f"`capture --model tiny-olmoe --bench mbpp --limit 8 --out {ds.root}`.")
        return None
    first = next((i for i, p in enumerate(pairs) if prefer is None or p in prefer), 0)
    label = url_select(st, "Dataset (model / benchmark)", [f"{m} / {b}" for m, b in pairs],
                       key, "dataset", index=first)
    model, bench = label.split(" / ")
    return model, bench


def imported(runs: pl.DataFrame) -> pl.DataFrame:
    """The routing-only runs among ``runs`` (imported from a serving engine: top-k ids only)."""
    if "kind" not in runs.columns:
        return runs.clear()
    return runs.filter(pl.col("kind") == ROUTING_ONLY)


def with_trees(runs: pl.DataFrame) -> pl.DataFrame:
    """``runs`` without routing-only ones, for pages that need trees or replay; one caption
    says which imported runs are left out, when there are any."""
    left_out = imported(runs)
    if left_out.is_empty():
        return runs
    st.caption(f"Imported routing-only run(s) {', '.join(sorted(left_out['run']))} are left out: "
               "they hold top-k expert ids only, no verification trees to draw or replay.")
    return runs.filter(pl.col("kind") != ROUTING_ONLY)


def routing_only(runs: pl.DataFrame) -> bool:
    """Whether ``runs`` (one setting) are routing-only runs."""
    return runs.height > 0 and imported(runs).height == runs.height


def batch_passes(setting: dict) -> str:
    """What a routing-only run's batch pass is (its settings say): the source's recorded forward
    passes, or virtual batches of b consecutive requests."""
    batching = setting.get("batching")
    if batching == "recorded" or (batching not in ("virtual",) and setting.get("recorded_passes")):
        return "one of the source's recorded forward passes"
    from moe_spec.catalog.tokens import DEFAULT_BATCH
    b = setting.get("virtual_batch_size") or DEFAULT_BATCH
    return (f"a virtual batch: b = {b} consecutive requests at the same decode step (the import's "
            "`virtual_batch_size`)")


def ids_only_note(runs: pl.DataFrame) -> bool:
    """For routing-only runs: an ``st.info`` naming the source format and a caption saying what
    the figures measure; True when the page's figures must be drawn ids-only
    (:func:`figure`)."""
    if not routing_only(runs):
        return False
    formats = ", ".join(sorted({f for f in runs["source_format"] if f})) or "a serving engine"
    setting = json.loads(runs["setting"][0]) if "setting" in runs.columns else {}
    st.info(f"Routing-only run(s) {', '.join(sorted(runs['run']))}, imported from {formats}: "
            "top-k expert ids only (no router probabilities, trees or hidden states).")
    st.caption(f"Routing-only: here *mass* is routed-token counts (the tokens whose top-k holds "
               f"an expert, over all token-expert assignments), and a *tree* is a batch pass — "
               f"{batch_passes(setting)}.")
    return True


def figure(fig, ids_only: bool):
    """``fig`` as drawn for the page's runs: relabelled ids-only for routing-only runs."""
    return figures.as_ids_only(fig) if ids_only else fig


def datasets_in(frame: pl.DataFrame, ds: data.Dataset) -> set:
    """The (model, bench) pairs, as the picker names them, that have rows in ``frame``."""
    if frame.is_empty():
        return set()
    have = {(m, b) for m, b in frame.select("model", "bench").unique().iter_rows()}
    return {(r["model"], r["bench"]) for r in ds.runs.iter_rows(named=True)
            if (partition_value(r["model"]), r["bench"]) in have}


def setting_label(setting: dict, differ: list[str]) -> str:
    """A setting in a few words (:func:`analysis.compare.setting_words`), an import with what
    its batch pass is."""
    words = setting_words(setting, differ)
    if is_import(setting):
        words += f", batch pass = {batch_passes(setting).split(':')[0]}"
    return words


def setting_picker(runs: pl.DataFrame, key: str, across: tuple[str, ...] = (),
                   results: dict[str, int] | None = None) -> pl.DataFrame:
    """The runs of one setting: runs of one model and benchmark whose capture settings (the
    prompt range aside) are equal are one experiment; runs that differ are never pooled. With
    several settings a selector (in the URL) picks one — the one with most of the page's
    ``results`` (run -> cells drawn, where the page has some), then most prompts — and a note
    says what the others are. ``across``: settings the page itself draws on an axis (the batch
    page: ``batch_size``), which do not split the runs."""
    if runs.is_empty() or "setting" not in runs.columns:
        return runs
    runs = runs.with_columns(pl.col("setting").map_elements(
        lambda s: json.dumps({k: v for k, v in json.loads(s).items() if k not in across},
                             sort_keys=True), return_dtype=pl.String).alias("_group"))
    groups = runs.group_by("_group", maintain_order=True).agg(pl.col("run"),
                                                              pl.col("prompts").sum())
    if groups.height == 1:
        return runs.drop("_group")
    settings = [json.loads(s) for s in groups["_group"]]
    differ = differing_keys(settings)
    labels = [setting_label(s, differ) + f" — runs {', '.join(names)}"
              for s, names in zip(settings, groups["run"])]
    cells = [sum((results or {}).get(r, 0) for r in names) for names in groups["run"]]
    first = max(range(groups.height),  # the page's results, most prompts, the plain capture
                key=lambda i: (cells[i], groups["prompts"][i] or 0,
                               settings[i].get("batch_size") == 1))
    fresh_selection(key, labels)
    label = url_select(st, "Setting (runs with other settings are never pooled)", labels, key,
                       "setting", index=first)
    imports = sum(is_import(s) for s in settings)
    named = ", ".join(differ) or "nothing but their kind"
    st.caption(f"This dataset has {groups.height} capture settings (the captures differ in {named}"
               + (f"; {imports} routing-only import(s)" if imports else "") +
               "); the page draws one at a time. The *Compare runs* page sets them side by "
               "side.")
    return runs.filter(pl.col("run").is_in(groups["run"][labels.index(label)])).drop("_group")


class Page(NamedTuple):
    """What a one-dataset page works on, once the user picked roles, a dataset and a
    setting."""

    ds: data.Dataset
    roles: tuple[str, ...]
    model: str
    bench: str
    runs: pl.DataFrame  # the chosen roles' complete runs of this model, benchmark and setting

    @property
    def n(self) -> int:
        return int(self.runs["num_experts"][0])

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.runs["run"].to_list()))

    @property
    def con(self):
        """A cursor whose views hold these runs only."""
        return self.ds.con_for(self.roles, self.names)

    def frame(self, name: str) -> pl.DataFrame:
        """The analysis frame ``name`` of these roles, for this dataset and setting only."""
        found = data.frame(name, str(self.ds.root), self.ds.version, self.roles, self.names)
        if found.is_empty():
            return found
        return pick(found, self.model, self.bench)


def variant_picker(ds: data.Dataset, roles: tuple[str, ...], names: tuple[str, ...],
                   key: str) -> tuple[str, ...]:
    """The replay variants the user picks for the page's runs (one per curve; none picked: the
    default rule's, :data:`analysis.sql.DEFAULT_VARIANT_RULE`), offered whenever a curve has
    more than one stored variant, with a note saying which each curve draws."""
    from moe_spec.analysis.sql import DEFAULT_VARIANT_RULE, several_variants, variant_label
    rows = several_variants(ds.con_for(roles, names))
    if not rows:
        return ()
    labels = {r["variant"]: variant_label(r) for r in rows}
    options = list(labels)
    fresh_selection(key, options)
    wanted = [v for v in (st.query_params.get("variant") or "").split(",") if v in labels]
    chosen = st.multiselect("Replay variant (one per curve; none picked: the default rule's)",
                            options, default=wanted if key not in st.session_state else None,
                            format_func=labels.get, key=key)
    st.query_params["variant"] = ",".join(chosen)
    chosen = tuple(chosen)
    shown = [r for r in several_variants(ds.con_for(roles, names, chosen))
             if r["shown_by_default"]]
    curves = len({(r["table_name"], r["ranking"], r["coverage"], r["batch_size"]) for r in rows})
    st.caption(f"{curves} curve(s) here have more than one stored variant ({len(rows)} in all); "
               f"each curve draws one whole variant — the one picked above, else "
               f"{DEFAULT_VARIANT_RULE}. Drawn now: "
               + "; ".join(variant_label(r) for r in shown) + ". The SQL console's "
               "`SELECT * FROM variants` lists them; `replay_open_all` holds their rows.")
    return chosen


def start_page(title: str, key: str, caption: str | None = None, prefer=None,
               across: tuple[str, ...] = (), trees: bool = False) -> Page | None:
    """Header, the sidebar's role choice and the dataset picker every one-dataset page starts
    with; None (with a note shown) when there is nothing to draw. ``prefer(ds, roles)``: the
    datasets the picker should start at (those with this page's results). ``trees``: the page
    needs trees or replay, so routing-only runs are left out (a caption says so)."""
    ds = dataset()
    st.header(title)
    if caption:
        st.caption(caption)
    roles = role_choice(key)
    pool = with_trees(role_runs(ds, roles)) if trees else role_runs(ds, roles)
    picked = dataset_picker(ds, f"{key}_ds", roles, prefer(ds, roles) if prefer else None,
                            runs=pool if trees else None)
    if picked is None:
        return None
    model, bench = picked
    runs = pool.filter((pl.col("model") == model) & (pl.col("bench") == bench))
    return Page(ds, roles, model, bench, setting_picker(runs, f"{key}_setting", across))


def words_table(rows: pl.DataFrame | list[dict], percent: tuple[str, ...] = ()) -> None:
    """A table whose cells are words (a number beside its interval, a quality, a budget in
    words), drawn with ``st.table``: a long cell wraps onto more lines, so no column is ever cut
    on the right whatever the window's width (``st.dataframe`` keeps each cell on one line and
    scrolls sideways, hiding its last columns: issue 59). Numbers as read: floats to 4
    significant digits, ``percent`` columns as percentages; a missing value reads "—", never
    "None"."""
    frame = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(rows)

    def text(column: pl.Series) -> pl.Series:
        if column.dtype.is_float():
            shown = [None if v is None or v != v else f"{v:.1%}" if column.name in percent
                     else f"{v:.4g}" for v in column]
        else:
            shown = [None if v is None else str(v) for v in column]
        return pl.Series(column.name, shown, dtype=pl.String).fill_null("—")
    st.table(pl.DataFrame([text(c) for c in frame.iter_columns()]) if frame.width else frame,
             hide_index=True)


def pick(frame: pl.DataFrame, model: str, bench: str) -> pl.DataFrame:
    """The rows of ``frame`` (an analysis frame, partition-valued) of one model and benchmark."""
    return frame.filter((pl.col("model") == partition_value(model)) & (pl.col("bench") == bench))


def no_data(root, message: str) -> None:
    """The page shown while the traces root holds no complete run: the capture that makes one."""
    st.title("MoE-Spec workbench")
    st.warning(message)
    st.markdown(
        "Create data with a capture (the embedded model runs offline on a CPU):\n\n"
        f"```bash\ncapture --model tiny-olmoe --bench mbpp --limit 8 --out {root}\n```\n\n"
        "then, optionally, `replay --traces {root} --ranking router oracle --budget sweep`. "
        "This page updates when the data appears.".replace("{root}", str(root)))
