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
from moe_spec.catalog.runs import CatalogError, Run

_expected_types, _reason = expected_types, reason  # (the names other modules use)

ROUTING_COLUMNS = ["prompt_id", "step", "layer", "node", "router_probs", "topk_ids",
                   "topk_weights"]
IO_COLUMNS = ["step", "layer", "node", "hidden", "output", "output_norm"]
_ORDER = [("step", "ascending"), ("layer", "ascending"), ("node", "ascending")]


def matrix(column: pa.ChunkedArray, dtype=np.float32) -> np.ndarray:
    """A list column of equal-length rows as a writable 2-D array ``[rows, width]``. Float
    vectors stored as uint16 are bfloat16 bit patterns (catalog.schema) and decode exactly."""
    arr = column.combine_chunks()
    if arr.null_count:
        raise ValueError("null rows in a vector column")
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    if flat.dtype == np.uint16 and np.dtype(dtype).kind == "f":
        values = (flat.astype(np.uint32) << 16).view(np.float32).astype(dtype)
    else:
        values = flat.astype(dtype)  # a writable copy
    if not len(arr):
        return values.reshape(0, 0)  # no rows (a prompt that stopped before any pass)
    if values.size % len(arr):
        raise ValueError("vectors of unequal length")
    return values.reshape(len(arr), -1)


ABSURD = 1e6  # no MoE input or output of a working model is this large


def check_values(arrays: dict, probs_type=None) -> str | None:
    """What is wrong with a chunk's numbers (non-finite, out of range, absurd), or None."""
    n = arrays["probs"].shape[1] if arrays["probs"].size else 0

    def bad(name, values, low, high):
        if values is None or values.size == 0:
            return None
        finite = np.isfinite(values)
        wrong = ~finite | (values < low) | (values > high)
        if wrong.any():
            return f"{name} holds non-finite or out-of-range values (e.g. {values[wrong][0]!r})"
        return None

    def repeated(ids):
        if ids is None or ids.size == 0 or ids.ndim != 2 or ids.shape[1] < 2:
            return None
        ordered = np.sort(ids, axis=1)
        same = (np.diff(ordered, axis=1) == 0).any(axis=1)
        if same.any():
            return (f"topk_ids repeats an expert within one node's top-k (e.g. "
                    f"{ids[same][0].tolist()})")
        return None

    return (bad("router_probs", arrays["probs"], -1e-6, 1 + 1e-3)
            or bad("topk_ids", arrays["topk_ids"], 0, n - 1)
            or repeated(arrays["topk_ids"])
            or bad("topk_weights", arrays["topk_weights"], -1e-6, ABSURD)
            or bad("hidden", arrays.get("hidden"), -ABSURD, ABSURD)
            or bad("output", arrays.get("output"), -ABSURD, ABSURD)
            or bad("output_norm", arrays.get("output_norm"), 0, ABSURD))


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (round to nearest even), as uint16 bit patterns: the
    inverse of :func:`matrix`'s decoding."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    nan = np.isnan(values)
    return np.where(nan, 0x7FC0, rounded >> 16).astype(np.uint16)


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
    """What the run's manifest says that its routing contradicts (N, k, MoE layers), or None."""
    n, k = run.manifest.get("num_experts"), run.manifest.get("top_k")
    moe = run.manifest.get("moe_layers")
    if not arrays["probs"].size:
        return None
    if isinstance(n, int) and arrays["probs"].shape[1] != n:
        return (f"its router_probs hold {arrays['probs'].shape[1]} experts per node but the "
                f"manifest says num_experts {n}")
    if isinstance(k, int) and arrays["topk_ids"].shape[1] != k:
        return (f"its topk_ids hold {arrays['topk_ids'].shape[1]} experts per node but the "
                f"manifest says top_k {k}")
    if isinstance(moe, list) and moe and not set(np.unique(layers).tolist()) <= set(moe):
        extra = sorted(set(np.unique(layers).tolist()) - set(moe))
        return f"it holds layer {extra[0]}, which the manifest's moe_layers do not list"
    return None


# the columns that name one row of a trace table: no two rows of a part share them
ROW_KEYS = {"sequences": ("prompt_index",), "trees": ("prompt_index", "step"),
            "nodes": ("prompt_index", "step", "node"),
            "routing": ("prompt_index", "step", "layer", "node"),
            "moe_io": ("prompt_index", "step", "layer", "node")}


def check_part(run: Run, table: str, path) -> None:
    """What replay checks of a part, for every reader (run when a committed file is first
    verified, remembered with its content hash: :func:`catalog.commit.verify`): no duplicated
    rows (:data:`ROW_KEYS`), and for ``routing`` its widths and layers against the manifest
    (:func:`manifest_mismatch`) and finite, in-range numbers (:func:`check_values`); else
    :class:`CatalogError` naming the file."""
    keys = ROW_KEYS.get(table)
    if keys is None:
        return
    wanted = list(keys) + (["router_probs", "topk_ids", "topk_weights"] if table == "routing"
                           else [])
    try:
        t = location.read_table(path, columns=wanted)
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise CatalogError(f"{path}: corrupt or unreadable {table} part "
                           f"({_reason(exc, path)}); recapture the run") from None
    if t.num_rows and t.group_by(list(keys)).aggregate([]).num_rows != t.num_rows:
        raise CatalogError(f"{path}: duplicated rows (two rows share {', '.join(keys)}); the "
                           "trace is corrupt, recapture the run")
    if table != "routing" or not t.num_rows:
        return
    try:
        arrays = dict(probs=matrix(t["router_probs"]), topk_ids=matrix(t["topk_ids"], np.int64),
                      topk_weights=matrix(t["topk_weights"]))
    except (ValueError, pa.ArrowInvalid) as exc:
        raise CatalogError(f"{path}: corrupt vectors ({exc}); recapture the run") from None
    problem = manifest_mismatch(run, arrays, t["layer"].to_numpy())
    if problem:
        raise CatalogError(f"{path}: {problem}; the manifest or the trace is damaged, "
                           "recapture the run")
    problem = check_values(arrays, t.column("router_probs").type.value_type)
    if problem:
        raise CatalogError(f"{path}: {problem}; the trace is corrupt, recapture the run")


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
