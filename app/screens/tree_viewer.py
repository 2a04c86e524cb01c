"""The tree viewer: one verification tree, the accepted path, the nodes a budget costs
experts."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl
import streamlit as st

from moe_spec.app import data, views
from moe_spec.catalog import partition_value

TITLE = "Tree viewer"
ORDER = 90


def draw() -> None:
    page = views.start_page(
        "Tree viewer", "tree",
        "How to read this: one verification tree of one prompt and step, drafted "
        "tokens by depth; red is the path the target accepted, orange nodes lose one of "
        "their experts in this layer if only the router's top-B experts are kept.",
        trees=True)
    if page is None:
        return
    ds, roles, model, bench, runs = page
    c1, c2, c3 = st.columns(3)
    run = views.url_select(c1, "Run", runs["run"].to_list(), "tree_run", "run")
    info = runs.filter(pl.col("run") == run).row(0, named=True)
    part = partition_value(model)
    con = page.con
    steps = con.execute("""SELECT prompt_index, any_value(prompt_id), max(step) FROM trees
                            WHERE run = ? AND model = ? AND bench = ?
                            GROUP BY prompt_index ORDER BY 1""", [run, part, bench]).fetchall()
    labels = {p: f"{p} ({pid})" for p, pid, _ in steps}
    prompt = c2.selectbox("Prompt", list(labels), format_func=labels.get, key="tree_prompt")
    last = {p: s for p, _, s in steps}[prompt]
    step = c3.number_input("Step", 0, last, 0, key="tree_step")
    c4, c5 = st.columns(2)
    layer = c4.selectbox("Layer", info["moe_layers"], key="tree_layer")
    budget = c5.slider("Budget B (router ranking)", 1, info["num_experts"],
                       min(info["num_experts"], max(info["top_k"], info["num_experts"] // 2)),
                       key="tree_budget")
    where = (ds.root, model, bench, run)  # one prompt's part files, not a scan of the run
    nodes = data.prompt_rows(*where, "nodes", int(prompt), ["step", "node", "parent", "depth",
                             "token_id", "draft_logprob", "accepted"], step=int(step)) \
        .drop("step").sort("node")
    rout = data.prompt_rows(*where, "routing", int(prompt), ["step", "layer", "node",
                            "router_probs", "topk_ids"], step=int(step), layer=int(layer)) \
        .select("node", "router_probs", "topk_ids").sort("node")
    tokenizer = data.tokenizer(info["model_location"])
    text = [tokenizer.decode([t]) if tokenizer else str(t) for t in nodes["token_id"].to_list()]
    with st.expander(f"Prompt {labels[prompt]} of {bench}", expanded=False):
        prompt_ids = data.prompt_rows(*where, "sequences", int(prompt),
                                      ["prompt_token_ids"])["prompt_token_ids"][0].to_list()
        st.text(tokenizer.decode(prompt_ids) if tokenizer else str(prompt_ids))
    probs = np.stack(rout["router_probs"].to_list())
    shortlist = set(np.argsort(-probs.sum(0), kind="stable")[:budget].tolist())
    dropped = [sorted(set(t) - shortlist) for t in rout["topk_ids"].to_list()]
    st.plotly_chart(_tree_figure(nodes, dropped, text), width="stretch")
    table = nodes.with_columns(text=pl.Series([_visible(t) for t in text], dtype=pl.String),
                               experts=rout["topk_ids"],
                               dropped_at_budget=pl.Series(dropped, dtype=pl.List(pl.Int64)))
    lost_accepted = sum(1 for a, d in zip(nodes["accepted"], dropped) if a and d)
    st.write(f"{sum(1 for d in dropped if d)} of {len(dropped)} nodes lose experts at B={budget} "
             f"({lost_accepted} of them on the accepted path); the tree touches "
             f"{len({e for t in rout['topk_ids'].to_list() for e in t})} experts in layer "
             f"{layer}.")
    st.dataframe(table, hide_index=True)


_WHITESPACE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def _visible(token: str) -> str:
    """A token with its whitespace drawn (space ␣, newline ⏎, tab ⇥, carriage return ␍; the
    empty string ∅), so a whitespace token is never a blank label."""
    return token.translate(_WHITESPACE) if token else "∅"


def _tidy_x(parent: np.ndarray) -> np.ndarray:
    """Each node's x in a tidy tree (rows in node order, ``parent`` by row, −1 for a root):
    leaves at 0, 1, 2, … in depth-first order (children in node order), every other node at
    the centre of its children's span, ``x = (x(first child) + x(last child)) / 2``. Subtrees
    hold disjoint, contiguous ranges of leaves, so a parent sits above its children and no two
    edges cross."""
    n = len(parent)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for j, p in enumerate(parent):
        (children[p] if 0 <= p < n and p != j else roots).append(j)
    x, leaf = np.zeros(n), 0
    stack = [(r, False) for r in reversed(roots)]
    while stack:  # iterative post-order: a tree can be deeper than the recursion limit
        j, done = stack.pop()
        if done:
            x[j] = (x[children[j][0]] + x[children[j][-1]]) / 2
        elif not children[j]:
            x[j], leaf = leaf, leaf + 1
        else:
            stack.append((j, True))
            stack.extend((c, False) for c in reversed(children[j]))
    return x


def _tree_figure(nodes: pl.DataFrame, dropped: list, text: list[str]) -> go.Figure:
    """The draft tree, parent above its children (:func:`_tidy_x`), depth down. Labels are the
    first 4 characters of the token with whitespace visible (:func:`_visible`; the hover has
    the whole token); within a depth, neighbours closer than 2 leaf widths put their labels on
    alternate sides (above, below) so they do not overlap."""
    import html
    depth = nodes["depth"].to_numpy()
    row = {int(n): j for j, n in enumerate(nodes["node"].to_list())}
    parent = np.array([row.get(int(p), -1) for p in nodes["parent"].to_list()], dtype=int)
    x = _tidy_x(parent)
    where = np.full(len(depth), "top center", dtype=object)
    for d in np.unique(depth):
        idx = np.flatnonzero(depth == d)
        idx = idx[np.argsort(x[idx], kind="stable")]
        for a, b in zip(idx, idx[1:]):
            if x[b] - x[a] < 2 and where[a] == "top center":
                where[b] = "bottom center"
    fig = go.Figure()
    ex, ey = [], []
    for j, p in enumerate(parent):
        if p >= 0:
            ex += [x[p], x[j], None]
            ey += [-depth[p], -depth[j], None]
    fig.add_scatter(x=ex, y=ey, mode="lines", line=dict(color="#bbb"), hoverinfo="skip",
                    showlegend=False)
    acc = nodes["accepted"].to_numpy()
    lose = np.array([bool(d) for d in dropped])
    kinds = [("accepted path", acc & ~lose, "#d62728", "circle"),
             ("accepted, loses experts at this budget", acc & lose, "#d62728", "x"),
             ("loses experts at this budget", ~acc & lose, "#ff7f0e", "circle"),
             ("other drafted nodes", ~acc & ~lose, "#1f77b4", "circle")]
    for name, sel, color, symbol in kinds:
        if not sel.any():
            continue
        hover = [f"node {n}: {html.escape(_visible(t), False)} ({html.escape(repr(t), False)})<br>"
                 f"log q {s:.2f}<br>dropped {d}" for n, t, s, d, k in
                 zip(nodes["node"], text, nodes["draft_logprob"], dropped, sel) if k]
        labels = [_visible(t) for t, k in zip(text, sel) if k]
        fig.add_scatter(x=x[sel], y=-depth[sel], mode="markers+text", name=name,
                        marker=dict(size=12, color=color, symbol=symbol),
                        text=[html.escape(t if len(t) <= 4 else t[:4] + "…", quote=False)
                              for t in labels],
                        textposition=list(where[sel]), textfont=dict(size=10, color="#222"),
                        hovertext=hover, hoverinfo="text")
    fig.update_layout(template="plotly_white", height=max(480, 80 * int(depth.max(initial=0)) + 180),
                      margin=dict(l=10, r=10, t=100, b=10),
                      title="Draft tree, parents above children (␣ space, ⏎ newline, ⇥ tab; "
                            "hover: whole token)",
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0))
    fig.update_xaxes(visible=False, title="leaves in depth-first order, parents centred")
    fig.update_yaxes(title="depth", tickvals=-np.unique(depth), ticktext=np.unique(depth),
                     range=[-depth.max(initial=0) - 0.6, 0.6])  # room for the outer labels
    return fig


if __name__ == "__main__":  # Streamlit runs this file as the page (app/main.py)
    draw()
