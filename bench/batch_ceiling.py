"""How much can batching speed up capture on this device? The capture's gain beside its ceiling.

    python bench/batch_ceiling.py                              # tiny-olmoe, b = 1 and 8
    python bench/batch_ceiling.py --model tiny-qwen3-moe --batch-sizes 1 4 8 --prompts 8

Two measurements, one run each (ratios, not absolute figures, on a shared machine):

* **capture**: ``capture --batch-size b`` of the same MBPP prompts (T = 0, so every b decodes the
  same tokens); decoding tokens/s = accepted tokens ÷ (wall − model loading), and its ratio to
  the first b;
* **the ceiling**: the target's forward alone, loaded as capture loads it (transformers' eager
  experts loop), on ``[b, M]`` tree-sized inputs (M = 64 tokens per sequence, the default tree);
  tokens/s ratio to the first b. A batched pass still computes every sequence's tokens, so where
  the forward's cost grows with its tokens (compute-bound, as a CPU is) batching can only
  amortise the fixed per-forward cost (Python, kernel launches, the experts loop's per-expert
  overhead): the verification forward cannot gain more than this ratio, and capture, which also
  prefills, drafts and records per token, gains less. On a GPU the forward of a few hundred
  tokens is launch- and memory-bound and the ceiling is far higher; run this there to see it.

Prints a table and writes ``batch_ceiling.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
import time
from pathlib import Path

from moe_spec.bench import pipeline
from moe_spec.moe import families

TREE_TOKENS = 64  # tokens per sequence of the ceiling's forward (the default EAGLE tree's size)


def capture_speed(traces: Path, model: str, batch_size: int, prompts: int, new_tokens: int
                  ) -> dict:
    """Decoding tokens/s of ``capture --batch-size b`` (loading excluded)."""
    summary = pipeline.capture(traces, f"b{batch_size}", model=model, bench="mbpp",
                               limit=prompts, max_new_tokens=new_tokens, batch_size=batch_size)
    decoding = summary.seconds - summary.load_seconds
    tokens = summary.trees * summary.tau
    return dict(trees=summary.trees, tokens=tokens, decoding_seconds=decoding,
                tokens_per_s=tokens / max(decoding, 1e-9))


def forward_speed(model: str, batch_size: int, repeats: int) -> dict:
    """Tokens/s of the target's forward on ``[b, TREE_TOKENS]`` random token ids (best of
    ``repeats`` after one warm-up)."""
    import torch
    loaded, _ = pipeline.loaded_model(model)
    net = loaded.model
    ids = torch.randint(0, families.facts(net.config).vocab, (batch_size, TREE_TOKENS),
                        generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.no_grad():
        net(input_ids=ids)
        for _ in range(repeats):
            start = time.perf_counter()
            net(input_ids=ids)
            best = min(best, time.perf_counter() - start)
    return dict(forward_ms=best * 1e3, tokens_per_s=batch_size * TREE_TOKENS / best)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-olmoe")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per b (best kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, default=Path("batch_ceiling.json"))
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    traces = Path(tempfile.mkdtemp(prefix="batch-ceiling-"))
    atexit.register(shutil.rmtree, traces, ignore_errors=True)  # a scratch folder, however it ends
    rows = []
    for b in args.batch_sizes:
        rows.append(dict(batch_size=b, capture=capture_speed(traces, args.model, b, args.prompts,
                                                             args.new_tokens),
                         forward=forward_speed(args.model, b, args.repeats)))
    first = rows[0]
    for r in rows:
        r["capture_ratio"] = r["capture"]["tokens_per_s"] / first["capture"]["tokens_per_s"]
        r["ceiling_ratio"] = r["forward"]["tokens_per_s"] / first["forward"]["tokens_per_s"]
    print(f"{args.model}: {args.prompts} MBPP prompts x {args.new_tokens} new tokens, "
          f"{args.threads} thread(s); ratios to b = {first['batch_size']}")
    print(f"{'b':>3} {'capture tok/s':>14} {'capture ratio':>14} {'forward ms [b,64]':>18} "
          f"{'ceiling ratio':>14}")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['capture']['tokens_per_s']:>14.1f} "
              f"{r['capture_ratio']:>13.2f}x {r['forward']['forward_ms']:>18.1f} "
              f"{r['ceiling_ratio']:>13.2f}x")
    args.out.write_text(json.dumps(dict(model=args.model, threads=args.threads, rows=rows),
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
