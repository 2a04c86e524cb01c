"""The dashboard at study scale: summaries built, every routing page timed, app RSS measured.

    python bench/analysis_scale.py                          # 576,000 tree-layers (OLMoE on MBPP)
    python bench/analysis_scale.py --prompts 50 --keep /tmp/scale   # smaller, keep the traces
    python bench/analysis_scale.py --prompts 100 --out scale.json     # the numbers, as JSON

1. Writes a complete synthetic capture in the trace schema: OLMoE's shape (N = 64, k = 8,
   16 MoE layers, 63-node trees), ``prompts`` × ``steps`` trees. Routing has a realistic heavy
   tail: per layer a Zipf-like expert popularity, per tree a preference, per token noise; the
   top-k by probability, trees with a parent structure and an accepted path.
2. Builds the routing summaries (:func:`analysis.summaries.ensure`) and prints tree-layers/s,
   and the CPU time of one routing part reduced in a worker process set up as the build's (warm
   cache: steadier than the build's wall clock on a shared machine).
3. Times, in a fresh process, every analysis the app's routing pages call, then drives every
   page of the real dashboard with Streamlit's AppTest (first render: caches cold) and prints
   each page's time and the peak RSS of that process.

Goals (issue 19): any app figure ≤ 1.5 s over 576k tree-layers, building ≥ 50k tree-layers/s,
app peak RSS ≤ 2 GiB. Numbers are one run on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

from moe_spec.catalog import schema
from moe_spec.catalog.writer import RunWriter, list_column

N, K, LAYERS, M = 64, 8, 16, 63
MODEL, BENCH, RUN = "synthetic-olmoe", "mbpp", "scale"


def _parents(m: int) -> np.ndarray:
    """A 63-node tree: the root's 10 children, then each node's children in turn (depth ≤ 7)."""
    parents = np.full(m, -1)
    for j in range(1, m):
        parents[j] = 0 if j <= 10 else (j - 11) // 4 + 1
    return parents


def write_prompt(args) -> int:
    """One prompt's parts of every table (one chunk per prompt), ``sequences`` last."""
    root, prompt, steps, seed = args
    rng = np.random.default_rng([seed, prompt])
    writer = RunWriter(root, MODEL, BENCH, RUN)  # the driver's holds the run's lock
    popularity = -1.2 * np.log(np.arange(1, N + 1))  # Zipf-like, per layer permuted
    perms = np.stack([np.random.default_rng([seed, 99, layer]).permutation(N)
                      for layer in range(LAYERS)])
    rows = steps * LAYERS * M
    logits = (popularity[perms][None, :, None, :]  # [1, L, 1, N]
              + rng.normal(size=(steps, LAYERS, 1, N)) * 1.5  # per tree-layer preference
              + rng.normal(size=(steps, LAYERS, M, N)) * 1.0).reshape(rows, N)  # per token
    logits -= logits.max(1, keepdims=True)
    probs = np.exp(logits, dtype=np.float32)
    probs /= probs.sum(1, keepdims=True)
    top = np.argpartition(-probs, K, axis=1)[:, :K]
    top = np.take_along_axis(top, np.argsort(-np.take_along_axis(probs, top, 1), 1), 1)
    step = np.repeat(np.arange(steps, dtype=np.int32), LAYERS * M)
    layer = np.tile(np.repeat(np.arange(LAYERS, dtype=np.int16), M), steps)
    node = np.tile(np.arange(M, dtype=np.int16), steps * LAYERS)
    key = dict(prompt_index=pa.array(np.full(rows, prompt, np.int32)),
               prompt_id=pa.array([f"p{prompt}"] * rows))
    writer.write_part("routing", prompt, 0, pa.table({
        **key, "step": pa.array(step), "layer": pa.array(layer), "node": pa.array(node),
        "router_probs": list_column(probs, pa.float32()),
        "topk_ids": list_column(top.astype(np.int16), pa.int16()),
        "topk_weights": list_column(np.take_along_axis(probs, top, 1), pa.float32()),
        "applied_ids": pa.nulls(rows, schema.vector(pa.int16())),
        "applied_weights": pa.nulls(rows, schema.vector(pa.float32()))}, schema=schema.TABLES["routing"]))
    unique = np.array([[len(np.unique(top[(s * LAYERS + la) * M:(s * LAYERS + la + 1) * M]))
                        for la in range(LAYERS)] for s in range(steps)], dtype=np.int16)
    accepted = rng.integers(1, 6, size=steps).astype(np.int16)
    tkey = dict(prompt_index=pa.array(np.full(steps, prompt, np.int32)),
                prompt_id=pa.array([f"p{prompt}"] * steps))
    writer.write_part("trees", prompt, 0, pa.table({
        **tkey, "step": pa.array(np.arange(steps, dtype=np.int32)),
        "prefix_len": pa.array((100 + np.cumsum(accepted)).astype(np.int32)),
        "nodes": pa.array(np.full(steps, M, np.int16)),
        "depth": pa.array(np.full(steps, 7, np.int16)), "accepted_length": pa.array(accepted),
        "draft_seconds": pa.array(np.full(steps, 0.01)),
        "verify_seconds": pa.array(np.full(steps, 0.03)),
        "unique_experts": list_column(unique, pa.int16()), "experts_loaded": list_column(unique, pa.int16()),
        "budget": pa.nulls(steps, pa.int16()), "ranking": pa.nulls(steps, pa.string()),
        "coverage": pa.nulls(steps, pa.string()),
        **{f.name: pa.nulls(steps, f.type) for f in schema.TABLES["trees"]  # b = 1: no batch
           if f.name.startswith("batch_") or f.name == "slot"}}, schema=schema.TABLES["trees"]))
    parents = _parents(M)
    depth = np.zeros(M, np.int16)
    for j in range(1, M):
        depth[j] = depth[parents[j]] + 1
    n_rows = steps * M
    acc = np.zeros((steps, M), bool)
    for s, a in enumerate(accepted):  # the accepted path: root, then first children down
        j, acc[s, 0] = 0, True
        for _ in range(a - 1):
            kids = np.flatnonzero(parents == j)
            if not len(kids):
                break
            j = kids[0]
            acc[s, j] = True
    nkey = dict(prompt_index=pa.array(np.full(n_rows, prompt, np.int32)),
                prompt_id=pa.array([f"p{prompt}"] * n_rows))
    writer.write_part("nodes", prompt, 0, pa.table({
        **nkey, "step": pa.array(np.repeat(np.arange(steps, dtype=np.int32), M)),
        "node": pa.array(np.tile(np.arange(M, dtype=np.int16), steps)),
        "parent": pa.array(np.tile(parents.astype(np.int16), steps)),
        "depth": pa.array(np.tile(depth, steps)),
        "token_id": pa.array(rng.integers(0, 50000, n_rows).astype(np.int32)),
        "draft_logprob": pa.array(-np.tile(depth, steps).astype(np.float32)),
        "accepted": pa.array(acc.reshape(-1))}, schema=schema.TABLES["nodes"]))
    writer.write_part("moe_io", prompt, 0,  # no MoE tensors kept (as --store-layers none)
                      schema.storage_schema("moe_io", "bfloat16").empty_table())
    writer.write_part("sequences", prompt, 0, pa.table({
        "prompt_index": pa.array([prompt], pa.int32()), "prompt_id": pa.array([f"p{prompt}"]),
        "prompt_token_ids": pa.array([[1, 2, 3]], pa.list_(pa.int32())),
        "output_token_ids": pa.array([list(range(int(accepted.sum())))], pa.list_(pa.int32())),
        "steps": pa.array([steps], pa.int32()),
        "mean_accepted_length": pa.array([float(accepted.mean())]),
        "wall_seconds": pa.array([1.0]), "stop_reason": pa.array(["length"]),
        "prompt_tokens": pa.array([None], pa.int32())},  # a capture: its prompt ids say it
        schema=schema.TABLES["sequences"]))
    return rows // M


def write_synthetic(root: Path, prompts: int, steps: int, seed: int = 0) -> int:
    """A complete run of ``prompts × steps`` trees; returns tree-layers written."""
    from moe_spec.moe.shapes import REAL_SHAPES
    shape_dir = root.parent / f"{root.name}-olmoe-shape"  # OLMoE's config, for the cost model
    REAL_SHAPES["olmoe"].build_config().save_pretrained(shape_dir)
    manifest = dict(model=MODEL, model_location=str(shape_dir), draft=None, bench=BENCH, run=RUN,
                    role="evaluation", settings=dict(offset=0, depth=7, total_tokens=M,
                                                     tree_top_k=10, budget=None),
                    num_experts=N, top_k=K, renormalize=False, num_layers=LAYERS,
                    moe_layers=list(range(LAYERS)), hidden_size=2048, feature_layers=[2, 8, 13],
                    dtype="torch.bfloat16", device="synthetic", versions={},
                    schema_version=schema.SCHEMA_VERSION, prompts_total=prompts,
                    prompt_ids=[f"p{i}" for i in range(prompts)], storage=None)
    writer = RunWriter(root, MODEL, BENCH, RUN)
    manifest, _ = writer.start(manifest)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        tree_layers = sum(pool.map(write_prompt, [(str(root), i, steps, seed)
                                                  for i in range(prompts)]))
    writer.finish({**manifest, "prompts_done": prompts})
    writer.close()
    return tree_layers


PROBE = r'''
import json, resource, sys, time
from pathlib import Path
root = Path(sys.argv[1])
timings = {}
def timed(name, fn):
    t0 = time.perf_counter(); out = fn(); timings[name] = time.perf_counter() - t0; return out
from moe_spec.analysis import coactivation, frames, routing
from moe_spec.analysis.sql import connect
con = timed("connect", lambda: connect(root, roles=("evaluation",)))
for name in ("tails", "coverage", "growth", "balance"):
    timed(name, lambda: frames.ANALYSES[name](con))
for conv in ("all_pairs", "adjacent"):
    timed(f"coactivation ({conv})", lambda: coactivation.coactivation(
        con, 3, 64, conv, dict(model="synthetic-olmoe", bench="mbpp")))
stats = timed("routing statistics", lambda: frames.routing_statistics(con, "synthetic-olmoe", "mbpp"))
timed("speedup frame", lambda: frames.speedup_frame(stats, frames.real_targets()[
    "allenai/OLMoE-1B-7B-0924"], list(frames.cost.PROFILES.values())))
analysis_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(dict(timings=timings, peak_rss_gib=analysis_rss)))
'''

APP = r'''
import json, resource, sys, time
from streamlit.testing.v1 import AppTest
from moe_spec.app.screens import PAGES
sys.argv = ["main.py", "--traces", sys.argv[1]]
from pathlib import Path
at = AppTest.from_file(str(Path.cwd() / "app" / "main.py"), default_timeout=600)
timings = {}
t0 = time.perf_counter(); at.run(); timings["Runs overview"] = time.perf_counter() - t0
assert not at.exception, [e.message for e in at.exception]
for name, (title, _) in PAGES.items():
    if name == "overview":
        continue
    t0 = time.perf_counter(); at.switch_page(f"screens/{name}.py").run()
    timings[title] = time.perf_counter() - t0
    assert not at.exception, (title, [e.message for e in at.exception])
print(json.dumps(dict(timings=timings,
                      peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)))
'''


def _run(code: str, root: Path) -> dict:
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code, str(root)], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _part_cpu(path: str, shape: tuple, repeats: int) -> tuple[int, float]:
    from moe_spec.analysis import summaries
    tree_layers = len(summaries.reduce_part(path, *shape).rows["layer"])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        summaries.reduce_part(path, *shape)
        best = min(best, time.process_time() - t0)
    return tree_layers, best


def part_seconds(root: Path, repeats: int = 5) -> dict:
    """CPU time of :func:`analysis.summaries.reduce_part` on one routing part in a worker
    process set up as the build's (the fastest of ``repeats`` after one warm-up read)."""
    from moe_spec.analysis import summaries
    from moe_spec.catalog import Catalog
    run = Catalog(root).runs(complete=True)[0]
    path = str(sorted(run.dir("routing").glob("part-*.parquet"))[0])
    shape = (int(run.manifest["num_experts"]), int(run.manifest["top_k"]),
             int(run.settings.get("total_tokens", M)))
    from moe_spec.bench import analysis_scale  # the task by its module: workers skip __main__
    with summaries.pool(1) as worker:
        tree_layers, best = worker.submit(analysis_scale._part_cpu, path, shape, repeats).result()
    return dict(tree_layers=tree_layers, cpu_seconds=best,
                tree_layers_per_cpu_s=tree_layers / max(best, 1e-9))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=500)
    p.add_argument("--steps", type=int, default=72, help="trees per prompt")
    p.add_argument("--keep", type=Path, default=None, help="write the traces here and keep them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="also write the measured numbers here (JSON)")
    args = p.parse_args()
    from moe_spec.analysis import summaries
    tmp = Path(tempfile.mkdtemp(prefix="scale-")) if args.keep is None else args.keep
    root = tmp / f"traces-{uuid.uuid4().hex[:6]}" if args.keep is None else args.keep
    try:
        if not (root / "routing").is_dir():
            t0 = time.perf_counter()
            tl = write_synthetic(root, args.prompts, args.steps, args.seed)
            gib = sum(f.stat().st_size for f in root.rglob("*.parquet")) / 2**30
            print(f"wrote {tl:,} tree-layers ({args.prompts} prompts × {args.steps} trees × "
                  f"{LAYERS} layers, {gib:.1f} GiB) in {time.perf_counter() - t0:.0f} s")
        shutil.rmtree(root / summaries.FOLDER, ignore_errors=True)
        report = summaries.ensure(root)
        size = sum(f.stat().st_size for f in (root / summaries.FOLDER).rglob("*.parquet"))
        print(f"summaries: {report.tree_layers:,} tree-layers in {report.seconds:.1f} s = "
              f"{report.tree_layers / report.seconds:,.0f} tree-layers/s "
              f"({os.cpu_count()} processes; {size / 2**20:.1f} MiB on disk)")
        part = part_seconds(root)
        print(f"one routing part ({part['tree_layers']:,} tree-layers), one worker, warm: "
              f"{part['cpu_seconds'] * 1e3:.0f} ms CPU = {part['tree_layers_per_cpu_s']:,.0f} "
              "tree-layers per CPU-second")
        probe = _run(PROBE, root)
        print(f"\nanalyses the routing pages call (fresh process, peak RSS "
              f"{probe['peak_rss_gib']:.2f} GiB):")
        for name, secs in probe["timings"].items():
            print(f"  {name:<28} {secs:6.2f} s")
        app = _run(APP, root)
        print(f"\nevery dashboard page, first render (AppTest, peak RSS "
              f"{app['peak_rss_gib']:.2f} GiB):")
        for name, secs in app["timings"].items():
            print(f"  {name:<28} {secs:6.2f} s")
        worst = max(app["timings"].values())
        print(f"\nslowest page {worst:.2f} s (goal ≤ 1.5 s); build "
              f"{report.tree_layers / report.seconds:,.0f} tree-layers/s (goal ≥ 50,000); app "
              f"peak RSS {app['peak_rss_gib']:.2f} GiB (goal ≤ 2)")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(dict(
                prompts=args.prompts, steps=args.steps, processes=os.cpu_count(),
                summaries=dict(tree_layers=report.tree_layers, seconds=report.seconds,
                               tree_layers_per_s=report.tree_layers / report.seconds,
                               mib_on_disk=size / 2**20, one_part=part),
                analyses=probe, pages=app), indent=2))
            print(f"wrote {args.out}")
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
