"""Synthetic captured runs for benchmarks: any number of trees, at any model's shapes.

A synthetic run looks to replay exactly like a capture: per tree (M nodes) and MoE layer, the
model's own router and experts are run on random MoE inputs, so routing is the model's and the
gold output passes replay's check. Only the tables replay reads are written (``routing``,
``moe_io``, ``sequences``, minimal ``trees`` and ``nodes``), through the catalog's run writer
(:class:`catalog.writer.RunWriter`: the same parts, manifest and commit as a capture's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from moe_spec.catalog import schema
from moe_spec.catalog.writer import RunWriter, list_column
from moe_spec.moe.adapter import MoEAdapter


@torch.no_grad()
def write_run(root: Path, model_name: str, model, *, prompts: int, trees_per_prompt: int,
              nodes: int = 63, run: str = "synthetic", bench: str = "synthetic",
              seed: int = 0, role: str = "evaluation") -> None:
    """``prompts × trees_per_prompt`` trees of ``nodes`` tokens at every MoE layer (a run
    already there with the same settings is resumed: its complete prompts are kept)."""
    adapter = MoEAdapter(model)
    g = torch.Generator().manual_seed(seed)
    h_size = adapter.facts.hidden_size
    writer = RunWriter(root, model_name, bench, run)
    try:
        manifest, done = writer.start(dict(
            model=model_name, bench=bench, run=run, role=role,
            schema_version=schema.SCHEMA_VERSION,
            settings=dict(offset=0, hidden_dtype="float32", temperature=0.0, budget=None, depth=7,
                          seed=seed, nodes=nodes, trees_per_prompt=trees_per_prompt),
            storage=dict(layers=[layer.index for layer in adapter], passes="all",
                         dtype="float32", output="store"),
            prompt_ids=[f"s{p}" for p in range(prompts)], prompts_total=prompts,
            num_experts=adapter.num_experts, top_k=adapter.top_k,
            moe_layers=[layer.index for layer in adapter], model_location=model_name))
        for p in range(prompts):
            if p not in done:
                _write_prompt(writer, adapter, g, h_size, p, trees_per_prompt, nodes)
        if manifest["status"] != "complete":
            writer.finish({**manifest, "prompts_done": prompts})
    finally:
        writer.close()


def _write_prompt(writer: RunWriter, adapter: MoEAdapter, g: torch.Generator, h_size: int,
                  p: int, trees_per_prompt: int, nodes: int) -> None:
    """One prompt's parts, ``sequences`` last (then the prompt is complete)."""
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
            **key, "router_probs": list_column(probs.numpy(), pa.float32()),
            "topk_ids": list_column(idx.numpy().astype(np.int16), pa.int16()),
            "topk_weights": list_column(weights.float().numpy(), pa.float32()),
            "applied_ids": pa.nulls(rows, pa.list_(pa.int16())),
            "applied_weights": pa.nulls(rows, pa.list_(pa.float32()))},
            schema=schema.TABLES["routing"]))
        io.append(pa.Table.from_pydict({
            **key, "hidden": list_column(h.numpy(), pa.float32()),
            "output": list_column(out.float().numpy(), pa.float32()),
            "output_norm": pa.array(out.float().norm(dim=-1).numpy()),
            "expert_outputs": pa.nulls(rows, pa.list_(pa.float32()))},
            schema=schema.TABLES["moe_io"]))
    for table, parts in (("routing", routing), ("moe_io", io)):
        writer.write_part(table, p, 0, pa.concat_tables(parts))
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
        writer.write_part(table, p, 0, t)
