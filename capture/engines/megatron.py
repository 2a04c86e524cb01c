"""Megatron-LM: ``RouterTracer`` (``--moe-routing-trace-path DIR``), one file per rank,
``router_trace_rank<r>.jsonl``, one record per router call (NVIDIA/Megatron-LM
``megatron/core/transformer/moe/router_trace.py``: ``RouterTracer._record`` /
``record_indices`` / ``_flush_records_to_disk``):

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, …], …]}

Read as the tracer writes it on each path:

* **hooks** (training, and inference without routing replay): ``layer`` is ``<i>`` of the
  module name ``decoder.layers.<i>`` (0-based, the rank's own stage's index); in training the
  step is the iteration (``advance_step(iteration)`` in ``megatron/training/training.py``), so
  every microbatch's router call, and every re-fire under activation recomputation, lands in
  the same step: a step holds ``--microbatches-per-step`` M forwards (each a record per MoE layer,
  in order), and a record whose ids equal an earlier record of its layer in the step is a
  recomputation's re-fire, dropped and counted;
* **record_indices** (inference with ``--moe-enable-routing-replay``,
  ``text_generation_controller.py``): ``layer`` is the layer's ``layer_number``, 1-based and
  offset by the pipeline stage: ``--layer-base 1``;
* ``block: mtp`` records are skipped (counted).

Each rank's file is one stream (``rank<r>``), its tokens numbered in order, every forward a
recorded pass (``step`` = iteration × M + microbatch). ``--merge-ranks`` reads a folder's rank
files as one stream, step by step: each (step, forward, layer) is the concatenation, in rank
order, of the ranks' records for it, for tensor-parallel ranks under sequence parallelism (each
router sees its shard of the tokens) and pipeline stages (each its own layers, numbered
globally: the record_indices path). Two ranks holding identical records (tensor parallelism
without sequence parallelism: the same tokens) are refused. Not knowable from the trace: which
tokens were prompt tokens (all are kept); the hook path under pipeline parallelism numbers each
stage's layers from 0 (merge such stages only through record_indices).

Write (``export-routing --format megatron``): ``router_trace_rank0.jsonl`` in ``DEST`` (a
folder), one step per batch pass, the fields the hook path writes: the run's recorded passes,
else virtual batches of ``--batch-size`` consecutive requests at the same decode position.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moe_spec.capture.engines.base import (
    MAX_COUNT,
    ModelFacts,
    Piece,
    ReadOptions,
    SourceError,
    checked_ids,
    id_array,
    jsonl,
    source_files,
    whole,
)

NAME = "megatron"
VERSION = "megatron-router-tracer-jsonl"
PATTERN = "router_trace_rank*.jsonl"


class _Record:
    __slots__ = ("layer", "ids", "where")

    def __init__(self, layer: int, ids: np.ndarray, where: str):
        self.layer, self.ids, self.where = layer, ids, where


def _rank_of(path: Path) -> int:
    m = re.search(r"rank(\d+)", path.name)
    return int(m.group(1)) if m else 0


def _steps(path: Path, options: ReadOptions, progress, skipped: dict) \
        -> Iterator[tuple[int, list[_Record], int]]:
    """(step, its decoder records in order, rank) of one rank file, step by step."""
    step, records, seen, rank = None, [], set(), None
    for number, record, _ in jsonl(path, progress):
        where = f"{path} line {number}"
        if not isinstance(record, dict):
            raise SourceError(f"{where}: a record is not a JSON object")
        if record.get("block", "decoder") != "decoder":
            skipped["mtp records"] = skipped.get("mtp records", 0) + 1
            continue
        s = whole(record.get("step"), where, "step")
        layer = whole(record.get("layer"), where, "layer")
        num = whole(record.get("num_tokens"), where, "num_tokens")
        if rank is None:
            rank = whole(record.get("rank", _rank_of(path)), where, "rank")
        if options.layer_base:
            if layer < options.layer_base:
                raise SourceError(f"{where}: layer {layer} in a trace read with --layer-base "
                                  f"{options.layer_base} (record_indices numbers layers from "
                                  "1): the hook path numbers from 0, pass --layer-base 0")
            layer -= options.layer_base
        arr = id_array(record.get("top_indices"), where, "top_indices")
        if num == 0 and arr.size == 0:
            arr = arr.reshape(0, int(record.get("topk") or 0) if isinstance(
                record.get("topk"), int) and not isinstance(record.get("topk"), bool) else 0)
        if arr.ndim != 2 or len(arr) != num:
            raise SourceError(f"{where}: top_indices has shape {list(arr.shape)}, but "
                              f"num_tokens is {num}: wrong shape")
        if "topk" in record and arr.shape[1] != whole(record["topk"], where, "topk"):
            raise SourceError(f"{where}: top_indices rows hold {arr.shape[1]} ids, topk says "
                              f"{record['topk']}: wrong shape")
        if s != step:
            if step is not None:
                yield step, records, rank
            if s in seen:
                raise SourceError(f"{where}: step {s} appears again after step {step}; records "
                                  "of a step must be consecutive")
            seen.add(s)
            step, records = s, []
        records.append(_Record(layer, arr, where))
    if step is not None:
        yield step, records, rank


def _forwards(step: int, records: list[_Record], options: ReadOptions, skipped: dict) \
        -> list[dict[int, _Record]]:
    """A step's records as its forwards (microbatches): the m-th distinct record of each
    layer; a record equal to an earlier one of its layer is a recomputation's re-fire."""
    per: dict[int, list[_Record]] = {}
    for rec in records:
        mine = per.setdefault(rec.layer, [])
        if any(r.ids.shape == rec.ids.shape and np.array_equal(r.ids, rec.ids) for r in mine):
            key = "recomputed router calls (re-fires with the same ids) dropped"
            skipped[key] = skipped.get(key, 0) + 1
            continue
        mine.append(rec)
    counts = {layer: len(v) for layer, v in per.items()}
    m = options.microbatches
    if set(counts.values()) != {m}:
        layer, most = max(counts.items(), key=lambda x: x[1])
        where = per[layer][-1].where
        if m == 1 and most > 1:
            raise SourceError(f"{where}: step {step} has {most} records for layer {layer} with "
                              "different ids: several microbatches per training iteration "
                              "(Megatron stamps them all with the iteration); pass "
                              f"--microbatches-per-step {most}")
        raise SourceError(f"{where}: step {step} has {sorted(set(counts.values()))} distinct "
                          f"records per layer, expected {m} (--microbatches-per-step): a "
                          "forward is missing a layer, or a recomputation re-fired with other "
                          "ids")
    return [{layer: v[i] for layer, v in per.items()} for i in range(m)]


def _merged(layers_of_files: list[dict[int, _Record]], ranks: list[int], step: int) \
        -> dict[int, tuple[np.ndarray, str]]:
    """One forward's records of several rank files merged per layer, in rank order."""
    out: dict[int, tuple[np.ndarray, str]] = {}
    layers = sorted({layer for f in layers_of_files for layer in f})
    for layer in layers:
        held = [(r, f[layer]) for r, f in zip(ranks, layers_of_files) if layer in f]
        for (ra, a), (rb, b) in zip(held, held[1:]):
            if len(a.ids) and a.ids.shape == b.ids.shape and np.array_equal(a.ids, b.ids):
                raise SourceError(f"{b.where}: ranks {ra} and {rb} routed the same tokens at "
                                  f"step {step}, layer {layer}: tensor-parallel ranks without "
                                  "sequence parallelism see the same tokens; import one rank "
                                  "per data-parallel replica (without --merge-ranks)")
        out[layer] = (np.concatenate([rec.ids for _, rec in held]), held[-1][1].where)
    return out


def _emit(step: int, forward: dict[int, tuple[np.ndarray, str]], stream: str,
          facts: ModelFacts, options: ReadOptions, start: int, pass_id: int) -> Piece:
    where = next(iter(forward.values()))[1] if forward else stream
    got = sorted(forward)
    if got != list(facts.moe_layers):
        base = "" if options.layer_base or sorted(x - 1 for x in got) != \
            list(facts.moe_layers) else " (layers numbered from 1: record_indices' " \
            "layer_number; pass --layer-base 1)"
        raise SourceError(f"{where}: step {step} has records for layers {got}, but "
                          f"{facts.describe()} has MoE layers {list(facts.moe_layers)} (the "
                          "layer count disagrees with the config" + (base or ")"))
    counts = {len(forward[layer][0]) for layer in got}
    if len(counts) != 1:
        raise SourceError(f"{where}: step {step} routes {sorted(counts)} tokens at "
                          "different layers: wrong shape (every layer routes the step's tokens)")
    arr = np.stack([forward[layer][0] for layer in facts.moe_layers], axis=1)
    ids = checked_ids(arr, facts, options, f"{where} (step {step})")
    n = len(ids)
    return Piece(stream, ids, np.arange(start, start + n, dtype=np.int32),
                 step=np.full(n, pass_id, np.int64), last=False)


def read(source: Path, facts: ModelFacts, options: ReadOptions,
         progress: Callable[[int], None] | None = None, skipped: dict | None = None) \
        -> Iterator[Piece]:
    skipped = skipped if skipped is not None else {}
    files = sorted(source_files(source, PATTERN), key=lambda p: (_rank_of(p), p.name))
    groups = [files] if options.merge_ranks else [[f] for f in files]
    m = options.microbatches
    for group in groups:
        streams = [_steps(f, options, progress, skipped) for f in group]
        start, piece = 0, None
        while True:
            got = [next(s, None) for s in streams]
            if all(g is None for g in got):
                break
            if any(g is None for g in got) or len({g[0] for g in got}) != 1:
                steps = ["ends" if g is None else g[0] for g in got]
                raise SourceError(f"{group[0].parent}: the rank files disagree on the next step "
                                  f"({steps}): --merge-ranks reads ranks that traced the same "
                                  "steps")
            step = got[0][0]
            ranks = [g[2] for g in got]
            stream = f"rank{ranks[0]}" if len(group) == 1 else \
                f"ranks{min(ranks)}-{max(ranks)}"
            per_file = [_forwards(step, g[1], options, skipped) for g in got]
            for mb in range(m):
                if step * m + mb > MAX_COUNT:
                    raise SourceError(f"{got[0][1][0].where}: step {step} × "
                                      f"--microbatches-per-step {m} is past the step column")
                forward = _merged([f[mb] for f in per_file], ranks, step)
                if piece is not None:
                    yield piece
                piece = _emit(step, forward, stream, facts, options, start, step * m + mb)
                start += len(piece.token)
        if piece is not None:
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
