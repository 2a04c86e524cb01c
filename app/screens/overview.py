"""The runs overview: one row per complete run, τ and unique experts, what each run keeps."""

from __future__ import annotations

import polars as pl
import streamlit as st

from moe_spec.analysis.compare import differing_keys
from moe_spec.analysis.frames import routing_warnings
from moe_spec.app import data, views
from moe_spec.catalog import partition_value

TITLE = "Runs overview"
ORDER = 10


def draw() -> None:
    ds = views.dataset()
    st.header("Runs overview")
    st.caption("How to read this: one row per complete run; τ is the mean accepted length per "
               "verification tree, unique experts the experts a tree's tokens route to in one "
               "layer (averaged over layers and trees). The tiles count evaluation runs only and "
               "average one setting at a time (several settings: a row each below). Kind "
               "routing-only: a run imported from a serving engine (source format), top-k ids "
               "only, no trees.")
    frame = data.overview(str(ds.root), ds.version)
    for model, line in routing_warnings(ds.runs):
        st.warning(f"{model}: {line}")
    imports = views.imported(ds.runs)
    if frame.is_empty() and imports.height:  # routing-only runs alone: no τ, no trees
        c1, c2 = st.columns([0.8, 3])
        c1.metric("runs", ds.runs.height)
        c2.metric("routing-only runs (imported)", imports.height)
        st.info("routing-only runs: no trees — τ, verification trees and unique experts per tree "
                "need a capture. The routing pages draw these runs' routed-token counts over "
                "batch passes.")
    else:
        c1, c2, c3, c4 = st.columns([0.6, 1.5, 1.2, 2])  # room for the long labels in full
        c1.metric("runs", ds.runs.height)
        ev = frame.filter(pl.col("role") == "evaluation")
        c2.metric("verification trees (evaluation runs)", int(ev["trees"].sum()))
        settings = per_setting(ds.runs, ev)
        one = settings.height == 1  # a tile never averages two settings
        c3.metric("mean τ (evaluation runs)", f"{settings['tau'][0]:.2f}" if one else "—")
        c4.metric("unique experts / layer / tree (evaluation runs)",
                  f"{settings['unique_experts'][0]:.1f}" if one else "—")
        if settings.height > 1:
            st.caption(f"{settings.height} settings (dataset × capture setting) among the "
                       "evaluation runs: τ and unique experts are per setting, never averaged "
                       "across them:")
            st.dataframe(settings, hide_index=True, width="stretch")
        if imports.height:
            st.caption(f"{imports.height} routing-only run(s) (imported: top-k ids only) have no "
                       "trees: the tiles count and average captures only.")
    if frame["budget"].is_null().all():  # without a budget every tree loads what it uses
        frame = frame.drop("experts_loaded", "budget")
    st.dataframe(_table(ds.runs, frame), hide_index=True, width="stretch")
    storage = ds.runs.select("model", "bench", "run", "role", "storage")
    st.caption("What each run keeps of the MoE hidden states (routing, trees and nodes are "
               "always complete):")
    st.dataframe(storage, hide_index=True, width="stretch")
    st.caption(f"traces: `{ds.root}` · dataset version {ds.version}")


def per_setting(runs: pl.DataFrame, frame: pl.DataFrame) -> pl.DataFrame:
    """One row per dataset × capture setting of ``frame``'s runs (per-run numbers): runs,
    trees, and τ and unique experts over the setting's trees (tree-weighted), the setting
    labelled by what differs among the dataset's captures (:func:`app.views.setting_label`)."""
    import json
    if frame.is_empty():
        return pl.DataFrame(schema=dict(dataset=pl.String, setting=pl.String, runs=pl.String,
                                        trees=pl.Int64, tau=pl.Float64,
                                        unique_experts=pl.Float64))
    keyed = runs.select("model", "bench", "run", "setting").with_columns(
        pl.col("model").map_elements(partition_value, return_dtype=pl.String).alias("_part"))
    both = frame.join(keyed.drop("model").rename({"_part": "model"}), on=["model", "bench", "run"])
    rows = []
    for (model, bench), dataset in both.group_by(["model", "bench"], maintain_order=True):
        settings = {s: json.loads(s) for s in dataset["setting"].unique(maintain_order=True)}
        differ = differing_keys(list(settings.values()))
        for setting, mine in dataset.group_by("setting", maintain_order=True):
            w = mine["trees"].cast(pl.Float64)
            rows.append(dict(dataset=f"{model} / {bench}",
                             setting=views.setting_label(settings[setting[0]], differ),
                             runs=", ".join(sorted(mine["run"])), trees=int(w.sum()),
                             tau=float((mine["tau"] * w).sum() / w.sum()),
                             unique_experts=float((mine["unique_experts"] * w).sum() / w.sum())))
    return pl.DataFrame(rows).sort("dataset", "setting")


def _table(runs: pl.DataFrame, frame: pl.DataFrame) -> pl.DataFrame:
    """One row per complete run: what it is (kind, source format of an import) beside its trees'
    numbers (none for a routing-only run)."""
    left = runs.select("model", "bench", "run", "role", "kind", "source_format",
                       pl.col("prompts").cast(pl.Int64)).with_columns(
        pl.col("model").map_elements(partition_value, return_dtype=pl.String).alias("_part"))
    right = frame.drop("prompts", "role").rename({"model": "_part"})
    table = left.join(right, on=["_part", "bench", "run"], how="left").drop("_part")
    return table.sort("model", "bench", "run")


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
