"""Reading captured runs back for replay: manifests, and (tree, layer) groups one prompt at a time.

Only runs whose manifest says ``complete`` are used (a running or killed capture is skipped and
named). Tensors are read one prompt part at a time, so memory stays bounded by one prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from capture import schema


class ReplayError(RuntimeError):
    """Bad or missing input; the message is one line for the user."""


@dataclass
class CapturedRun:
    manifest: dict
    dirs: dict[str, Path]  # table -> leaf folder of this run

    @property
    def name(self) -> str:
        return self.manifest["run"]

    @property
    def model(self) -> str:
        return self.manifest["model"]

    @property
    def bench(self) -> str:
        return self.manifest["bench"]

    def prompt_keys(self) -> set[tuple[str, str]]:
        return {(self.bench, pid) for pid in self.manifest["prompt_ids"]}

    def prompt_indices(self) -> list[int]:
        folder = self.dirs[schema.COMPLETION_TABLE]
        return sorted(int(p.name.split("-")[1]) for p in folder.glob("part-*.parquet"))


def find_runs(root: Path, *, model: str | None = None, bench: str | None = None,
              runs: list[str] | None = None) -> list[CapturedRun]:
    root = Path(root)
    manifests = sorted(root.glob(f"runs/model=*/bench=*/run=*/{schema.MANIFEST}"))
    if not manifests:
        raise ReplayError(f"no captured runs under {root}; run `capture` first or point --traces "
                          "at a traces folder")
    found = []
    for path in manifests:
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ReplayError(f"corrupt manifest {path}; recapture that run") from exc
        if manifest.get("schema_version") != schema.SCHEMA_VERSION:
            raise ReplayError(f"{path} has schema version {manifest.get('schema_version')}, this "
                              f"tool reads {schema.SCHEMA_VERSION}; recapture or upgrade")
        if model and manifest["model"] != model:
            continue
        if bench and manifest["bench"] != bench:
            continue
        if runs and manifest["run"] not in runs:
            continue
        if manifest.get("status") != "complete":
            continue
        leaf = path.parent.relative_to(root / "runs")
        found.append(CapturedRun(manifest, {t: root / t / leaf for t in schema.TRACE_TABLES}))
    return found


def _matrix(column: pa.ChunkedArray, dtype=np.float32) -> np.ndarray:
    """A list column of equal-length rows as a 2-D array (no Python objects)."""
    arr = column.combine_chunks()
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(dtype)  # a writable copy
    return values.reshape(len(arr), -1)


def _read(folder: Path, prompt_index: int, columns: list[str], table: str) -> pa.Table:
    parts = sorted(folder.glob(f"part-{prompt_index:06d}-*.parquet"))
    if not parts:
        raise ReplayError(f"{folder} has no part for prompt {prompt_index}; the trace is "
                          "incomplete, recapture the run")
    try:
        return pa.concat_tables(pq.read_table(p, columns=columns) for p in parts)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ReplayError(f"corrupt {table} part in {folder}: {exc}; recapture the run") from exc


@dataclass
class TreeLayerData:
    prompt_index: int
    prompt_id: str
    step: int
    layer: int
    probs: torch.Tensor  # [M, N]
    idx: torch.Tensor  # [M, k]
    weights: torch.Tensor  # [M, k]
    hidden: torch.Tensor | None  # [M, H]
    output: torch.Tensor | None  # [M, H]


def iter_tree_layers(run: CapturedRun, prompt_index: int, *, layers: list[int] | None = None,
                     with_io: bool = True) -> Iterator[TreeLayerData]:
    """Every (step, layer) of one prompt, nodes in tree order."""
    cols = ["prompt_id", "step", "layer", "node", "router_probs", "topk_ids", "topk_weights"]
    routing = _read(run.dirs["routing"], prompt_index, cols, "routing")
    routing = routing.sort_by([("step", "ascending"), ("layer", "ascending"), ("node", "ascending")])
    io = None
    if with_io:
        io = _read(run.dirs["moe_io"], prompt_index, ["step", "layer", "node", "hidden", "output"],
                   "moe_io").sort_by([("step", "ascending"), ("layer", "ascending"),
                                      ("node", "ascending")])
        if io.num_rows != routing.num_rows:
            raise ReplayError(f"routing and moe_io of prompt {prompt_index} in run {run.name} "
                              "disagree in rows; recapture the run")
    step = routing["step"].to_numpy()
    layer = routing["layer"].to_numpy()
    probs = _matrix(routing["router_probs"])
    ids = _matrix(routing["topk_ids"], np.int64)
    w = _matrix(routing["topk_weights"])
    hid = _matrix(io["hidden"]) if io is not None else None
    out = _matrix(io["output"]) if io is not None else None
    keys = step.astype(np.int64) * 100_000 + layer
    bounds = np.flatnonzero(np.diff(keys)) + 1
    pid = routing["prompt_id"][0].as_py()
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(keys)]):
        if layers is not None and int(layer[lo]) not in layers:
            continue
        yield TreeLayerData(prompt_index, pid, int(step[lo]), int(layer[lo]),
                            torch.from_numpy(probs[lo:hi]), torch.from_numpy(ids[lo:hi]),
                            torch.from_numpy(w[lo:hi]),
                            None if hid is None else torch.from_numpy(hid[lo:hi]),
                            None if out is None else torch.from_numpy(out[lo:hi]))
