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

from app import data
from catalog import partition_value


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


def url_multiselect(label: str, options: list, key: str, param: str):
    """A multiselect (all options by default) kept in the URL as ``?param=a,b``."""
    default = list(options)
    wanted = st.query_params.get(param)
    if key not in st.session_state and wanted is not None:
        default = [o for o in options if str(o) in wanted.split(",")]
    value = st.multiselect(label, options, default=default, key=key)
    st.query_params[param] = ",".join(str(v) for v in value)
    return value


def dataset_picker(ds: data.Dataset, key: str, roles=("evaluation",),
                   prefer: set | None = None) -> tuple[str, str] | None:
    """The dataset (model / benchmark) a page draws; starts at the first one in ``prefer`` (the
    datasets that have what the page shows) unless the URL names one."""
    pairs = sorted({(r["model"], r["bench"]) for r in role_runs(ds, roles).iter_rows(named=True)})
    if not pairs:
        st.info(f"No complete {' or '.join(roles)} run yet.")
        return None
    first = next((i for i, p in enumerate(pairs) if prefer is None or p in prefer), 0)
    label = url_select(st, "Dataset (model / benchmark)", [f"{m} / {b}" for m, b in pairs],
                       key, "dataset", index=first)
    model, bench = label.split(" / ")
    return model, bench


def datasets_in(frame: pl.DataFrame, ds: data.Dataset) -> set:
    """The (model, bench) pairs, as the picker names them, that have rows in ``frame``."""
    if frame.is_empty():
        return set()
    have = {(m, b) for m, b in frame.select("model", "bench").unique().iter_rows()}
    return {(r["model"], r["bench"]) for r in ds.runs.iter_rows(named=True)
            if (partition_value(r["model"]), r["bench"]) in have}


def setting_picker(runs: pl.DataFrame, key: str, across: tuple[str, ...] = ()) -> pl.DataFrame:
    """The runs of one setting: runs of one model and benchmark whose capture settings (the
    prompt range aside) are equal are one experiment; runs that differ are never pooled. With
    several settings a selector (in the URL) picks one, the one with most prompts first, and a
    note says what the others are. ``across``: settings the page itself draws on an axis (the
    batch page: ``batch_size``), which do not split the runs."""
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
    differ = sorted({k for s in settings for k in s
                     if any(s.get(k) != other.get(k) for other in settings)})
    labels = [", ".join(f"{k} {s.get(k)}" for k in differ) + f" — runs {', '.join(names)}"
              for s, names in zip(settings, groups["run"])]
    first = max(range(groups.height),  # most prompts, then the plain capture (b = 1)
                key=lambda i: (groups["prompts"][i] or 0, settings[i].get("batch_size") == 1))
    label = url_select(st, "Setting (runs with other settings are never pooled)", labels, key,
                       "setting", index=first)
    st.caption(f"This dataset has {groups.height} capture settings (they differ in "
               f"{', '.join(differ)}); the page draws one at a time. The *Compare runs* page "
               "sets them side by side.")
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
        return pick(data.frame(name, str(self.ds.root), self.ds.version, self.roles,
                               self.names), self.model, self.bench)


def start_page(title: str, key: str, caption: str | None = None, prefer=None,
               across: tuple[str, ...] = ()) -> Page | None:
    """Header, the sidebar's role choice and the dataset picker every one-dataset page starts
    with; None (with a note shown) when there is nothing to draw. ``prefer(ds, roles)``: the
    datasets the picker should start at (those with this page's results)."""
    ds = dataset()
    st.header(title)
    if caption:
        st.caption(caption)
    roles = role_choice(key)
    picked = dataset_picker(ds, f"{key}_ds", roles, prefer(ds, roles) if prefer else None)
    if picked is None:
        return None
    model, bench = picked
    runs = role_runs(ds, roles).filter((pl.col("model") == model) & (pl.col("bench") == bench))
    return Page(ds, roles, model, bench, setting_picker(runs, f"{key}_setting", across))


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
