"""What reading only committed, verified files costs a query (issue 38).

    python bench/query_verify.py --prompts 60 --steps 72      # 69,120 tree-layers
    python bench/query_verify.py --prompts 500 --out v.json   # 576,000 tree-layers (8.5 GiB)

Writes one synthetic OLMoE-shaped run (``bench/analysis_scale.py``'s, committed by its writer),
then times ``query`` (a fresh process each time, as a user runs it) over ``trees`` and
``routing`` three ways, best of ``--repeats``:

* **as found**: the same files with the commit record taken out of the manifest — what every
  query did before trace schema 5 (glob the folders, check every footer's column types);
* **cold**: committed, nothing verified yet (every file is hashed once);
* **warm**: committed, verified before (a ``stat`` per file and a cache look-up).

Prints the ratios warm / as found (goal ≤ 1.1×) and cold / as found; ``--out`` writes them.
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
from pathlib import Path

from moe_spec.bench.analysis_scale import write_synthetic

QUERIES = ("SELECT count(*), avg(accepted_length) FROM trees",
           "SELECT layer, count(*) FROM routing GROUP BY layer ORDER BY layer")


THREADS = 1


def query_seconds(root: Path, sql: str, cache: Path, *options: str) -> float:
    env = dict(os.environ, MOESPEC_VERIFY_CACHE=str(cache), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(THREADS), MOESPEC_THREADS=str(THREADS))
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "moe_spec.analysis.query_cli", sql, "--traces", str(root),
                        "--format", "csv", *options], capture_output=True, text=True,
                       env=env)
    seconds = time.perf_counter() - start
    if r.returncode:
        raise SystemExit(f"query failed: {r.stderr.strip()}")
    return seconds


def as_found(root: Path, copy: Path) -> None:
    """``copy``: the run with its manifest's commit record removed (read as found)."""
    shutil.copytree(root, copy, copy_function=os.link)  # hard links: no second 8 GiB
    for path in copy.glob("runs/**/_manifest.json"):
        manifest = json.loads(path.read_text())
        manifest.pop("files", None)
        manifest.pop("commit_digest", None)
        manifest["schema_version"] = 4
        path.unlink()  # (a hard link: write a new file, not through the shared one)
        path.write_text(json.dumps(manifest))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=60)
    p.add_argument("--steps", type=int, default=72, help="trees per prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="DuckDB threads of each query")
    p.add_argument("--out", type=Path, default=None, help="the result as JSON")
    args = p.parse_args()
    global THREADS
    THREADS = args.threads
    with tempfile.TemporaryDirectory(prefix="query-verify.") as tmp:
        tmp = Path(tmp)
        root, legacy = tmp / "traces", tmp / "legacy"
        tree_layers = write_synthetic(root, args.prompts, args.steps)
        as_found(root, legacy)
        parts = sum(1 for _ in root.rglob("part-*.parquet"))
        found = {}
        for sql in QUERIES:
            cache = tmp / "cache.sqlite"
            cold = query_seconds(root, sql, cache)  # hashes every file once
            warm = min(query_seconds(root, sql, cache) for _ in range(args.repeats))
            old = min(query_seconds(legacy, sql, tmp / "unused.sqlite", "--allow-legacy")
                      for _ in range(args.repeats))
            found[sql] = dict(as_found_s=old, cold_s=cold, warm_s=warm,
                              warm_ratio=warm / old, cold_ratio=cold / old)
            cache.unlink()
            print(f"{sql}\n  as found {old:.2f} s, cold {cold:.2f} s ({cold / old:.2f}×), "
                  f"warm {warm:.2f} s ({warm / old:.2f}× as found)")
    result = dict(tree_layers=tree_layers, parts=parts, repeats=args.repeats, queries=found)
    print(f"{tree_layers} tree-layers in {parts} parts; warm / as found: "
          + ", ".join(f"{v['warm_ratio']:.2f}×" for v in found.values()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
