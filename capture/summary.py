"""What a capture run produced, read back from disk: :class:`CaptureSummary` (torch-free, so a
complete run is answered by :func:`capture.plan.plan` without loading the model)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_spec.catalog import CatalogError, location
from moe_spec.catalog.writer import RunWriter


@dataclass
class CaptureSummary:
    root: Path
    model: str
    bench: str
    run: str
    prompts: int
    prompts_resumed: int  # already complete before this invocation
    trees: int
    tau: float
    unique_experts: float  # mean over trees and layers
    experts_loaded: float
    bytes_written: int
    seconds: float  # wall time of this invocation
    load_seconds: float = 0.0  # of which: loading model and draft
    prompts_with_trees: int | None = None  # prompts with at least one verification pass
    batch_size: int = 1  # b, sequences a verification pass holds (capture --batch-size)
    passes: int = 0  # verification passes (b = 1: one a tree)
    pass_unique_experts: float = 0.0  # |∪ of a pass's trees' experts| per layer, mean over passes


def summarise(writer: RunWriter, model: str, bench: str, run: str, resumed: int,
              seconds: float, load_seconds: float) -> CaptureSummary:
    """Figures of the whole run, read back from what is on disk (resumed prompts included):
    per tree (τ, unique experts and experts loaded, mean over trees of the mean over layers),
    prompts with at least one tree, and per verification pass: ``passes`` = distinct
    ``batch_pass`` (b = 1: one pass a tree) and the per-pass union, the mean over passes of
    ``mean over layers of batch_unique_experts`` (b = 1: the per-tree unique experts)."""
    import pyarrow as pa
    columns = ["prompt_index", "accepted_length", "unique_experts", "experts_loaded"]
    try:
        trees = location.read_table(writer.table_dir("trees"),
                                    columns=columns + ["batch_pass", "batch_unique_experts"])
    except (KeyError, pa.ArrowInvalid):  # a schema without batched passes: b = 1
        trees = location.read_table(writer.table_dir("trees"), columns=columns)
    seqs = location.read_table(writer.table_dir("sequences"), columns=["prompt_index"])
    mean_of = lambda col: float(np.mean([np.mean(v) for v in trees[col].to_pylist()])) \
        if trees.num_rows else 0.0  # noqa: E731
    unique = mean_of("unique_experts")
    try:
        manifest = writer.read_manifest() or {}
    except CatalogError:  # unreadable now: the run's b from its passes instead
        manifest = {"settings": {"batch_size": 2 if "batch_pass" in trees.column_names
                                 and trees["batch_pass"].null_count < trees.num_rows else 1}}
    b = int((manifest.get("settings") or {}).get("batch_size") or 1)
    passes, per_pass = trees.num_rows, unique
    if b > 1 and "batch_pass" in trees.column_names and trees.num_rows:
        union = {}  # every tree of a pass carries the pass's union: one per pass
        for p, u in zip(trees["batch_pass"].to_pylist(), trees["batch_unique_experts"].to_pylist()):
            if p is not None and u:
                union.setdefault(p, float(np.mean(u)))
        if union:
            passes, per_pass = len(union), float(np.mean(list(union.values())))
    with_trees = len(set(trees["prompt_index"].to_pylist()))
    return CaptureSummary(writer.root, model, bench, run, seqs.num_rows, resumed, trees.num_rows,
                          float(np.mean(trees["accepted_length"].to_numpy())) if trees.num_rows
                          else 0.0, unique, mean_of("experts_loaded"),
                          writer.bytes_written(), seconds, load_seconds, with_trees, b, passes,
                          per_pass)
