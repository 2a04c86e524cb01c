"""Synthetic captured runs for benchmarks: any number of trees, at any model's shapes.

A synthetic run looks to replay exactly like a capture: per tree (M nodes) and MoE layer, the
model's own router and experts are run on random MoE inputs, so routing is the model's and the
gold output passes replay's check. Only the tables replay reads are written (``routing``,
``moe_io``, ``sequences``, minimal ``trees`` and ``nodes``) plus a complete manifest.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from catalog import atomic, schema
from catalog.runs import run_dir, write_manifest
from moe.adapter import MoEAdapter


def _lists(matrix: np.ndarray, dtype: pa.DataType) -> pa.ListArray:
    rows, width = matrix.shape
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1), type=dtype))


@torch.no_grad()
def write_run(root: Path, model_name: str, model, *, prompts: int, trees_per_prompt: int,
              nodes: int = 63, run: str = "synthetic", bench: str = "synthetic",
              seed: int = 0, role: str = "evaluation") -> None:
    """``prompts × trees_per_prompt`` trees of ``nodes`` tokens at every MoE layer."""
    adapter = MoEAdapter(model)
    g = torch.Generator().manual_seed(seed)
    h_size = model.config.hidden_size
    for p in range(prompts):
        routing, io = [], []
        rows = trees_per_prompt * nodes
        for layer in adapter:  # every tree of the prompt at once, one layer at a time
            h = torch.randn(rows, h_size, generator=g)
            logits, weights, idx = layer.router(h)
            probs = layer.rule.scores(logits)
            out = layer.forward(h)
            key = dict(prompt_index=np.full(rows, p, np.int32), prompt_id=[f"s{p}"] * rows,
                       step=np.repeat(np.arange(trees_per_prompt, dtype=np.int32), nodes),
                       layer=np.full(rows, layer.index, np.int16),
                       node=np.tile(np.arange(nodes, dtype=np.int16), trees_per_prompt))
            routing.append(pa.Table.from_pydict({
                **key, "router_probs": _lists(probs.numpy(), pa.float32()),
                "topk_ids": _lists(idx.numpy().astype(np.int16), pa.int16()),
                "topk_weights": _lists(weights.float().numpy(), pa.float32()),
                "applied_ids": pa.nulls(rows, pa.list_(pa.int16())),
                "applied_weights": pa.nulls(rows, pa.list_(pa.float32()))},
                schema=schema.TABLES["routing"]))
            io.append(pa.Table.from_pydict({
                **key, "hidden": _lists(h.numpy(), pa.float32()),
                "output": _lists(out.float().numpy(), pa.float32()),
                "output_norm": pa.array(out.float().norm(dim=-1).numpy()),
                "expert_outputs": pa.nulls(rows, pa.list_(pa.float32()))},
                schema=schema.TABLES["moe_io"]))
        for table, parts in (("routing", routing), ("moe_io", io)):
            folder = run_dir(root, table, model_name, bench, run)
            folder.mkdir(parents=True, exist_ok=True)
            atomic.write_table(folder / f"part-{p:06d}-0000.parquet", pa.concat_tables(parts))
        trees = pa.Table.from_pylist([dict(prompt_index=p, prompt_id=f"s{p}", step=s,
                                           nodes=nodes) for s in range(trees_per_prompt)],
                                     schema=pa.schema([schema.TABLES["trees"].field(c) for c in
                                                       ("prompt_index", "prompt_id", "step",
                                                        "nodes")]))
        seq = pa.Table.from_pylist([dict(prompt_index=p, prompt_id=f"s{p}",
                                         steps=trees_per_prompt)],
                                   schema=pa.schema([schema.TABLES["sequences"].field(c) for c in
                                                     ("prompt_index", "prompt_id", "steps")]))
        node_rows = pa.Table.from_pylist([dict(prompt_index=p, prompt_id=f"s{p}", step=s,
                                               node=j)
                                          for s in range(trees_per_prompt) for j in range(nodes)],
                                         schema=pa.schema([schema.TABLES["nodes"].field(c)
                                                           for c in ("prompt_index", "prompt_id",
                                                                     "step", "node")]))
        for table, t in (("trees", trees), ("nodes", node_rows), ("sequences", seq)):
            folder = run_dir(root, table, model_name, bench, run)
            folder.mkdir(parents=True, exist_ok=True)
            atomic.write_table(folder / f"part-{p:06d}-0000.parquet", t)
    write_manifest(root, dict(
        model=model_name, bench=bench, run=run, role=role, status="complete",
        run_id=uuid.uuid4().hex, schema_version=schema.SCHEMA_VERSION,
        settings=dict(offset=0, hidden_dtype="float32", temperature=0.0, budget=None, depth=7),
        storage=dict(layers=[layer.index for layer in adapter], passes="all", dtype="float32",
                     output="store"),
        prompt_ids=[f"s{p}" for p in range(prompts)], num_experts=adapter.num_experts,
        top_k=adapter.top_k, moe_layers=[layer.index for layer in adapter],
        model_location=model_name))
