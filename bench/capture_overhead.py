"""Capture cost at real model shapes: traced vs untraced decoding, memory, bytes per tree.

    python bench/capture_overhead.py --shape tiny-olmoe --prompts 8
    python bench/capture_overhead.py --shape olmoe qwen3-moe mixtral --prompts 2

For each shape (an embedded tiny model, or a random-weight model with a real checkpoint's widths
and routing and one decoder layer, ``moe.shapes``; never committed), one run each:

* *untraced*: the decoder alone; *traced*: the full capture with the default storage policy
  and the background writer (goal ≤ 1.25×), model loading excluded on both sides;
* peak RSS of the capture above the model's own (goal ≤ 1 GiB);
* bytes per tree and per MoE layer of each table, measured, and projected to the real depth
  for three storage policies (default ``auto``/bf16/recompute; all layers bf16 recompute; all
  layers fp32 with stored outputs, round 1's format), with the size of a full MBPP capture
  (500 prompts) at the measured trees per prompt of this run (real τ differs: see the note).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import tempfile
import time
from pathlib import Path

from moe_spec.capture.run import CaptureSettings, capture_run
from moe_spec.capture.storage import StoragePolicy
from moe_spec.catalog import Catalog, Run, reader
from moe_spec.eagle import loading
from moe_spec.eagle.decoding import EagleDecoder
from moe_spec.moe import families, models, shapes
from moe_spec.tasks import benchmarks
from moe_spec.training.real_width import real_width_pair

MBPP_PROMPTS = 500


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def untraced(model: str, draft: str | None, prompts, max_new: int) -> tuple[float, int]:
    loaded, head = loading.load_with_draft(model, draft, device="cpu", dtype="float32")
    dec = EagleDecoder(loaded.model, head)
    tok = loaded.tokenizer
    dec.generate(tok(prompts[0].text)["input_ids"], max_new_tokens=4, seed=0)  # warm-up
    t0 = time.perf_counter()
    trees = sum(len(dec.generate(tok(p.text)["input_ids"], max_new_tokens=max_new,
                                 eos_token_ids={tok.eos_token_id}, seed=i).steps)
                for i, p in enumerate(prompts))
    return time.perf_counter() - t0, trees


def table_bytes(run: Run, table: str) -> int:
    """Bytes on disk of one table of a run (its parts, found through the catalog)."""
    return sum(p.stat().st_size for i in run.prompt_indices() for p in run.parts(table, i))


def captured(root: Path) -> Run:
    (run,) = Catalog(root).runs()
    return run


def projected(shape, per_layer: dict, nodes: int = 63) -> list[tuple[str, float]]:
    """Bytes per tree at the real depth under three policies, from measured per-layer bytes."""
    found = families.facts(shape.config)
    layers, hidden = list(range(found.num_layers)), found.hidden_size
    rows = []
    for label, policy, io_key in (
            ("default (auto, bf16, recompute)", StoragePolicy(), "bf16"),
            ("all layers, bf16, recompute", StoragePolicy(layers="all"), "bf16"),
            ("all layers, fp32, outputs stored", StoragePolicy(layers="all", dtype="float32",
                                                                output="store"), "fp32")):
        kept = len(policy.resolve(layers, hidden, nodes)["layers"])
        rows.append((label, per_layer["routing"] * len(layers) + per_layer[io_key] * kept))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", default=["tiny-olmoe"],
                   help=f"tiny-olmoe or real shapes: {', '.join(shapes.REAL_SHAPES)}")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args()
    results = {}
    models.quiet_transformers()
    prompts = benchmarks.load("mbpp", limit=args.prompts)
    for name in args.shape:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            if name in shapes.REAL_SHAPES:
                model_dir, draft_dir = real_width_pair(name, tmp / "fixture", layers=1)
                model, draft = str(model_dir), str(draft_dir)
            else:
                model, draft = name, None
            gc.collect()
            plain_s, plain_trees = untraced(model, draft, prompts, args.max_new_tokens)
            base = rss_gib()  # the model and decoder are resident; nothing traced yet
            common = dict(model=model, draft=draft, limit=args.prompts, dtype="float32",
                          max_new_tokens=args.max_new_tokens, device="cpu")
            summary = capture_run(CaptureSettings(**common, store_layers="all"), tmp / "t",
                                  "bf16", progress=False)
            traced_s = summary.seconds - summary.load_seconds
            peak = rss_gib()
            capture_run(CaptureSettings(**common, store_layers="all", hidden_dtype="float32",
                                        store_output="store"), tmp / "f", "fp32", progress=False)
            trees = summary.trees
            bf16, fp32 = captured(tmp / "t"), captured(tmp / "f")
            first = bf16.prompt_indices()[0]
            layers = len(reader.read_parts(bf16, "routing", first, ["layer"]).column(0).unique())
            per_layer = {"routing": table_bytes(bf16, "routing") / trees / layers,
                         "bf16": table_bytes(bf16, "moe_io") / trees / layers,
                         "fp32": table_bytes(fp32, "moe_io") / trees / layers}
            results[name] = dict(prompts=args.prompts, trees=trees, untraced_trees=plain_trees,
                                 tau=summary.tau, traced_s=traced_s, untraced_s=plain_s,
                                 slowdown=traced_s / plain_s, peak_rss_gib=peak,
                                 rss_above_model_gib=max(0.0, peak - base),
                                 bytes_per_tree_layer=per_layer)
            print(f"{name}: {args.prompts} prompts, {trees} trees (untraced {plain_trees}), "
                  f"τ {summary.tau:.2f}")
            print(f"  traced / untraced wall time: {traced_s / plain_s:.3f}x ({traced_s:.1f} s vs "
                  f"{plain_s:.1f} s; goal <= 1.25x)")
            print(f"  capture peak RSS above the model's own: {max(0.0, peak - base):.2f} GiB "
                  f"(process peak {peak:.2f} GiB; goal <= 1 GiB)")
            print(f"  measured per tree and MoE layer: routing {per_layer['routing'] / 1024:.0f} "
                  f"KiB, moe_io bf16 {per_layer['bf16'] / 1024:.0f} KiB, fp32+output "
                  f"{per_layer['fp32'] / 1024:.0f} KiB")
            if name in shapes.REAL_SHAPES:
                shape = shapes.REAL_SHAPES[name]
                per_prompt = trees / args.prompts
                for label, size in projected(shape, per_layer):
                    full = size * per_prompt * MBPP_PROMPTS
                    print(f"  {shape.checkpoint} ({families.facts(shape.config).num_layers} layers), "
                          f"{label}: {size / 2**20:.2f} MiB per tree, MBPP "
                          f"{full / 2**30:.1f} GiB at {per_prompt:.1f} trees per prompt, "
                          f"{math.ceil(size * 36_000 / 2**30)} GiB at 36k trees")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
