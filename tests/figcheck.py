"""What every figure the workbench draws must have: a title, a title on every visible axis
(shared axes of a subplot grid excepted: their first axis carries it) and a titled colour bar."""

from __future__ import annotations

import re


def _text(title) -> str:
    if isinstance(title, str):
        return title.strip()
    return ((title or {}).get("text") or "").strip()


def problems(spec: dict) -> list[str]:
    """Everything missing from one figure given as plotly JSON (``{"data": ..., "layout": ...}``)."""
    layout, found = spec.get("layout", {}), []
    name = _text(layout.get("title")) or "untitled figure"
    if not _text(layout.get("title")):
        found.append("figure has no title")
    axes = {k: v for k, v in layout.items() if re.fullmatch(r"[xy]axis\d*", k)}
    for key in ("xaxis", "yaxis"):
        axes.setdefault(key, {})  # plotly's default axes exist even when not configured
    for key, axis in axes.items():
        if axis.get("visible") is False or axis.get("matches") or _text(axis.get("title")):
            continue
        if key[1:] and any(_text(a.get("title")) for k, a in axes.items() if k[0] == key[0]):
            continue  # a subplot's axis beside one that says what the axis is
        found.append(f"{name}: {key} has no title")
    for trace in spec.get("data", []):
        if trace.get("type") == "heatmap" and trace.get("showscale", True) is not False:
            if not _text((trace.get("colorbar") or {}).get("title")):
                found.append(f"{name}: heatmap colour bar has no title")
    return found
