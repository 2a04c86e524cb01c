"""Time to the first line: how fast each command refuses bad input, and answers fully reused work.

    python bench/startup.py                       # a tiny trace in a temporary folder
    python bench/startup.py --repeats 5 --output startup.json

Each case runs the installed console script in a fresh process (wall clock, the median of
``--repeats``) with ``HF_HUB_OFFLINE=1``, and checks its exit status and that it printed one
line on stderr. The cases: the one-line errors a user meets first (an unknown run, an offline hub
model, a bad run name, an out-of-range budget, a bad ``--threads``, missing traces), ``--help``,
and ``replay --ranking oracle --budget 24`` after the same replay has run on a tiny trace (every
cell stored: it answers from stored results, without the model or torch). Goal: ≤ 1.5 s each on
an idle machine. For context, the import time of the heavy modules (each in a fresh process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_spec.catalog import Catalog

GOAL = 1.5  # seconds
BIN = Path(os.path.abspath(sys.executable)).parent
HEAVY = ("torch", "transformers", "polars", "duckdb", "pyarrow", "plotly")


def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def timed(argv: list[str], repeats: int) -> tuple[float, subprocess.CompletedProcess]:
    times, done = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env=env())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), done


def cases(traces: Path, missing: Path) -> list[tuple[str, list[str], int]]:
    """(name, argv, expected exit status)."""
    t = str(traces)
    return [
        ("replay: unknown run", ["replay", "--traces", t, "--run", "nonexistent"], 2),
        ("replay: budget out of range", ["replay", "--traces", t, "--budget", "999"], 2),
        ("replay: --threads 0", ["replay", "--traces", t, "--threads", "0"], 2),
        ("capture: offline hub model", ["capture", "--model", "olmoe", "--out", t], 2),
        ("capture: bad run name", ["capture", "--run", "a/b", "--out", t], 2),
        ("query: no traces", ["query", "--traces", str(missing), "SELECT 1"], 2),
        ("evaluate: no runs", ["evaluate", "--traces", str(missing)], 2),
        ("profile-target: offline hub model", ["profile-target", "--model", "olmoe"], 2),
        ("inspect-model: offline hub model", ["inspect-model", "--model", "olmoe"], 2),
        ("train-draft: offline hub model", ["train-draft", "--model", "olmoe"], 2),
        ("replay --help", ["replay", "--help"], 0),
        ("replay: fully reused (oracle, B=24)",
         ["replay", "--traces", t, "--ranking", "oracle", "--budget", "24", "--no-progress"], 0),
    ]


def import_seconds(module: str, repeats: int) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return statistics.median(
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env(), check=True).stdout) for _ in range(repeats))


def prepare(traces: Path) -> None:
    """A one-prompt capture of tiny-olmoe and one replay of it (so the next is fully reused)."""
    if not Catalog(traces).runs():
        subprocess.run([str(BIN / "capture"), "--limit", "1", "--max-new-tokens", "8", "--out",
                        str(traces), "--run", "startup", "--no-progress"], check=True, env=env(),
                       capture_output=True)
    subprocess.run([str(BIN / "replay"), "--traces", str(traces), "--ranking", "oracle",
                    "--budget", "24", "--no-progress"], check=True, env=env(),
                   capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=None,
                   help="traces to use (default: a tiny capture in a temporary folder)")
    p.add_argument("--repeats", type=int, default=3, help="runs per case (median)")
    p.add_argument("--output", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="moespec-startup-") as tmp:
        traces = args.traces or Path(tmp) / "traces"
        prepare(traces)
        rows = []
        for name, argv, want in cases(traces, Path(tmp) / "missing"):
            seconds, done = timed([str(BIN / argv[0]), *argv[1:]], args.repeats)
            err = done.stderr.strip().splitlines()
            ok = done.returncode == want and (want == 0 or len(err) == 1)
            rows.append(dict(case=name, seconds=round(seconds, 3), status=done.returncode,
                             ok=ok, within_goal=seconds <= GOAL,
                             first_line=(err or done.stdout.strip().splitlines() or [""])[0][:100]))
    imports = {m: round(import_seconds(m, args.repeats), 3) for m in HEAVY}
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  seconds  status  (goal ≤ {GOAL} s; median of {args.repeats})")
    for r in rows:
        flag = "" if r["ok"] else "  UNEXPECTED"
        flag += "" if r["within_goal"] else "  over goal"
        print(f"{r['case']:<{width}}  {r['seconds']:7.2f}  {r['status']:6d}{flag}")
    print("import time (fresh process): " + ", ".join(f"{m} {s:.2f} s" for m, s in imports.items()))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {cpus} CPUs usable, load average {load:.1f} (busy machines run slower)")
    if args.output:
        args.output.write_text(json.dumps(dict(cases=rows, imports=imports, goal=GOAL,
                                               cpus=cpus, load=load), indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
