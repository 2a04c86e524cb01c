"""Megatron-LM: ``RouterTracer`` (``--moe-routing-trace-path DIR``; hooks on every TopKRouter,
training and inference), one file per rank, ``router_trace_rank<r>.jsonl``, one record per
(step, layer):

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, …], …]}

Read: ``step``, ``layer`` (the decoder layer index from the module name ``decoder.layers.<i>``),
``num_tokens``, ``top_indices`` (``[num_tokens][topk]``) and ``rank`` are used; records of the
MTP block (``block: mtp``) are skipped (counted in the summary). The trace has no request ids:
each rank's file is one stream (its id ``rank<r>``), its tokens numbered in order, and every
step is a recorded forward pass (``step``), so unions per batch use Megatron's own batching. A
step's records must cover every MoE layer of the model with the same token count. Limits: with
pipeline parallelism > 1 a rank numbers the layers of its own stage (refused where a layer is
not a MoE layer of the config); tensor-parallel ranks see the same tokens (import one rank per
data-parallel replica); the prompt and generated tokens are not told apart (all are kept).

Write (``export-routing --format megatron``): ``router_trace_rank0.jsonl`` in ``DEST`` (a
folder), one step per batch pass: the run's recorded passes, else virtual batches of
``--batch-size`` consecutive requests at the same decode position (their tokens in request
order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moe_spec.capture.engines.base import (
    ModelFacts,
    Piece,
    ReadOptions,
    SourceError,
    checked_ids,
    jsonl,
    source_files,
    whole,
)

NAME = "megatron"
VERSION = "megatron-router-tracer-jsonl"
PATTERN = "router_trace_rank*.jsonl"


class _Step:
    def __init__(self, step: int, where: str):
        self.step, self.where = step, where
        self.layers: dict[int, np.ndarray] = {}


def _emit(pending: _Step, stream: str, facts: ModelFacts, options: ReadOptions,
          start: int) -> Piece:
    where = pending.where
    got = sorted(pending.layers)
    if got != list(facts.moe_layers):
        raise SourceError(f"{where}: step {pending.step} has records for layers {got}, but "
                          f"{facts.describe()} has MoE layers {list(facts.moe_layers)} (the "
                          "layer count disagrees with the config)")
    counts = {len(a) for a in pending.layers.values()}
    if len(counts) != 1:
        raise SourceError(f"{where}: step {pending.step} routes {sorted(counts)} tokens at "
                          "different layers: wrong shape (every layer routes the step's tokens)")
    arr = np.stack([pending.layers[layer] for layer in facts.moe_layers], axis=1)
    ids = checked_ids(arr, facts, options, f"{where} (step {pending.step})")
    n = len(ids)
    return Piece(stream, ids, np.arange(start, start + n, dtype=np.int32),
                 step=np.full(n, pending.step, np.int64), last=False)


def read(source: Path, facts: ModelFacts, options: ReadOptions,
         progress: Callable[[int], None] | None = None, skipped: dict | None = None) \
        -> Iterator[Piece]:
    skipped = skipped if skipped is not None else {}
    for path in source_files(source, PATTERN):
        stream, start, pending, seen = None, 0, None, set()
        for number, record, _ in jsonl(path, progress):
            where = f"{path} line {number}"
            if not isinstance(record, dict):
                raise SourceError(f"{where}: a record is not a JSON object")
            if record.get("block", "decoder") != "decoder":
                skipped["mtp records"] = skipped.get("mtp records", 0) + 1
                continue
            step = whole(record.get("step"), where, "step")
            layer = whole(record.get("layer"), where, "layer")
            num = whole(record.get("num_tokens"), where, "num_tokens")
            rank = record.get("rank", 0)
            if stream is None:
                stream = f"rank{rank}"
            if pending is None or step != pending.step:
                if pending is not None:
                    if step in seen:
                        raise SourceError(f"{where}: step {step} appears again after step "
                                          f"{pending.step}; records of a step must be "
                                          "consecutive")
                    piece = _emit(pending, stream, facts, options, start)
                    start += len(piece.token)
                    yield piece
                seen.add(step)
                pending = _Step(step, where)
            if layer in pending.layers:
                raise SourceError(f"{where}: step {step} has two records for layer {layer}")
            top = record.get("top_indices")
            try:
                arr = np.asarray(top, dtype=np.int64)
            except (ValueError, TypeError):
                raise SourceError(f"{where}: top_indices is not a [num_tokens][topk] list of "
                                  "ids: wrong shape") from None
            if arr.ndim != 2 or len(arr) != num:
                raise SourceError(f"{where}: top_indices has shape {list(arr.shape)}, but "
                                  f"num_tokens is {num}: wrong shape")
            if "topk" in record and arr.shape[1] != record["topk"]:
                raise SourceError(f"{where}: top_indices rows hold {arr.shape[1]} ids, topk says "
                                  f"{record['topk']}: wrong shape")
            pending.layers[layer] = arr
        if pending is not None:
            piece = _emit(pending, stream, facts, options, start)
            piece.last = True
            yield piece


def write(passes: Iterator[tuple[int, np.ndarray]], dest: Path, facts: ModelFacts) \
        -> tuple[list[Path], int]:
    """``passes``: (step, ids ``[m, L, k]``) in order; one record per (step, MoE layer) into
    ``dest/router_trace_rank0.jsonl``. Returns the files and the steps written."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "router_trace_rank0.jsonl"
    steps = 0
    with open(path, "w", encoding="utf-8") as f:
        for step, ids in passes:
            for li, layer in enumerate(facts.moe_layers):
                f.write(json.dumps(dict(step=int(step), stage="pre_dispatch", block="decoder",
                                        layer=int(layer), rank=0, num_tokens=len(ids),
                                        topk=facts.top_k,
                                        top_indices=ids[:, li].tolist()),
                                   separators=(",", ":")) + "\n")
            steps += 1
    return [path], steps
