"""Encoding: what a capture decoded and recorded (torch tensors) as Arrow tables of the trace
schema (:mod:`catalog.schema`), and the writing of one prompt's tables in order.

    per verification pass:  routing rows (all MoE layers × tree nodes) and moe_io rows (the
                            layers and passes the storage policy keeps, in its dtype)
    per prompt:             trees (one row per pass), nodes (one row per tree node), then
                            sequences (one row: the prompt is complete)

Vectors are stored as list columns; bfloat16 as its 16-bit pattern (lossless, decoded by
:func:`catalog.reader.matrix`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from moe_spec.catalog import reader, schema
from moe_spec.catalog.writer import RunWriter, list_column
from moe_spec.eagle.decoding import Generation
from moe_spec.moe.recorder import LayerRecord
from moe_spec.policy.budget import Budget


def _np(t: torch.Tensor, dtype=np.float32) -> np.ndarray:
    """A tensor on the host as ``dtype`` (bf16 has no numpy type, so go through float32)."""
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).numpy().astype(dtype, copy=False)


def _vectors(t: torch.Tensor, dtype: str) -> pa.ListArray:
    """``[rows, width]`` tensor as a list column in the storage dtype (bfloat16 as its bits)."""
    x = _np(t.reshape(t.shape[0], -1))
    if dtype == "bfloat16":
        return list_column(reader.bfloat16_bits(x), pa.uint16())
    if dtype == "float16":
        return list_column(x.astype(np.float16), pa.float16())
    return list_column(x, pa.float32())


def layer_tables(prompt_index: int, prompt_id: str, step: int, records: list[LayerRecord],
                 storage: dict) -> tuple[pa.Table, pa.Table | None]:
    """``routing`` rows of one verification pass (all layers × nodes) and ``moe_io`` rows of
    the layers whose tensors were recorded (the storage policy's), or None."""
    m = records[0].probs.shape[0]

    def keys(recs):
        rows = m * len(recs)
        return {"prompt_index": pa.array(np.full(rows, prompt_index, np.int32)),
                "prompt_id": pa.array([prompt_id] * rows),
                "step": pa.array(np.full(rows, step, np.int32)),
                "layer": pa.array(np.repeat(np.array([r.layer for r in recs], np.int16), m)),
                "node": pa.array(np.tile(np.arange(m, dtype=np.int16), len(recs)))}

    cat = lambda recs, f, dtype=np.float32: np.concatenate([_np(f(r), dtype) for r in recs])  # noqa: E731
    budgeted = records[0].applied_ids is not None
    rows = m * len(records)
    routing = pa.Table.from_pydict({
        **keys(records),
        "router_probs": list_column(cat(records, lambda r: r.probs), pa.float32()),
        "topk_ids": list_column(cat(records, lambda r: r.topk_ids, np.int16), pa.int16()),
        "topk_weights": list_column(cat(records, lambda r: r.topk_weights), pa.float32()),
        "applied_ids": list_column(cat(records, lambda r: r.applied_ids, np.int16), pa.int16())
        if budgeted else pa.nulls(rows, schema.vector(pa.int16())),
        "applied_weights": list_column(cat(records, lambda r: r.applied_weights), pa.float32())
        if budgeted else pa.nulls(rows, schema.vector(pa.float32())),
    }, schema=schema.TABLES["routing"])
    kept = [r for r in records if r.hidden is not None]
    if not kept:
        return routing, None
    dtype = storage["dtype"]
    vec = schema.vector(schema.hidden_type(dtype))
    stack = lambda f: torch.cat([f(r) for r in kept])  # noqa: E731
    output = stack(lambda r: r.output)
    io = {**keys(kept),
          "hidden": _vectors(stack(lambda r: r.hidden), dtype),
          "output": _vectors(output, dtype) if storage["output"] == "store"
          else pa.nulls(m * len(kept), vec),
          "output_norm": pa.array(_np(output.float().norm(dim=-1))),
          "expert_outputs": _vectors(stack(lambda r: r.expert_outputs), dtype)
          if kept[0].expert_outputs is not None else pa.nulls(m * len(kept), vec)}
    return routing, pa.Table.from_pydict(io, schema=schema.storage_schema("moe_io", dtype))


def step_tables(prompt_index: int, prompt_id: str, gen: Generation, experts: dict,
                budget: Budget | None, batch: dict | None = None) -> tuple[pa.Table, pa.Table]:
    """``trees`` (one row per pass) and ``nodes`` (one row per tree node) of a prompt;
    ``experts[step]`` = (unique experts, experts loaded) per MoE layer; ``batch[step]`` = the
    batched pass's columns (:class:`BatchColumns`), absent at b = 1. A prompt that stopped
    before any pass (its first token was EOS) has none of either."""
    batch = batch or {}
    if not gen.steps:
        return schema.TABLES["trees"].empty_table(), schema.TABLES["nodes"].empty_table()
    trees = [dict(prompt_index=prompt_index, prompt_id=prompt_id, step=s.step,
                  prefix_len=s.prefix_len, nodes=s.tree.size, depth=int(s.tree.depth.max()),
                  accepted_length=s.accepted_length, draft_seconds=s.draft_seconds,
                  verify_seconds=s.verify_seconds, unique_experts=experts[s.step][0],
                  experts_loaded=experts[s.step][1], budget=budget.size if budget else None,
                  ranking=budget.ranking.name if budget else None,
                  coverage=budget.coverage.name if budget else None,
                  **batch.get(s.step, BatchColumns.single(s.tree.size, experts[s.step])).row())
             for s in gen.steps]
    cat = lambda f: torch.cat([f(s) for s in gen.steps]).cpu().numpy()  # noqa: E731
    sizes = [s.tree.size for s in gen.steps]
    accepted = np.zeros(sum(sizes), dtype=bool)
    offsets = np.cumsum([0, *sizes[:-1]])
    for off, s in zip(offsets, gen.steps):
        accepted[off + np.asarray(s.path)] = True
    rows = sum(sizes)
    nodes = {"prompt_index": np.full(rows, prompt_index, np.int32),
             "prompt_id": [prompt_id] * rows,
             "step": np.repeat([s.step for s in gen.steps], sizes).astype(np.int32),
             "node": np.concatenate([np.arange(n) for n in sizes]).astype(np.int16),
             "parent": cat(lambda s: s.tree.parents).astype(np.int16),
             "depth": cat(lambda s: s.tree.depth).astype(np.int16),
             "token_id": cat(lambda s: s.tree.tokens).astype(np.int32),
             "draft_logprob": cat(lambda s: s.tree.scores.float()).astype(np.float32),
             "accepted": accepted}
    return (pa.Table.from_pylist(trees, schema=schema.TABLES["trees"]),
            pa.Table.from_pydict(nodes, schema=schema.TABLES["nodes"]))


@dataclass
class BatchColumns:
    """The ``trees`` columns of the batched pass a tree was verified in."""

    batch_pass: int | None
    slot: int
    batch_size: int
    batch_tokens: int
    batch_unique_experts: list[int]  # per MoE layer, over every tree of the pass
    batch_experts_loaded: list[int]

    @classmethod
    def single(cls, nodes: int, experts: tuple[list[int], list[int]]) -> BatchColumns:
        """b = 1: the pass is the tree."""
        return cls(None, 0, 1, nodes, *experts)

    def row(self) -> dict:
        return dict(self.__dict__)


def sequence_table(index: int, prompt, ids: list[int], gen: Generation) -> pa.Table:
    return pa.Table.from_pylist([dict(
        prompt_index=index, prompt_id=prompt.prompt_id, prompt_token_ids=ids,
        output_token_ids=gen.output_ids, steps=len(gen.steps),
        mean_accepted_length=gen.mean_accepted_length, wall_seconds=gen.seconds,
        stop_reason=gen.stop_reason)], schema=schema.TABLES["sequences"])


class PromptChunks:
    """Routing and MoE tensors of one prompt, written every ``chunk_steps`` passes (bounded
    memory however long a generation runs); keeps per-pass expert counts for ``trees``. Runs on
    the background writer: device-to-host copies and Parquet encoding happen there."""

    def __init__(self, writer: RunWriter, index: int, prompt_id: str, storage: dict):
        self.writer, self.index, self.prompt_id = writer, index, prompt_id
        self.storage = storage
        self.chunk = 0
        self.experts: dict[int, tuple[list[int], list[int]]] = {}
        self.batch: dict[int, BatchColumns] = {}  # step → its batched pass (b > 1)

    def write(self, passes: list[tuple[int, list[LayerRecord]]]) -> None:
        if not passes:
            return
        routing, io = [], []
        for step, records in passes:
            self.experts[step] = ([r.unique_experts for r in records],
                                  [r.experts_loaded for r in records])
            r_t, io_t = layer_tables(self.index, self.prompt_id, step, records, self.storage)
            routing.append(r_t)
            if io_t is not None:
                io.append(io_t)
        self.writer.write_part("routing", self.index, self.chunk, pa.concat_tables(routing))
        # every chunk has a moe_io part (empty where the policy kept no pass), so a missing one
        # is always damage, never the policy
        io_table = pa.concat_tables(io) if io else \
            schema.storage_schema("moe_io", self.storage["dtype"]).empty_table()
        self.writer.write_part("moe_io", self.index, self.chunk, io_table)
        self.chunk += 1

    def finish(self, prompt, ids: list[int], gen: Generation, budget: Budget | None,
               on_complete: Callable[[], None] | None = None) -> None:
        """``trees`` and ``nodes``, then ``sequences`` (the prompt is complete), then
        ``on_complete`` (the run's progress). A prompt with no pass still gets (empty)
        ``routing`` and ``moe_io`` parts: a complete prompt has a part in every table that is
        always complete."""
        if self.chunk == 0:
            self.writer.write_part("routing", self.index, 0,
                                   schema.TABLES["routing"].empty_table())
            self.writer.write_part("moe_io", self.index, 0,
                                   schema.storage_schema("moe_io", self.storage["dtype"])
                                   .empty_table())
            self.chunk = 1
        trees, nodes = step_tables(self.index, self.prompt_id, gen, self.experts, budget,
                                   self.batch)
        self.writer.write_part("trees", self.index, 0, trees)
        self.writer.write_part("nodes", self.index, 0, nodes)
        self.writer.write_part("sequences", self.index, 0,
                               sequence_table(self.index, prompt, ids, gen))
        if on_complete is not None:  # a Ray worker leaves the progress to the driver
            on_complete()
