"""Capture and replay on a two-node Ray cluster with traces on an object store vs one process.

    python bench/multi_node.py --prompts 16 --max-new-tokens 32 --out cluster.json
    python bench/multi_node.py --prompts 2 --max-new-tokens 4            # a smoke run

Starts moto's S3 server on 127.0.0.1 in a process of its own, then a Ray cluster of two nodes on
this machine (a head and a second raylet, one CPU slot each, each with its own temp dir; timed:
the cluster's start-up). The same capture runs in this process onto ``s3://bench/traces/one``
and, through ``ray_address`` (what ``--ray-address`` passes), on the two nodes onto
``s3://bench/traces/two`` (one actor per node, one torch thread each; nothing in a folder the
nodes share; the same store on both sides, so the ratio is the scale-out's alone); then the same
open-loop replay (router and oracle, truncation, ``--budgets``) of each, reading and writing S3.

Reported: whether every trace table and the replay results are identical (timing columns left
out), and the two-node throughput over the one process's (capture prompts/s, replay
tree-layers/s), end to end and after start-up (the two-node runs' actors starting and loading
the model; the one process's model loading), with the start-up times. One run of each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from moe_spec import console
from moe_spec.bench import object_store, pipeline
from moe_spec.capture.run import CaptureSettings, capture_run
from moe_spec.catalog import Catalog, location, schema
from moe_spec.replay.run import ReplayRequest, parse_budgets, replay

RUN = "r"


def start_cluster(temp: Path):
    """A head node and a second raylet with their own CPU slot, resource and temp dir; started
    after the store's AWS_* variables are set, which the nodes' workers inherit. Returns the
    cluster (``.address`` is what ``--ray-address`` takes)."""
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={"head": 1}, include_dashboard=False))
    cluster.add_node(num_cpus=1, resources={"second": 1}, temp_dir=str(temp / "second-node"))
    cluster.wait_for_nodes()
    return cluster


def nodes_used(actor_class: str) -> int:
    """How many nodes ran an actor of ``actor_class`` (Ray's GCS actor table, dead ones
    included)."""
    from ray._private import state
    return len({a["Address"]["NodeID"] for a in state.actors().values()
                if a["ActorClassName"] == actor_class})


def rates(count: int, seconds: float, start_up: float) -> dict:
    return dict(count=count, seconds=seconds, start_up_seconds=start_up,
                per_s=count / seconds, per_s_after_start_up=count / (seconds - start_up))


def measure(args, one, two, address: str) -> dict:
    """Capture and replay, one process on root ``one`` and two nodes on root ``two``."""
    settings = CaptureSettings(model=args.model, bench=args.bench, limit=args.prompts,
                               max_new_tokens=args.max_new_tokens)
    found: dict = {"capture": {}, "replay": {}}
    sides = (("one_process", one, None), ("two_nodes", two, address))
    for side, root, ray_address in sides:
        s = capture_run(settings, root, RUN, progress=False, ray_address=ray_address)
        found["capture"][side] = rates(s.prompts, s.seconds, s.load_seconds)
        found["model"] = s.model
    loaded, adapter = pipeline.loaded_model(found["model"])
    request = ReplayRequest(("router", "oracle"), ("truncation",),
                            tuple(parse_budgets(args.budgets, adapter.num_experts)))
    for side, root, ray_address in sides:
        catalog = Catalog(root)
        t0 = time.perf_counter()
        o = replay(catalog, catalog.runs(names=[RUN]), adapter, request, None, [], root,
                   device=loaded.device, progress=False, ray_address=ray_address)
        found["replay"][side] = rates(o.tree_layers, time.perf_counter() - t0, o.start_seconds)
    identical = object_store.same_tables(one, two, found["model"], args.bench, RUN)
    found["capture"]["identical"] = all(identical[t] for t in schema.TRACE_TABLES)
    found["replay"]["identical"] = identical["replay_open"]
    found["identical_tables"] = identical
    found["nodes"] = {"capture": nodes_used("CaptureWorker"), "replay": nodes_used("ReplayWorker")}
    for stage in ("capture", "replay"):
        one, two = found[stage]["one_process"], found[stage]["two_nodes"]
        found[stage]["speedup"] = two["per_s"] / one["per_s"]
        found[stage]["speedup_after_start_up"] = \
            two["per_s_after_start_up"] / one["per_s_after_start_up"]
    return found


def report(found: dict) -> None:
    print(f"{found['model']}, {found['prompts']} prompts × {found['max_new_tokens']} new tokens; "
          f"two nodes started in {found['cluster_start_seconds']:.1f} s")
    for stage, unit in (("capture", "prompts"), ("replay", "tree-layers")):
        f = found[stage]
        for side in ("one_process", "two_nodes"):
            r = f[side]
            print(f"  {stage} {side.replace('_', ' '):11s} {r['count']} {unit} in "
                  f"{r['seconds']:.1f} s: {r['per_s']:.2f} {unit}/s (start-up "
                  f"{r['start_up_seconds']:.1f} s; {r['per_s_after_start_up']:.2f} {unit}/s "
                  "after it)")
        print(f"  {stage}: two nodes / one process {f['speedup']:.2f}× end to end, "
              f"{f['speedup_after_start_up']:.2f}× after start-up; identical: "
              f"{'yes' if f['identical'] else 'no'}; nodes used: {found['nodes'][stage]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-olmoe")
    p.add_argument("--bench", default="mbpp")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budgets", default="sweep", help="replay budgets (default: the sweep)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the one process (default 1; each node's actor has "
                        "one, as on a joined cluster)")
    p.add_argument("--out", type=Path, default=Path("cluster.json"), help="result file")
    args = p.parse_args()
    console.threads.apply(args.threads)
    import ray
    remote_base, server = object_store.start_store()
    try:
        with tempfile.TemporaryDirectory(prefix="cluster-bench.") as tmp:
            t0 = time.perf_counter()
            cluster = start_cluster(Path(tmp))
            start_seconds = time.perf_counter() - t0
            try:
                found = measure(args, location.root(f"{remote_base}/one"),
                                location.root(f"{remote_base}/two"), cluster.address)
            finally:
                ray.shutdown()
                cluster.shutdown()
    finally:
        server.terminate()
        server.wait()
    found.update(prompts=args.prompts, max_new_tokens=args.max_new_tokens, threads=args.threads,
                 cluster_start_seconds=start_seconds)
    args.out.write_text(json.dumps(found, indent=2) + "\n")
    report(found)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
