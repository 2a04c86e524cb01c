"""Scale-out on Ray, 2 workers vs 1, on this machine (ratios from one run).

    python bench/scale_out.py --prompts 40 --max-new-tokens 64

A local Ray cluster with 2 CPU slots is started first (not timed); each measurement then
includes its actors starting and loading the model once (tiny-olmoe, one torch thread per
actor), and is also given without that start-up (the throughput a long study sees):

* capture prompts/s with ``--workers 2`` vs ``--workers 1`` (goal ≥ 1.6×), and whether the
  2-worker tables equal the 1-worker ones (goal: identical);
* replay tree-layers/s (router and oracle × both policies × the paper's budgets) with 2 workers
  vs 1 (goal ≥ 1.6×), and whether the results are equal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import ray

from moe_spec.capture.run import CaptureSettings, capture_run
from moe_spec.catalog import Catalog
from moe_spec.moe import models
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.replay.run import ReplayRequest, parse_budgets, replay

TIMINGS = {"draft_seconds", "verify_seconds", "wall_seconds"}


def same_tables(root: Path, a: str, b: str) -> bool:
    """Whether runs ``a`` and ``b`` hold the same rows (timings aside) in every table."""
    cat = Catalog(root)
    pair = [run for name in (a, b) for run in cat.runs(names=[name])]
    for name in ("sequences", "trees", "nodes", "routing", "moe_io"):
        t = [pq.read_table(run.dir(name)) for run in pair]
        keep = [c for c in t[0].column_names if c not in TIMINGS]
        sort = [(c, "ascending") for c in ("prompt_index", "step", "layer", "node") if c in keep]
        if not t[0].select(keep).sort_by(sort).equals(t[1].select(keep).sort_by(sort)):
            return False
    return True


def rates(label: str, count: int, unit: str, wall: float, start_up: float) -> tuple:
    """(end to end, after start-up) throughput of ``count`` items in ``wall`` seconds, printed."""
    both = count / wall, count / (wall - start_up)
    print(f"{label} {count} {unit} in {wall:.1f} s ({both[0]:.2f} {unit}/s; start-up "
          f"{start_up:.1f} s, {both[1]:.2f} {unit}/s after it)")
    return both


def speedups(rate: dict) -> str:
    """2 workers vs 1, end to end and after start-up."""
    return (f"{rate[2][0] / rate[1][0]:.2f}x end to end, "
            f"{rate[2][1] / rate[1][1]:.2f}x after start-up")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args()
    found = {}
    models.quiet_transformers()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    root = Path(tempfile.mkdtemp(prefix="scale-out-"))
    try:
        settings = CaptureSettings(limit=args.prompts, max_new_tokens=args.max_new_tokens)
        rate = {}
        for workers in (1, 2):
            t0 = time.perf_counter()
            s = capture_run(settings, root, f"w{workers}", workers=workers, progress=False)
            rate[workers] = rates(f"capture, {workers} worker(s): {s.trees} trees,", s.prompts,
                                  "prompts", time.perf_counter() - t0, s.load_seconds)
        same = same_tables(root, "w1", "w2")
        print(f"capture prompts/s, 2 workers vs 1: {speedups(rate)} (goal >= 1.6x); "
              f"tables identical: {same}")
        found["capture"] = dict(prompts_per_s=rate, tables_identical=same)

        cat = Catalog(root)
        runs = cat.runs(names=["w1"])
        adapter = MoEAdapter(models.load("tiny-olmoe", device="cpu").model)
        request = ReplayRequest(("router", "oracle"), ("truncation", "substitution"),
                                tuple(parse_budgets("sweep", adapter.num_experts)))
        tl_rate = {}
        for workers in (1, 2):
            t0 = time.perf_counter()
            o = replay(cat, runs, adapter, request, None, [], root / f"r{workers}",
                       device=adapter.model.device, progress=False, workers=workers)
            tl_rate[workers] = rates(f"replay, {workers} worker(s):", o.tree_layers,
                                     "tree-layers", time.perf_counter() - t0, o.start_seconds)
        a, b = (duckdb.sql(f"SELECT * EXCLUDE (config, block) FROM read_parquet('{root}/r{w}/"
                           "replay_open/**/*.parquet', hive_partitioning=true) ORDER BY ALL").pl()
                for w in (1, 2))
        diff = max((a[c] - b[c]).abs().max() for c in ("rse", "token_error"))
        print(f"replay tree-layers/s, 2 workers vs 1: {speedups(tl_rate)} (goal >= 1.6x); "
              f"results equal: {a.height == b.height} rows, max difference {diff:.1e}")
        found["replay"] = dict(tree_layers_per_s=tl_rate, rows=[a.height, b.height],
                               max_difference=float(diff))
        if args.out:
            args.out.write_text(json.dumps(found, indent=1))
    finally:
        ray.shutdown()
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
