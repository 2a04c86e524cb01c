"""What every reader checks of a trace part's numbers, below the run catalog (which runs
:func:`check_part` when it first verifies a committed file): vectors decoded (:func:`matrix`),
values finite and in range (:func:`check_values`), routing against its manifest
(:func:`manifest_mismatch`), no duplicated rows (:data:`ROW_KEYS`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moe_spec.catalog import location
from moe_spec.catalog.columns import reason


class PartError(ValueError):
    """A part whose numbers are wrong; the message is one line naming the file and the fix."""


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


def manifest_mismatch(manifest: dict, arrays: dict, layers: np.ndarray) -> str | None:
    """What a run's manifest says that its routing contradicts (N, k, MoE layers), or None."""
    n, k = manifest.get("num_experts"), manifest.get("top_k")
    moe = manifest.get("moe_layers")
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


def check_part(manifest: dict, table: str, path) -> None:
    """What replay checks of a part, for every reader (run when a committed file is first
    verified, remembered with its content hash: :func:`catalog.commit.verify`): no duplicated
    rows (:data:`ROW_KEYS`), and for ``routing`` its widths and layers against the manifest
    (:func:`manifest_mismatch`) and finite, in-range numbers (:func:`check_values`); else
    :class:`PartError` naming the file (the catalog says it as its ``CatalogError``)."""
    keys = ROW_KEYS.get(table)
    if keys is None:
        return
    wanted = list(keys) + (["router_probs", "topk_ids", "topk_weights"] if table == "routing"
                           else [])
    try:
        t = location.read_table(path, columns=wanted)
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise PartError(f"{path}: corrupt or unreadable {table} part "
                           f"({reason(exc, path)}); recapture the run") from None
    if t.num_rows and t.group_by(list(keys)).aggregate([]).num_rows != t.num_rows:
        raise PartError(f"{path}: duplicated rows (two rows share {', '.join(keys)}); the "
                           "trace is corrupt, recapture the run")
    if table != "routing" or not t.num_rows:
        return
    try:
        arrays = dict(probs=matrix(t["router_probs"]), topk_ids=matrix(t["topk_ids"], np.int64),
                      topk_weights=matrix(t["topk_weights"]))
    except (ValueError, pa.ArrowInvalid) as exc:
        raise PartError(f"{path}: corrupt vectors ({exc}); recapture the run") from None
    problem = manifest_mismatch(manifest, arrays, t["layer"].to_numpy())
    if problem:
        raise PartError(f"{path}: {problem}; the manifest or the trace is damaged, "
                           "recapture the run")
    problem = check_values(arrays, t.column("router_probs").type.value_type)
    if problem:
        raise PartError(f"{path}: {problem}; the trace is corrupt, recapture the run")
