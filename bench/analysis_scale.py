"""Coverage-curve and activation-growth analyses over many trees, timed.

    python bench/analysis_scale.py --trees 10000 --layers 8

Writes a synthetic ``routing`` table (N=64, k=8, 63-node trees, skewed per-tree routing) in the
trace schema to a temporary folder, then times :func:`analysis.routing.coverage_curve` and
:func:`analysis.routing.activation_growth`, which run in DuckDB over the Parquet files without
materialising rows as Python objects. Prints the wall time and the peak RSS of this process.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis import routing
from analysis.sql import connect
from catalog import schema
from catalog.runs import write_manifest


def write_synthetic(root: Path, trees: int, layers: int, n=64, k=8, m=63, seed=0,
                    per_file=500) -> None:
    rng = np.random.default_rng(seed)
    folder = root / "routing" / "model=synthetic" / "bench=synthetic" / "run=scale"
    folder.mkdir(parents=True)
    for f, start in enumerate(range(0, trees, per_file)):
        count = min(per_file, trees - start)
        rows = count * layers * m
        bias = rng.normal(size=(count * layers, 1, n)) * 2.0  # per tree-layer preference
        logits = (bias + rng.normal(size=(count * layers, m, n))).reshape(rows, n)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
        top = np.argsort(-probs, 1)[:, :k]
        step = np.repeat(np.arange(start, start + count), layers * m).astype(np.int32)
        layer = np.tile(np.repeat(np.arange(layers), m), count).astype(np.int16)
        node = np.tile(np.arange(m), count * layers).astype(np.int16)

        def lists(a, t):
            return pa.ListArray.from_arrays(pa.array(np.arange(0, a.size + 1, a.shape[1],
                                                               dtype=np.int32)),
                                            pa.array(a.reshape(-1), type=t))
        table = pa.table({
            "prompt_index": pa.array(np.zeros(rows, np.int32)),
            "prompt_id": pa.array(["p"] * rows), "step": pa.array(step), "layer": pa.array(layer),
            "node": pa.array(node), "router_probs": lists(probs, pa.float32()),
            "topk_ids": lists(top.astype(np.int16), pa.int16()),
            "topk_weights": lists(np.take_along_axis(probs, top, 1), pa.float32()),
            "applied_ids": pa.nulls(rows, pa.list_(pa.int16())),
            "applied_weights": pa.nulls(rows, pa.list_(pa.float32())),
        }, schema=schema.TABLES["routing"])
        pq.write_table(table, folder / f"part-{f:06d}-0000.parquet")
    write_manifest(root, dict(model="synthetic", bench="synthetic", run="scale",
                              status="complete", role="evaluation", settings={},
                              schema_version=schema.SCHEMA_VERSION))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", type=int, default=10_000)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_synthetic(Path(tmp), args.trees, args.layers)
        print(f"wrote {args.trees} trees x {args.layers} layers in "
              f"{time.perf_counter() - t0:.1f} s")
        con = connect(tmp)
        for fn in (routing.coverage_curve, routing.activation_growth):
            t0 = time.perf_counter()
            frame = fn(con)
            print(f"{fn.__name__}: {time.perf_counter() - t0:.1f} s -> {frame.height} rows")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
