"""Import throughput and memory: a synthetic SGLang source of a given size through
``import-routing`` (issue 43's goal: ≥ 1M token-layers/s on SGLang's base64 records, peak RSS
≤ 1 GiB however large the source).

The source is what SGLang returns for a real model's shape (``--shape``, default Qwen3-30B-A3B:
48 MoE layers, 128 experts, top-8; its config.json written to a folder, no weights): one
``/generate`` response per line, ``meta_info.routed_experts`` base64 int32 ``[rows, layers, k]``
with a slot per decoder layer, decode rows only (requests that sent ``routed_experts_start_len``
= the prompt; read with ``--prompt-start prompt``, as SGLang never echoes it), ids
drawn skewed (a few hot experts per layer, as real routing) and distinct within each top-k.
The import runs as its own process (``import-routing --output``), so its peak RSS is its own.

    python bench/import_routing.py                       # smoke size (8 MiB)
    python bench/import_routing.py --mb 1024 --out /tmp/import-bench   # ~1 GiB
    python bench/import_routing.py --gb 10 --out /big/disk              # the issue's 10 GB
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_config(shape: str, folder: Path) -> dict:
    from moe_spec.moe.shapes import REAL_SHAPES
    cfg = REAL_SHAPES[shape].build_config()
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


def write_source(path: Path, size: int, n: int, k: int, layers: int, seed: int = 0) -> dict:
    """SGLang responses until ``size`` bytes: prompts of 200–1000 tokens, 50–400 generated."""
    rng = np.random.default_rng(seed)
    # skewed popularity per layer: a Zipf-like weight, shuffled per layer
    weights = 1.0 / np.arange(1, n + 1) ** 0.8
    popular = np.stack([rng.permutation(n) for _ in range(layers)])  # [layers, n]
    cdf = np.cumsum(weights / weights.sum())
    written = records = token_layers = 0
    with open(path, "w", encoding="ascii") as f:
        while written < size:
            p, c = int(rng.integers(200, 1000)), int(rng.integers(50, 400))
            rows = c - 1
            base = popular[np.arange(layers)[None, :],
                           np.searchsorted(cdf, rng.random((rows, layers)))]  # [rows, layers]
            offsets = np.sort(rng.choice(n, size=k, replace=False))  # distinct within a top-k
            ids = (base[:, :, None] + offsets[None, None, :]) % n
            meta = dict(id=f"req-{records}", prompt_tokens=p, completion_tokens=c,
                        finish_reason={"type": "length"},
                        e2e_latency=round(float(rng.random()), 3),
                        routed_experts=base64.b64encode(ids.astype("<i4").tobytes())
                        .decode("ascii"))
            line = json.dumps({"text": "", "meta_info": meta}, separators=(",", ":")) + "\n"
            f.write(line)
            written += len(line)
            records += 1
            token_layers += rows * layers
    return dict(bytes=written, records=records, token_layers=token_layers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=8, help="source size in MiB")
    p.add_argument("--gb", type=float, default=None, help="source size in GiB (overrides --mb)")
    p.add_argument("--shape", default="qwen3-moe", help="a real model shape (moe/shapes.py)")
    p.add_argument("--out", type=Path, default=Path("/tmp/import-routing-bench"),
                   help="working folder (source, config, traces)")
    p.add_argument("--result", type=Path, default=None, help="result JSON (default OUT/result.json)")
    p.add_argument("--keep", action="store_true", help="keep the source and traces")
    args = p.parse_args(argv)
    size = int((args.gb * 1024 if args.gb else args.mb) * 2**20)
    out = args.out
    shutil.rmtree(out / "traces", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    config = write_config(args.shape, out / "model")
    from moe_spec.moe import families
    found = families.facts(config)
    n, k, layers = found.num_experts, found.top_k, found.num_layers
    t0 = time.perf_counter()
    source = write_source(out / "sglang.jsonl", size, n, k, layers)
    made = time.perf_counter() - t0
    print(f"source: {source['bytes'] / 2**20:.0f} MiB, {source['records']} responses, "
          f"{source['token_layers']:,} token-layers ({made:.1f} s to write)")
    summary = out / "import.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "moe_spec.capture.import_routing", str(out / "sglang.jsonl"),
                           "--format", "sglang", "--model", str(out / "model"), "--bench", "bench",
                           "--run", "sglang", "--out", str(out / "traces"), "--no-progress",
                           "--prompt-start", "prompt",
                           "--output", str(summary)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    got = json.loads(summary.read_text())
    result = dict(shape=args.shape, num_experts=n, top_k=k, layers=layers,
                  source_mib=source["bytes"] / 2**20, responses=source["records"],
                  token_layers=got["token_layers"], import_seconds=got["seconds"],
                  token_layers_per_s=got["token_layers_per_s"],
                  cpu_seconds=got["cpu_seconds"],
                  token_layers_per_cpu_s=got["token_layers_per_cpu_s"],
                  load_average=os.getloadavg()[0],
                  source_mib_per_s=source["bytes"] / 2**20 / got["seconds"],
                  peak_rss_mib=got["peak_rss_mib"], wall_seconds=wall,
                  written_mib=got["bytes_written"] / 2**20, parts=got["parts"],
                  cpus=os.cpu_count())
    assert got["token_layers"] == source["token_layers"]
    print(f"import: {result['token_layers_per_s']:,.0f} token-layers/s "
          f"({result['source_mib_per_s']:.0f} MiB/s of source; "
          f"{result['token_layers_per_cpu_s']:,.0f} per CPU-second, load average "
          f"{result['load_average']:.1f} on {os.cpu_count()} CPUs), {got['seconds']:.1f} s "
          f"({wall:.1f} s with start-up), peak RSS {got['peak_rss_mib']:.0f} MiB, "
          f"{result['written_mib']:.0f} MiB in {got['parts']} parts")
    (args.result or out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep:
        (out / "sglang.jsonl").unlink()
        shutil.rmtree(out / "traces", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
