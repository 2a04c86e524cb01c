"""Reading captured tree-layers back: one prompt at a time, columnar, no Python rows.

A *tree-layer* is one verification pass (tree) at one MoE layer: M node rows of ``routing``
(router scores ``g [M, N]``, natural top-k ids and mixing weights ``[M, k]``) and, where stored,
of ``moe_io`` (MoE input ``h [M, H]`` and output ``O* [M, H]``). :func:`prompt_chunks` returns a
prompt's tree-layers one written chunk at a time as flat arrays plus boundaries, so memory is
bounded by one chunk and callers can batch tree-layers without copying them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from moe_spec.catalog import columns, location
from moe_spec.catalog.columns import VECTOR_TYPES, expected_types, reason  # noqa: F401 - (re-exported)
from moe_spec.catalog.parts import ABSURD, ROW_KEYS, bfloat16_bits, check_values, matrix  # noqa: F401 - (re-exported: readers and writers use them)
from moe_spec.catalog.parts import manifest_mismatch as _mismatch
from moe_spec.catalog.runs import CatalogError, Run

_expected_types, _reason = expected_types, reason  # (the names other modules use)

ROUTING_COLUMNS = ["prompt_id", "step", "layer", "node", "router_probs", "topk_ids",
                   "topk_weights"]
IO_COLUMNS = ["step", "layer", "node", "hidden", "output", "output_norm"]
_ORDER = [("step", "ascending"), ("layer", "ascending"), ("node", "ascending")]


def read_parts(run: Run, table: str, prompt_index: int, columns: list[str],
               parts: list[Path] | None = None) -> pa.Table:
    """Rows of one prompt of one table (all its parts, or the given ones)."""
    parts = run.parts(table, prompt_index) if parts is None else parts
    if not parts:
        raise CatalogError(f"{run.dir(table)} has no part for prompt {prompt_index}; the trace "
                           "is incomplete, recapture the run")
    tables = []
    for path in parts:
        try:
            t = location.read_table(path, columns=columns, page_checksum_verification=True)
            tables.append(_expected_types(t, table))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise CatalogError(f"{path}: corrupt or unreadable {table} part "
                               f"({_reason(exc, path)}); recapture the run") from exc
    return pa.concat_tables(tables)


def check_paths(paths: list, table: str) -> None:
    """Every file of ``paths`` is readable Parquet with ``table``'s column types (from the
    footers only: what :func:`read_parts` checks); else :class:`CatalogError` naming the first
    bad file. Readers of a run without a commit record call this, so a damaged or retyped file
    is refused instead of silently coerced."""
    for path in paths:
        try:
            columns.check_footer(path, table)
        except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
            raise CatalogError(f"{path}: corrupt or unreadable {table} part "
                               f"({_reason(exc, path)}); recapture the run") from exc


@dataclass
class PromptTreeLayers:
    """Every tree-layer of one prompt, rows sorted by (step, layer, node).

    Tree-layer r spans rows ``bounds[r]:bounds[r + 1]``; ``step[r]`` and ``layer[r]`` name it."""

    prompt_index: int
    prompt_id: str
    step: np.ndarray  # [R] int
    layer: np.ndarray  # [R] int
    bounds: np.ndarray  # [R + 1] row offsets
    probs: np.ndarray  # [rows, N] float32
    topk_ids: np.ndarray  # [rows, k] int64
    topk_weights: np.ndarray  # [rows, k] float32
    hidden: np.ndarray | None  # [rows, H] float32
    output: np.ndarray | None  # [rows, H] float32; None where the storage policy recomputes it
    output_norm: np.ndarray | None = None  # [rows] ||O*_t||
    trees: np.ndarray | None = None  # [R] trees merged into each (replay.virtual_batch); None: 1

    def __len__(self) -> int:
        return len(self.step)

    def rows(self, r: int) -> slice:
        return slice(int(self.bounds[r]), int(self.bounds[r + 1]))

    def select(self, layers) -> list[int]:
        """Tree-layer numbers whose layer is in ``layers`` (all when None)."""
        if layers is None:
            return list(range(len(self)))
        wanted = set(layers)
        return [r for r in range(len(self)) if int(self.layer[r]) in wanted]

    def tree_layer(self, r: int) -> TreeLayer:
        rows = self.rows(r)
        return TreeLayer(self.prompt_index, self.prompt_id, int(self.step[r]), int(self.layer[r]),
                         self.probs[rows], self.topk_ids[rows], self.topk_weights[rows],
                         None if self.hidden is None else self.hidden[rows],
                         None if self.output is None else self.output[rows])



def prompt_chunks(run: Run, prompt_index: int, *, with_io: bool = True) \
        -> Iterator[PromptTreeLayers]:
    """One prompt's tree-layers, one written chunk (``chunk_steps`` passes) at a time: memory
    stays bounded by a chunk however long the generation. With ``with_io``, only the
    tree-layers whose MoE tensors the storage policy kept."""
    io_parts = {p.name: p for p in run.parts("moe_io", prompt_index)} if with_io else {}
    for part in run.parts("routing", prompt_index):
        if with_io:
            io_part = io_parts.get(part.name, run.dir("moe_io") / part.name)
            if part.name not in io_parts and not io_part.is_file():
                raise CatalogError(f"{io_part} is missing (every routing part has its moe_io "
                                   "part); the trace was damaged, recapture the run")
            try:
                with location.parquet_file(io_part) as f:
                    empty = f.metadata.num_rows == 0
            except (pa.ArrowException, OSError) as exc:
                raise CatalogError(f"{io_part}: corrupt or unreadable moe_io part "
                                   f"({_reason(exc, io_part)}); recapture the run") from exc
            if empty:
                continue  # the storage policy kept no pass of this chunk
        yield _tree_layers(run, prompt_index, part.name, with_io)


def manifest_mismatch(run: Run, arrays: dict, layers: np.ndarray) -> str | None:
    """:func:`catalog.parts.manifest_mismatch` of ``run``'s manifest."""
    return _mismatch(run.manifest, arrays, layers)


def _keys(table: pa.Table) -> np.ndarray:
    return table["step"].to_numpy().astype(np.int64) * 100_000 + table["layer"].to_numpy()


def _tree_layers(run: Run, prompt_index: int, part: str | None, with_io: bool):
    routing_parts = None if part is None else [run.dir("routing") / part]
    routing = read_parts(run, "routing", prompt_index, ROUTING_COLUMNS, routing_parts
                         ).sort_by(_ORDER)
    io = None
    if with_io:
        io_parts = None if part is None else [run.dir("moe_io") / part]
        io = read_parts(run, "moe_io", prompt_index, IO_COLUMNS, io_parts).sort_by(_ORDER)
        routing = routing.filter(pa.array(np.isin(_keys(routing), _keys(io))))
        same = io.num_rows == routing.num_rows and all(
            io[c].equals(routing[c]) for c in ("step", "layer", "node"))
        if not same:
            raise CatalogError(f"routing and moe_io of prompt {prompt_index} in run {run.name} "
                               "disagree in rows; recapture the run")
    keys = _keys(routing)
    step = routing["step"].to_numpy()
    layer = routing["layer"].to_numpy()
    starts = np.r_[0, np.flatnonzero(np.diff(keys)) + 1] if len(keys) else np.zeros(0, np.int64)
    try:
        stored = io is not None and io["output"].null_count < io.num_rows
        arrays = dict(probs=matrix(routing["router_probs"]),
                      topk_ids=matrix(routing["topk_ids"], np.int64),
                      topk_weights=matrix(routing["topk_weights"]),
                      hidden=matrix(io["hidden"]) if io is not None else None,
                      output=matrix(io["output"]) if stored else None,
                      output_norm=io["output_norm"].to_numpy(zero_copy_only=False)
                      .astype(np.float32) if io is not None else None)
    except (ValueError, pa.ArrowInvalid) as exc:
        raise CatalogError(f"corrupt vectors in prompt {prompt_index} of run {run.name} ({exc}); "
                           "recapture the run") from exc
    where = run.dir("routing") / part if part else run.dir("routing")
    mismatch = manifest_mismatch(run, arrays, layer)
    if mismatch:
        raise CatalogError(f"{where}: {mismatch}; the manifest or the trace is damaged, "
                           "recapture the run")
    problem = check_values(arrays, routing.column("router_probs").type.value_type)
    if problem:
        table = "moe_io" if problem.split()[0] in ("hidden", "output", "output_norm") \
            else "routing"
        where = (run.dir(table) / part) if part else run.dir(table)
        raise CatalogError(f"{where}: {problem}; the trace is corrupt, recapture the run")
    return PromptTreeLayers(prompt_index, routing["prompt_id"][0].as_py() if len(keys) else "",
                            step[starts].astype(np.int64), layer[starts].astype(np.int64),
                            np.r_[starts, len(keys)].astype(np.int64), **arrays)


@dataclass
class TreeLayer:
    """One tree-layer's rows (views into a :class:`PromptTreeLayers`)."""

    prompt_index: int
    prompt_id: str
    step: int
    layer: int
    probs: np.ndarray  # [M, N]
    idx: np.ndarray  # [M, k]
    weights: np.ndarray  # [M, k]
    hidden: np.ndarray | None  # [M, H]
    output: np.ndarray | None  # [M, H]


def tree_layers(runs: list[Run], *, layers=None, with_io: bool = True) -> Iterator[TreeLayer]:
    """Every tree-layer of every complete prompt of ``runs``, one prompt in memory at a time."""
    for run in runs:
        for prompt in run.prompt_indices():
            for data in prompt_chunks(run, prompt, with_io=with_io):
                for r in data.select(layers):
                    yield data.tree_layer(r)
