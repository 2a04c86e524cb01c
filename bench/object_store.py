"""Traces on an object store vs a local folder: capture and replay throughput, same tables.

    python bench/object_store.py --prompts 8 --max-new-tokens 24 --out object_store.json
    python bench/object_store.py --prompts 1 --max-new-tokens 4          # a smoke run

Starts moto's S3 server on 127.0.0.1 in a process of its own (an object store with real HTTP
round trips, no network) and, in one process with the model loaded once, captures the same
prompts into a local folder and onto ``s3://bench/traces``, then replays both (router and oracle
over the budget sweep).
Reported: prompts/s of capture and tree-layers/s of replay on each, model loading excluded, and
their ratios s3 / local (goal ≥ 0.8×); and whether every trace table and the replay results
read back identical from both (timing columns left out). Each side is measured ``--repeats``
times in alternation (fresh runs) and the fastest kept.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_spec.bench import pipeline
from moe_spec.catalog import location, run_dir, schema

TIMINGS = {"draft_seconds", "verify_seconds", "wall_seconds", "seconds"}


def start_store() -> tuple[str, subprocess.Popen]:
    """moto's S3 server on a free port of 127.0.0.1, in its own process (a store is not in the
    client's process: no share of its interpreter lock); AWS_* variables set for this process;
    one bucket. Returns the traces URI and the server process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    deadline = time.time() + 60
    while True:
        try:
            fs.mkdir("bench")
            return "s3://bench/traces", server
        except Exception:  # noqa: BLE001 - not listening yet
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("moto's S3 server did not start") from None
            time.sleep(0.2)


def comparable(table):
    keep = [c for c in table.column_names if c not in TIMINGS]
    order = [c for c in ("prompt_index", "step", "layer", "node", "ranking", "coverage",
                         "budget") if c in keep]
    return table.select(keep).sort_by([(c, "ascending") for c in order])


def same_tables(local, remote, model: str, bench: str, run: str) -> dict[str, bool]:
    """Every trace table of the run and the open-loop replay results, local vs remote."""
    found = {}
    for table in schema.TRACE_TABLES:
        a, b = (comparable(location.read_table(run_dir(r, table, model, bench, run)))
                for r in (local, remote))
        found[table] = a.equals(b)
    from moe_spec.analysis.sql import connect
    sql = ("SELECT * EXCLUDE (config, block, committed_at) FROM replay_open "
           "ORDER BY ranking, coverage, budget, layer, prompt_index, step")
    a, b = (connect(r, roles=None).sql(sql).to_arrow_table() for r in (local, remote))
    found["replay_open"] = a.num_rows > 0 and a.equals(b)
    return found


def measure(root, run: str, args) -> dict:
    summary = pipeline.capture(root, run, model=args.model, bench=args.bench, limit=args.prompts,
                               max_new_tokens=args.max_new_tokens)
    capture_s = summary.seconds - summary.load_seconds
    t0 = time.perf_counter()
    outcome = pipeline.replay_runs(root, summary.model, [run], rankings=("router", "oracle"),
                                   coverages=("truncation",), budgets=args.budgets, out=root)
    replay_s = time.perf_counter() - t0
    return dict(model=summary.model, prompts=summary.prompts, trees=summary.trees,
                capture_seconds=capture_s, prompts_per_s=summary.prompts / capture_s,
                replay_seconds=replay_s, tree_layers=outcome.tree_layers,
                tree_layers_per_s=outcome.tree_layers / replay_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-olmoe")
    p.add_argument("--bench", default="mbpp")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--budgets", default="8,16,24,32")
    p.add_argument("--repeats", type=int, default=2, help="measurements per side (best kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, default=Path("object_store.json"), help="result file")
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    remote_base, server = start_store()
    try:
        result = compare(remote_base, args)
    finally:
        server.terminate()
        server.wait()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    model = result["model"]
    print(f"{model}, {args.prompts} prompts × {args.max_new_tokens} new tokens, best of "
          f"{args.repeats}:")
    for side in ("local", "s3"):
        b = result[side]
        print(f"  {side:5s}  capture {b['prompts_per_s']:.2f} prompts/s "
              f"({b['capture_seconds']:.1f} s)  replay {b['tree_layers_per_s']:.0f} "
              f"tree-layers/s ({b['replay_seconds']:.1f} s)")
    identical = result["identical"]
    print(f"s3 / local: capture {result['capture_ratio']:.2f}×, replay "
          f"{result['replay_ratio']:.2f}× (goal ≥ 0.8×); identical tables: "
          f"{all(identical.values())} ({', '.join(k for k, v in identical.items() if not v)})")
    print(f"wrote {args.out}")


def compare(remote_base: str, args) -> dict:
    """Both sides measured ``args.repeats`` times in alternation; the result file's content."""
    with tempfile.TemporaryDirectory(prefix="object-store-bench.") as tmp:
        pipeline.capture(Path(tmp) / "warm", "warm", model=args.model, bench=args.bench,
                         limit=1, max_new_tokens=4)  # model loads, caches warm
        sides: dict[str, list[dict]] = {"local": [], "s3": []}
        roots = {}
        for i in range(args.repeats):
            for side in ("local", "s3"):
                root = location.root(f"{remote_base}/{i}") if side == "s3" \
                    else Path(tmp) / f"local-{i}"
                roots[side] = root
                sides[side].append(measure(root, "r", args))
        model = sides["local"][0]["model"]
        identical = same_tables(roots["local"], roots["s3"], model, args.bench, "r")
    best = {side: dict(min(rows, key=lambda r: r["capture_seconds"]),
                       replay_seconds=min(r["replay_seconds"] for r in rows),
                       tree_layers_per_s=max(r["tree_layers_per_s"] for r in rows))
            for side, rows in sides.items()}
    for side in best.values():
        side["prompts_per_s"] = side["prompts"] / side["capture_seconds"]
    return dict(
        model=model, bench=args.bench, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, local=best["local"], s3=best["s3"], all=sides,
        capture_ratio=best["s3"]["prompts_per_s"] / best["local"]["prompts_per_s"],
        replay_ratio=best["s3"]["tree_layers_per_s"] / best["local"]["tree_layers_per_s"],
        identical=identical, goal=0.8)


if __name__ == "__main__":
    main()
