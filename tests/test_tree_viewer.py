"""The dashboard's tree viewer (app/screens/tree_viewer.py): a tidy layout, parents centred over
their children with no crossing edges, and token labels with their whitespace visible."""

import numpy as np
import polars as pl
import pytest

from moe_spec.app.screens.tree_viewer import _tidy_x, _tree_figure


def _tree():
    """A draft tree whose breadth-first rows interleave subtrees (the old layout crossed them)."""
    parent = [-1, 0, 0, 0, 1, 2, 1, 3, 2, 4, 5, 4]
    depth = [0]
    for p in parent[1:]:
        depth.append(depth[p] + 1)
    nodes = pl.DataFrame(dict(node=range(len(parent)), parent=parent, depth=depth,
                              token_id=range(len(parent)), draft_logprob=[-0.5] * len(parent),
                              accepted=[i in (0, 1, 4) for i in range(len(parent))]))
    text = [" ", "\n", "\t", "def", " return", "x", "\n    ", "", "y", "z", "(", ")"]
    return nodes, text


def test_tree_layout_is_tidy_parents_centred_and_edges_never_cross():
    nodes, _ = _tree()
    parent = np.array(nodes["parent"].to_list())
    depth = nodes["depth"].to_numpy()
    x = _tidy_x(parent)
    kids = {j: [c for c in range(len(parent)) if parent[c] == j] for j in range(len(parent))}
    leaves = [j for j in range(len(parent)) if not kids[j]]
    assert sorted(x[leaves]) == list(range(len(leaves)))  # leaves evenly spaced
    for j, c in kids.items():
        if c:
            assert x[j] == pytest.approx((x[c[0]] + x[c[-1]]) / 2)
    for d in np.unique(depth)[1:]:  # edges into depth d keep their parents' order: no crossing
        idx = np.flatnonzero(depth == d)
        idx = idx[np.argsort(x[idx])]
        assert list(x[parent[idx]]) == sorted(x[parent[idx]])
        assert len(set(x[idx])) == len(idx)  # no two nodes of a depth on one spot


def test_tree_labels_show_whitespace_and_alternate_when_close():
    nodes, text = _tree()
    fig = _tree_figure(nodes, [[]] * nodes.height, text)
    labels = [t for trace in fig.data if trace.mode == "markers+text" for t in trace.text]
    assert {"␣", "⏎", "⇥", "∅", "⏎␣␣␣…", "␣ret…"} <= set(labels)
    assert all(label.strip() for label in labels)  # no blank label
    hover = " ".join(h for trace in fig.data if trace.hovertext for h in trace.hovertext)
    assert "␣return" in hover and "' return'" in hover  # the whole token on hover
    places = [p for trace in fig.data if trace.mode == "markers+text"
              for p in trace.textposition]
    assert "bottom center" in places and "top center" in places
