"""Traced vs untraced EAGLE decoding, same prompts, one run (goal: ≤ 1.25×).

    python bench/capture_overhead.py --model tiny-olmoe --bench mbpp --prompts 8

*untraced*: the decoder alone. *traced*: the full capture (hooks on every MoE layer during
verification passes, tensors to Arrow, Parquet parts written atomically) into a temporary folder.
Prints the wall-time ratio, bytes per tree and the peak resident memory of this process.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from capture.run import CaptureSettings, capture_run
from eagle import loading
from eagle.decoding import EagleDecoder
from moe import models
from tasks import benchmarks


def untraced(settings: CaptureSettings) -> tuple[float, int]:
    loaded, head = loading.load_with_draft(settings.model)
    dec = EagleDecoder(loaded.model, head)
    tok = loaded.tokenizer
    prompts = benchmarks.load(settings.bench, limit=settings.limit)
    t0 = time.perf_counter()
    trees = 0
    for i, p in enumerate(prompts):
        gen = dec.generate(tok(p.text)["input_ids"], max_new_tokens=settings.max_new_tokens,
                           eos_token_ids={tok.eos_token_id}, seed=settings.seed + i)
        trees += len(gen.steps)
    return time.perf_counter() - t0, trees


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--bench", default="mbpp")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--hidden-dtype", default="float32", choices=("float16", "float32"))
    args = p.parse_args()
    settings = CaptureSettings(model=args.model, bench=args.bench, limit=args.prompts,
                               max_new_tokens=args.max_new_tokens, hidden_dtype=args.hidden_dtype)
    untraced(CaptureSettings(model=args.model, bench=args.bench, limit=1, max_new_tokens=8))
    plain_s, plain_trees = untraced(settings)
    with tempfile.TemporaryDirectory() as tmp:
        summary = capture_run(settings, Path(tmp), "bench", progress=False)
    # capture_run's wall time includes loading the model; time the decode+write part alone
    traced_s = summary.seconds - summary.load_seconds
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.model} / {args.bench}: {args.prompts} prompts, {summary.trees} trees "
          f"(untraced {plain_trees}), tau {summary.tau:.2f}")
    print(f"traced / untraced wall time: {traced_s / plain_s:.3f}x "
          f"(goal <= 1.25x; {traced_s:.1f} s vs {plain_s:.1f} s in this run)")
    print(f"bytes per tree: {summary.bytes_written / summary.trees / 1024:.0f} KiB "
          f"({args.hidden_dtype} hidden states); peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
