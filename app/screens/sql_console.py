"""The SQL console: read-only SQL over the traces' views, with examples and downloads."""

from __future__ import annotations

import polars as pl
import streamlit as st

from moe_spec.analysis.sql import run_query
from moe_spec.app import data, views
from moe_spec.catalog.replay_metrics import OPEN_TABLE

TITLE = "SQL console"
ORDER = 110


# Run on the console's views, which hold evaluation runs unless the user widens them (a
# ``role`` column says which run is which either way).
EXAMPLES = {  # each gives one row per run (and variant): nothing pooled across runs or settings
    "τ and experts by run": "SELECT model, bench, run, role, avg(accepted_length) AS tau, "
                            "avg(list_avg(unique_experts)) AS unique_experts FROM trees "
                            "GROUP BY ALL ORDER BY ALL",
    "Unique experts per layer (first tree)": "SELECT run, prompt_index, unique_experts FROM trees "
                                             "WHERE step = 0 ORDER BY run, prompt_index LIMIT 20",
    "Accepted path of one tree": "SELECT node, parent, depth, token_id, draft_logprob FROM nodes "
                                 "WHERE accepted AND (run, prompt_index, step) = (SELECT (run, "
                                 "prompt_index, step) FROM nodes ORDER BY run, prompt_index, "
                                 "step LIMIT 1) ORDER BY depth",
    "Error vs budget (replay)": "SELECT run, ranking, coverage, budget, avg(rse) AS rse FROM "
                                f"{OPEN_TABLE} GROUP BY ALL ORDER BY ALL",
    "Replay variants": "SELECT * FROM variants",
    "Runs and their settings": "SELECT run, role, max_new_tokens, temperature, tree_total_tokens, "
                               "tree_depth, batch_size, storage FROM runs ORDER BY run",
}

ROUTING_EXAMPLES = {  # a folder of routing-only runs (imported): no trees, nodes or replay views
    "Routed experts (routing-only runs)": "SELECT run, prompt_index, token, layer, topk_ids FROM "
                                          "routing_ids ORDER BY ALL LIMIT 20",
    "Runs and their kind": "SELECT run, role, kind, source_format, prompts FROM runs "
                           "ORDER BY run",
}


def draw() -> None:
    ds = views.dataset()
    st.header("SQL console")
    st.caption("How to read this: read-only SQL (SELECT, WITH … SELECT, EXPLAIN) over the views " +
               ", ".join(ds.views) + "; hive partitions (model, bench, run) and each run's role "
               "are columns. Pick an example to start from, edit it, download the result.")
    examples = EXAMPLES if "trees" in ds.views else ROUTING_EXAMPLES
    if examples is ROUTING_EXAMPLES:
        st.caption("These runs are routing-only (imported: top-k ids only): there are no trees, "
                   "nodes or replay views; `routing_ids` and the `summary_*` views hold them.")
    c1, c2 = st.columns([3, 1])
    example = views.url_select(c1, "Example", list(examples), "sql_example", "example")
    scope = c2.radio("Views hold", ["evaluation runs", "all roles"], key="sql_roles",
                     help="evaluation runs: calibration runs are not pooled into results; all "
                          "roles: every run, told apart by the role column")
    roles = ("evaluation",) if scope == "evaluation runs" else ("evaluation", "calibration")
    sql = st.text_area("Query", examples[example], height=120, key=f"sql_{example}")
    try:
        frame = pl.from_arrow(run_query(ds.con_for(roles), sql))
    except Exception as exc:  # noqa: BLE001 - show the database's message, not a traceback
        st.error(f"Query failed: {str(exc).splitlines()[0]}")
        return
    st.dataframe(frame, hide_index=True, width="stretch")
    nested = data.nested_columns(frame)
    c1, c2, c3 = st.columns(3)
    c1.download_button("Download Parquet", lambda: data.to_parquet(frame), "query.parquet",
                       "application/vnd.apache.parquet", key="sql_download_parquet")
    c2.download_button("Download JSON", lambda: frame.write_json(), "query.json",
                       "application/json", key="sql_download_json")
    c3.download_button("Download CSV", lambda: data.to_csv(frame), "query.csv", "text/csv",
                       key="sql_download", help="list and struct columns as JSON text"
                       if nested else None)
    if nested:
        st.caption("CSV cannot hold lists: in the CSV download the column(s) "
                   + ", ".join(f"`{c}`" for c in nested) + " are JSON text; Parquet and JSON "
                   "keep them as they are.")


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
