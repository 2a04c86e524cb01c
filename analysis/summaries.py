"""Per-tree-layer routing summaries: computed once per captured run, stored beside the traces.

Every routing figure (heavy tails, coverage, activation growth, load balance, co-activation) is
an aggregate of small per-tree-layer quantities. Scanning ``routing`` (N router probabilities
per node, ~9 GB for 576k OLMoE tree-layers) on every dashboard interaction does not scale, so
each complete run's ``routing`` table is reduced once, in numpy, to two small tables:

``summary_tree_layers`` — one row per (tree, MoE layer), ``s_i = Σ_t g_i(t)`` the router mass,
``share_(r)`` the shares sorted descending:

    nodes, unique_experts = |∪_t T_k(t)|,
    experts_q = min{B : Σ_{r≤B} share_(r) ≥ q}  (q = 0.5, 0.9, 0.99),
    gini = Σ_r (2r − N − 1) x_(r) / (N Σ x)     (x ascending), top_half_share = C(N/2)

``summary_layers`` — one row per MoE layer, sums over the run's tree-layers (so runs pool by
adding, and every figure is a division):

    coverage_sum[B−1] = Σ C(B),  growth_sum[t−1] = Σ U(t) over tree-layers with ≥ t nodes,
    growth_count[t−1] = #tree-layers with ≥ t nodes, U(t) = |∪_{node<t} T_k(node)|,
    selections[i] = #tokens whose top-k holds i, coact_all[i·N+j] = #tokens holding i and j,
    coact_adjacent[a·N+b] = adjacent-rank pairs (a, b) both ways, tokens, tree_layers

Files live at ``<traces>/summaries/<table>/model=…/bench=…/run=…/part-0.parquet`` with a
``_summary.json`` stamp naming the run's ``run_id``, prompt set and the SHA-256 of both files: a
recaptured or extended run is rebuilt, and so is a damaged summary (derived data heals itself);
an unchanged one never is (:func:`ensure`). Routing parts are reduced in parallel
processes; a run's two files are swapped in atomically under a file lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import multiprocessing
import os
import sys
import time
import types
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - flatten() imports it (~50 ms): once, before workers fork

from moe_spec.catalog import Catalog, CatalogError, Run, atomic, location, partition_value, reader

FOLDER = "summaries"
TABLES = ("summary_tree_layers", "summary_layers")
VERSION = 2  # bump when a summary's definition changes: every run is rebuilt
QUANTILES = (0.5, 0.9, 0.99)
COLUMNS = ["prompt_index", "step", "layer", "node", "router_probs", "topk_ids"]


# --- one routing part --------------------------------------------------------------------------
@dataclass
class PartSums:
    """What one routing part contributes: per-tree-layer rows and per-layer sums, stacked
    (``sums[name][i]`` belongs to MoE layer ``layers[i]``: a few arrays cross the process
    boundary, not a dict per layer)."""

    rows: dict[str, np.ndarray]  # summary_tree_layers columns
    layers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [count]
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # each [count, ...]


def _numpy(arr: pa.Array) -> np.ndarray:
    """A null-free fixed-width array's values, zero-copy, read from its data buffer:
    pyarrow's ``to_numpy`` imports pandas (~0.15 s of CPU in every fresh worker process)."""
    dtype = np.dtype(arr.type.to_pandas_dtype())
    return np.frombuffer(arr.buffers()[1], dtype, len(arr), arr.offset * dtype.itemsize)


def _column(t: pa.Table, name: str) -> pa.Array:
    column = t[name]
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _lists(arr: pa.Array, width: int) -> np.ndarray | None:
    """A list column as a ``[rows, width]`` array, zero-copy; None unless every row is a list of
    exactly ``width`` values and none of them null (a check on the offsets, not per row)."""
    if not pa.types.is_list(arr.type):  # a column of nulls
        return None
    flat = arr.flatten()
    offsets = _numpy(arr.offsets)
    if arr.null_count or flat.null_count or len(flat) != len(arr) * width \
            or (np.diff(offsets) != width).any():
        return None
    return _numpy(flat).reshape(len(arr), width)


def _read_checked(path: str, n: int, k: int, max_nodes: int) -> pa.Table:
    """The part's columns, or :class:`CatalogError` naming the file: unreadable (page
    checksums), mistyped, or holding values no capture writes. One thread: the parts are
    already read in parallel processes."""
    try:
        with location.parquet_file(path, page_checksum_verification=True) as part:
            t = part.read(columns=COLUMNS, use_threads=False)
        reader._expected_types(t, "routing")
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CatalogError(f"{path}: corrupt or unreadable routing part ({reader._reason(exc, path)})"
                           "; recapture the run") from exc
    return t


def reduce_part(path: str, n: int, k: int, max_nodes: int) -> PartSums:
    """Summaries of every tree-layer in one routing part (rows of a tree-layer are contiguous
    or are made so; nodes in increasing order within it)."""
    t = _read_checked(path, n, k, max_nodes)
    if not t.num_rows:  # a prompt that stopped at its first token: no pass, an empty part
        return PartSums({f.name: np.zeros(0, f.type.to_pandas_dtype())
                         for f in SCHEMAS["summary_tree_layers"]})
    part = _rows(t, path, n, k)
    _check_values(path, part, n, max_nodes)
    key, part = _in_tree_layer_order(part)
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])  # [G]
    g_of_row = np.cumsum(np.r_[False, key[1:] != key[:-1]])  # [R]
    nodes = np.diff(np.r_[starts, len(key)])  # [G]
    g_layer = part.layer[starts]
    cum, experts, gini = _shares(_router_mass(part.probs, starts, nodes, n), n)
    first = _first_node(g_of_row, part.ids, part.node, len(starts), n, k, max_nodes)
    seen = first < max_nodes
    rows = dict(prompt_index=part.prompt[starts].astype(np.int32),
                step=part.step[starts].astype(np.int32),
                layer=g_layer.astype(np.int16), nodes=nodes.astype(np.int16),
                unique_experts=seen.sum(1).astype(np.int16),
                experts_50=experts[0.5].astype(np.int16), experts_90=experts[0.9].astype(np.int16),
                experts_99=experts[0.99].astype(np.int16), gini=gini.astype(np.float32),
                top_half_share=cum[:, n // 2 - 1].astype(np.float32))
    return PartSums(rows, *_layer_sums(g_layer, g_of_row, nodes, first, seen, part.ids, cum,
                                       n, k, max_nodes))


@dataclass
class _Rows:
    """A routing part's columns as numpy arrays, one entry per row (a node of a tree-layer)."""

    prompt: np.ndarray  # [R]
    step: np.ndarray  # [R]
    layer: np.ndarray  # [R]
    node: np.ndarray  # [R] int64
    probs: np.ndarray  # [R, N] float32
    ids: np.ndarray  # [R, k] int64

    def take(self, order: np.ndarray) -> _Rows:
        """The rows in ``order``."""
        return _Rows(self.prompt[order], self.step[order], self.layer[order], self.node[order],
                     self.probs[order], self.ids[order])


def _rows(t: pa.Table, path: str, n: int, k: int) -> _Rows:
    """A part's columns as arrays; :class:`CatalogError` naming the file for a null key or a
    list of another length than N probabilities or k expert ids."""
    keys = [_column(t, c) for c in COLUMNS[:4]]
    probs = _lists(_column(t, "router_probs"), n)  # [R, N] float32
    ids = _lists(_column(t, "topk_ids"), k)  # [R, k] int16
    if probs is None or ids is None or any(c.null_count for c in keys):
        raise CatalogError(f"{path}: a routing row is not N={n} probabilities and k={k} expert "
                           "ids under non-null keys (a null, or a list of another length); the "
                           "trace is damaged, recapture the run")
    prompt, step, layer, node = (_numpy(c) for c in keys)
    return _Rows(prompt, step, layer, node.astype(np.int64), probs, ids.astype(np.int64))


def _check_values(path: str, part: _Rows, n: int, max_nodes: int) -> None:
    """:class:`CatalogError` naming the file for probabilities, expert ids or node ids no
    capture writes."""
    if not len(part.node):
        return
    problem = None
    # two passes (min/max, NaN propagates); the full check only to name the fault
    lo, hi = part.probs.min(), part.probs.max()
    if not (np.isfinite(lo) and np.isfinite(hi) and lo >= -1e-6 and hi <= 1 + 1e-3
            and part.ids.min() >= 0 and part.ids.max() < n):
        problem = reader.check_values(dict(probs=part.probs, topk_ids=part.ids, topk_weights=None))
    if problem is None and (part.node.min() < 0 or part.node.max() >= max_nodes):
        problem = f"node ids outside 0..{max_nodes - 1}"
    if problem:
        raise CatalogError(f"{path}: {problem}; the trace is damaged, recapture the run")


def _in_tree_layer_order(part: _Rows) -> tuple[np.ndarray, _Rows]:
    """Each row's tree-layer key (prompt, step, layer) and the rows sorted by key, then node
    (reordered only where they are not already)."""
    key = (part.prompt.astype(np.int64) << 40) | (part.step.astype(np.int64) << 16) \
        | part.layer.astype(np.int64)
    if len(key) > 1 and (np.any(np.diff(key) < 0) or np.any((np.diff(key) == 0)
                                                              & (np.diff(part.node) < 0))):
        order = np.lexsort((part.node, key))
        return key[order], part.take(order)
    return key, part


def _router_mass(probs: np.ndarray, starts: np.ndarray, nodes: np.ndarray, n: int) -> np.ndarray:
    """``s_i = Σ_t g_i(t)`` of each tree-layer, [G, N] float64."""
    if len(starts) and (nodes == nodes[0]).all():  # every tree the same size: one reshape,
        by_node = probs.reshape(len(starts), nodes[0], n)  # then a node at a time in float64:
        mass = by_node[:, 0].astype(np.float64)  # sum(1, dtype=float64)'s order, 40% less CPU
        for j in range(1, nodes[0]):
            mass += by_node[:, j]  # [G, N]
        return mass
    return np.add.reduceat(probs, starts, axis=0, dtype=np.float64)


def _shares(mass: np.ndarray, n: int) -> tuple[np.ndarray, dict[float, np.ndarray], np.ndarray]:
    """From the router mass, the shares sorted descending and what they say: C(B) for
    B = 1..N, experts_q per quantile, gini."""
    share = mass / np.maximum(mass.sum(1, keepdims=True), 1e-300)
    desc = -np.sort(-share, axis=1)
    cum = np.cumsum(desc, axis=1)  # C(B), B = 1..N
    experts = {q: (cum < q - 1e-9).sum(1) + 1 for q in QUANTILES}
    r = np.arange(1, n + 1)
    gini = ((2 * r - n - 1) * desc[:, ::-1]).sum(1) / n  # Σ x = 1
    return cum, experts, gini


def _first_node(g_of_row: np.ndarray, ids: np.ndarray, node: np.ndarray, groups: int, n: int,
                k: int, max_nodes: int) -> np.ndarray:
    """The node at which each expert first appears in each tree-layer, [G, N] (``max_nodes``
    where it never does; nodes increase within a tree-layer)."""
    codes = (g_of_row[:, None] * n + ids).reshape(-1)
    first = np.full(groups * n, max_nodes, dtype=np.int64)
    np.minimum.at(first, codes, np.repeat(node, k))
    return first.reshape(groups, n)


def _layer_sums(g_layer: np.ndarray, g_of_row: np.ndarray, nodes: np.ndarray,
                first: np.ndarray, seen: np.ndarray, ids: np.ndarray, cum: np.ndarray, n: int,
                k: int, max_nodes: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A part's per-layer sums, all its MoE layers at once: the layers and :attr:`PartSums.sums`."""
    # li = the layer's position among this part's layers
    layers_here, li_g = np.unique(g_layer, return_inverse=True)
    li_row = li_g[g_of_row]
    count = len(layers_here)
    side = max_nodes + 1  # new experts at node f in tree-layers of m nodes: H[li, m, f]
    hist = np.bincount((np.repeat(li_g * side + nodes, n)[seen.reshape(-1)] * side
                        + first[seen]), minlength=count * side * side)
    pairs, adjacent, selections = _token_counts(ids, li_row, count, n, k)
    # Σ C(B) per layer: weighted bincount adds in row order, as np.add.at (same sums), faster
    cover = np.bincount((li_g[:, None] * n + np.arange(n)).reshape(-1), weights=cum.reshape(-1),
                        minlength=count * n).reshape(count, n)
    # the [count, ...] counts cross the process boundary as int32 (a part holds < 2³¹ tokens):
    # half the bytes to pickle, pipe and unpickle; build_run sums them in int64
    return layers_here.astype(np.int64), dict(
        tree_layers=np.bincount(li_g, minlength=count),
        tokens=np.bincount(li_row, minlength=count),
        coverage_sum=cover,
        new_at=hist.reshape(count, side, side).astype(np.int32),
        selections=selections.reshape(count, n).astype(np.int32),
        pairs=pairs.reshape(count, n, n).astype(np.int32),
        adjacent=(adjacent + adjacent.transpose(0, 2, 1)).reshape(count, n * n).astype(np.int32))


def _token_counts(ids: np.ndarray, li_row: np.ndarray, count: int, n: int,
                  k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token-level counts per layer: expert pairs (p < q), adjacent-rank pairs [count, N, N]
    and selections, flat."""
    # one bincount each over codes li·N² + a·N + b built a top-k position
    # pair at a time (rows of ids.T, long contiguous adds, not [R, 28] fancy indexing); for
    # positions p < q, pairs + pairsᵀ counts the tokens holding both (a token's experts are
    # distinct) and adjacent + adjacentᵀ the adjacent-rank pairs both ways. One bincount for
    # both: the adjacent pairs (p, p + 1) are counted in a second block (codes + count·N²).
    by_position = np.ascontiguousarray(ids.T)  # [k, R]
    high = by_position * n + (li_row * (n * n))[None, :]
    block = count * n * n
    codes = np.empty((k * (k - 1) // 2, len(li_row)), np.int64)
    for j, (p, q) in enumerate(zip(*np.triu_indices(k, 1))):
        np.add(high[p], by_position[q], out=codes[j])
        if q == p + 1:
            codes[j] += block
    both = np.bincount(codes.reshape(-1), minlength=2 * block)
    pairs, adjacent = both[:block] + both[block:], both[block:].reshape(count, n, n)
    selections = np.bincount((li_row[None, :] * n + by_position).reshape(-1),
                             minlength=count * n)
    return pairs, adjacent, selections


def _reduce_part_args(args) -> PartSums:
    return reduce_part(*args)


def _keep_freed_memory() -> None:
    """Set-up of a build's worker processes: glibc hands large freed blocks back to the kernel,
    so every part's ~50 MB of numpy temporaries were page-faulted and zeroed afresh (3,000
    faults, ~5 of a part's ~45 ms of CPU). A worker lives for one build; keeping its freed
    memory for the next part costs no more than the first part's peak. Not glibc: no-op."""
    try:
        libc = ctypes.CDLL(None)  # the symbols the interpreter links (not find_library: ldconfig)
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: large blocks from the heap, not mmap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: and the heap is not trimmed after each
    except (OSError, AttributeError, TypeError):
        pass


def _worker_setup(environ: dict, storage: dict) -> None:
    """A reduce worker as its caller is now: the caller's environment (the fork server that
    starts workers was itself started earlier, by whichever caller came first, and its
    children inherit *its* environment, e.g. without the AWS_* variables set since) and the
    caller's ``--storage-options`` (module state, which a process started afresh lacks), so
    ``s3://`` parts open in the worker as in the caller; then :func:`_keep_freed_memory`."""
    os.environ.clear()
    os.environ.update(environ)
    location.use_storage_options(storage)
    _keep_freed_memory()


@contextlib.contextmanager
def _callers_main_set_aside():
    """The caller's ``__main__`` replaced by a bare stand-in for the duration: a process started
    by a fork server (or spawned) first re-runs the parent's main script, unless it was run as
    a module named ``*.__main__``. A Streamlit page *is* ``__main__`` (Streamlit swaps it in),
    and it builds summaries on load: each worker ran the page again, which started a pool of its
    own, and the page never finished (the app's tests hung until CI's limit)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is None:
            sys.modules.pop("__main__", None)
        else:
            sys.modules["__main__"] = main


class Workers(ProcessPoolExecutor):
    """A process pool whose workers never re-run the caller's main script: ``submit`` (which
    ``map`` calls, and which starts a worker when none is idle) runs with the caller's
    ``__main__`` set aside (:func:`_callers_main_set_aside`). A task must therefore be found by
    its module, never as ``__main__.f``."""

    def submit(self, fn, /, *args, **kwargs):
        with _callers_main_set_aside():
            return super().submit(fn, *args, **kwargs)


def pool(workers: int) -> Workers:
    """The processes routing parts are reduced in, each set up as the caller is now
    (:func:`_worker_setup`) and keeping its freed memory. Started by a fork server, not forked
    from the caller: a caller holding threads (s3fs's event loop, torch's pools) can leave a
    forked child with their locks held (a child crashed in garbage collection after ``report``
    on ``s3://`` traces); and without re-running the caller's main script (:class:`Workers`)."""
    return Workers(max_workers=workers, initializer=_worker_setup,
                   initargs=(dict(os.environ), location.storage_options()),
                   mp_context=multiprocessing.get_context("forkserver"))


# --- one run -----------------------------------------------------------------------------------
def stamp_of(run: Run) -> dict:
    """What a run's summaries were built from: rebuilt when any of it changes (a routing-only
    run's also when the ids-only definitions or its batching do: :mod:`analysis.ids`)."""
    stamp = dict(version=VERSION, run_id=run.run_id, prompts=run.prompt_indices())
    if run.routing_only:
        from moe_spec.analysis import ids
        stamp.update(ids=ids.VERSION, batching=run.settings.get("batching"),
                     batch_size=run.settings.get("virtual_batch_size"))
    return stamp


def _folder(root: Path, table: str, run: Run) -> Path:
    return (location.root(root) / FOLDER / table / f"model={partition_value(run.model)}" /
            f"bench={run.bench}" / f"run={run.name}")


def part_path(root: Path, table: str, run: Run) -> Path:
    """The one file of a run's summary ``table`` (what its stamp's digest covers)."""
    return _folder(root, table, run) / "part-0.parquet"


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def is_fresh(root: Path, run: Run) -> bool:
    """Built from this run as it is now, and neither file damaged since."""
    stamp = _folder(root, "summary_layers", run) / "_summary.json"
    try:
        found = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(found, dict):
        return False
    files = found.pop("files", None)
    return found == stamp_of(run) and files == {
        t: _digest(_folder(root, t, run) / "part-0.parquet") for t in TABLES}


def _finish_layers(sums: dict[int, dict], n: int, max_nodes: int) -> pa.Table:
    """Per-layer sums → the ``summary_layers`` table (growth sums from the new-expert
    histograms: Σ_{m≥t} Σ_{f<t} H[m, f] for t = 1..max_nodes)."""
    out = {c: [] for c in ("layer", "tree_layers", "tokens", "num_experts", "coverage_sum",
                           "growth_sum", "growth_count", "selections", "coact_all",
                           "coact_adjacent")}
    for lay in sorted(sums):
        s = sums[lay]
        h = s["new_at"]  # [m, f]
        cum_f = np.cumsum(h, axis=1)  # Σ_{f≤x}
        tail_m = np.cumsum(cum_f[::-1], axis=0)[::-1]  # Σ_{m'≥m} Σ_{f≤x}
        t = np.arange(1, max_nodes + 1)
        growth_sum = tail_m[t, t - 1].astype(np.float64)
        counts = s["tree_count_by_nodes"]  # [max_nodes + 1]
        growth_count = np.cumsum(counts[::-1])[::-1][t]
        pairs = s["pairs"].reshape(n, n)
        coact = pairs + pairs.T
        np.fill_diagonal(coact, s["selections"])  # i with i: tokens selecting i
        out["layer"].append(lay)
        out["tree_layers"].append(s["tree_layers"])
        out["tokens"].append(s["tokens"])
        out["num_experts"].append(n)
        out["coverage_sum"].append(s["coverage_sum"])
        keep = int(np.flatnonzero(growth_count)[-1]) + 1 if growth_count.any() else 0
        out["growth_sum"].append(growth_sum[:keep])
        out["growth_count"].append(growth_count[:keep])
        out["selections"].append(s["selections"])
        out["coact_all"].append(coact.reshape(-1))
        out["coact_adjacent"].append(s["adjacent"])
    return _table(out, SCHEMAS["summary_layers"])


def _arrow(values, type_: pa.DataType) -> pa.Array:
    """numpy → Arrow through the buffer: ``pa.array``/``pa.table`` import pandas (~0.2 s of
    serial CPU at the end of a build, in a process that had not imported it)."""
    values = np.ascontiguousarray(values, dtype=type_.to_pandas_dtype())
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def _table(columns: dict[str, list | np.ndarray], schema: pa.Schema) -> pa.Table:
    """A table of the schema from numpy columns; a list column from a list of its rows."""
    arrays = []
    for f in schema:
        values = columns[f.name]
        if pa.types.is_list(f.type):
            offsets = np.r_[0, np.cumsum([len(v) for v in values])]
            values = np.concatenate(values) if values else np.zeros(0)
            arrays.append(pa.ListArray.from_arrays(_arrow(offsets, pa.int32()),
                                                   _arrow(values, f.type.value_type)))
        else:
            arrays.append(_arrow(values, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


SCHEMAS = {
    "summary_tree_layers": pa.schema([
        ("prompt_index", pa.int32()), ("step", pa.int32()), ("layer", pa.int16()),
        ("nodes", pa.int16()), ("unique_experts", pa.int16()), ("experts_50", pa.int16()),
        ("experts_90", pa.int16()), ("experts_99", pa.int16()), ("gini", pa.float32()),
        ("top_half_share", pa.float32())]),
    "summary_layers": pa.schema([
        ("layer", pa.int16()), ("tree_layers", pa.int64()), ("tokens", pa.int64()),
        ("num_experts", pa.int32()), ("coverage_sum", pa.list_(pa.float64())),
        ("growth_sum", pa.list_(pa.float64())), ("growth_count", pa.list_(pa.int64())),
        ("selections", pa.list_(pa.int64())), ("coact_all", pa.list_(pa.int64())),
        ("coact_adjacent", pa.list_(pa.int64()))]),
}


def ids_tables(run: Run) -> tuple[pa.Table, pa.Table]:
    """A routing-only run's summaries (:mod:`analysis.ids`): the same two tables, a "tree" being
    a batch pass (the source's, or b consecutive requests at one decode step) and the "mass"
    its routed-token counts (what top-k ids alone give)."""
    from moe_spec.analysis import ids
    figs = ids.figures(run)
    rows = figs.rows
    typed = {f.name: rows[f.name] if f.name != "nodes" else np.minimum(rows["nodes"], 32767)
             for f in SCHEMAS["summary_tree_layers"]}
    if not len(rows["layer"]):
        typed = {f.name: np.zeros(0) for f in SCHEMAS["summary_tree_layers"]}
    tree_layers = _table(typed, SCHEMAS["summary_tree_layers"])
    out = {c: [] for c in SCHEMAS["summary_layers"].names}
    for layer in figs.layers:
        s = figs.sums[layer]
        count = s.growth_count
        keep = int(np.flatnonzero(count)[-1]) + 1 if count.any() else 0
        for name, value in (("layer", layer), ("tree_layers", s.passes), ("tokens", s.tokens),
                            ("num_experts", figs.num_experts),
                            ("coverage_sum", s.coverage_sum),
                            ("growth_sum", s.growth_sum[:keep]),
                            ("growth_count", count[:keep]), ("selections", s.selections),
                            ("coact_all", s.coact_all.reshape(-1)),
                            ("coact_adjacent", s.adjacent.reshape(-1))):
            out[name].append(value)
    return tree_layers, _table(out, SCHEMAS["summary_layers"])


def build_run(root: Path, run: Run, workers: int | None = None) -> int:
    """Reduce one complete run's routing to its summaries; returns the tree-layers summarised."""
    if run.routing_only:
        tree_layers, layer_table = ids_tables(run)
        _write(root, run, tree_layers, layer_table)
        return tree_layers.num_rows
    n, k = int(run.manifest["num_experts"]), int(run.manifest["top_k"])
    max_nodes = int(run.settings.get("total_tokens", 63))
    parts = [p if location.is_remote(p) else str(p)  # remote paths go to the workers as paths
             for p in run.files("routing")]  # the committed parts, verified
    jobs = [(p, n, k, max_nodes) for p in parts]
    workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    if workers > 1 and len(jobs) > 1:
        workers = min(workers, len(jobs))
        with pool(workers) as workers_pool:  # one part (~40 ms) a task:
            results = list(workers_pool.map(_reduce_part_args, jobs))  # no worker idles at the end
    else:
        results = [reduce_part(*j) for j in jobs]
    rows = {c: np.concatenate([r.rows[c] for r in results]) if results else
            np.zeros(0, dtype=SCHEMAS["summary_tree_layers"].field(c).type.to_pandas_dtype())
            for c in SCHEMAS["summary_tree_layers"].names}
    # parts with the same layers (all of them, as a rule) add as stacks, in part order
    stacks: dict[tuple, dict[str, np.ndarray]] = {}
    for r in results:
        if len(r.layers):
            acc = stacks.setdefault(tuple(r.layers.tolist()), {})
            for key, v in r.sums.items():
                acc[key] = acc[key] + v if key in acc else v.astype(np.promote_types(v.dtype,
                                                                                     np.int64))
    layers: dict[int, dict] = {}
    for layer_ids, acc in stacks.items():
        for i, lay in enumerate(layer_ids):
            if lay in layers:
                for key, v in acc.items():
                    layers[lay][key] = layers[lay][key] + v[i]
            else:
                layers[lay] = {key: v[i] for key, v in acc.items()}
    for lay, s in layers.items():  # tree-layers by node count, for the growth denominators
        g = rows["layer"] == lay
        s["tree_count_by_nodes"] = np.bincount(rows["nodes"][g].astype(np.int64),
                                               minlength=max_nodes + 1)[:max_nodes + 1]
    order = np.lexsort((rows["layer"], rows["step"], rows["prompt_index"]))
    tree_layers = _table({c: rows[c][order] for c in rows}, SCHEMAS["summary_tree_layers"])
    layer_table = _finish_layers(layers, n, max_nodes)
    _write(root, run, tree_layers, layer_table)
    return tree_layers.num_rows


def _write(root: Path, run: Run, tree_layers: pa.Table, layer_table: pa.Table) -> None:
    """A run's two summary files, swapped in whole, the stamp last."""
    files = {}
    for table, data in (("summary_tree_layers", tree_layers), ("summary_layers", layer_table)):
        folder = _folder(root, table, run)
        with atomic.folder(folder) as tmp:
            atomic.write_table(tmp / "part-0.parquet", data)
            files[table] = _digest(tmp / "part-0.parquet")
            if table == "summary_layers":  # the stamp goes last: present = complete
                atomic.write_json(tmp / "_summary.json", {**stamp_of(run), "files": files})


@dataclass
class BuildReport:
    built: list[str] = field(default_factory=list)  # runs (re)built now
    fresh: int = 0  # runs already up to date
    tree_layers: int = 0
    seconds: float = 0.0


def ensure(root: Path, workers: int | None = None, progress=None) -> BuildReport:
    """Build the summaries of every complete run that lacks fresh ones (new, recaptured or
    extended runs); drop those of runs that no longer exist. ``progress(run_name)`` is called
    before each build. Raises :class:`catalog.CatalogError` (one line) if the traces folder
    cannot be written."""
    root = location.root(root)
    report = BuildReport()
    start = time.perf_counter()
    runs = Catalog(root).runs(complete=True, kinds=None)  # routing-only runs too (ids-only)
    for run in runs:
        if is_fresh(root, run):
            report.fresh += 1
            continue
        lock_dir = root / FOLDER
        try:
            location.mkdir(lock_dir)
            with location.lock(lock_dir / ".build.lock", timeout=600):
                if is_fresh(root, run):  # another process built it meanwhile
                    report.fresh += 1
                    continue
                if progress:
                    progress(run.name)
                report.tree_layers += build_run(root, run, workers)
        except OSError as exc:
            raise CatalogError(f"cannot write routing summaries under {lock_dir}: "
                               f"{exc.strerror or exc}; make the traces folder writable") from exc
        report.built.append(run.name)
    _drop_orphans(root, runs)
    report.seconds = time.perf_counter() - start
    return report


def _drop_orphans(root: Path, runs: list[Run]) -> None:
    """Summaries of runs that are gone (deleted, or no longer complete) are not shown."""
    live = {(partition_value(r.model), r.bench, r.name) for r in runs}
    for table in TABLES:
        base = location.root(root) / FOLDER / table
        for folder in base.glob("model=*/bench=*/run=*"):
            key = (folder.parent.parent.name[6:], folder.parent.name[6:], folder.name[4:])
            if key not in live:
                location.remove_tree(folder, ignore_errors=True)
