"""AR vs EAGLE decoding on the same prompts, in one run: tokens/s ratio, τ, experts touched.

    python bench/eagle_vs_ar.py --model tiny-olmoe --bench mbpp gsm8k --prompts 8

For every (model, benchmark) it decodes the same prompts twice through the same loop — once
autoregressively, once with EAGLE trees — at T=0, and reports

* τ: mean accepted length (accepted drafts + bonus per verification pass);
* tokens/s of EAGLE over tokens/s of AR, measured in this run (a ratio, not an absolute time;
  on a CPU a tiny model may well not speed up, and that is reported as is);
* unique experts per MoE layer touched by one verification pass (the tree's tokens) vs by one
  AR step (one token), from hooks on the routers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moe_spec.eagle import loading
from moe_spec.eagle.decoding import EagleDecoder
from moe_spec.eagle.tree import TreeSettings
from moe_spec.moe import models
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.tasks import benchmarks


class ExpertCounter:
    """Unique top-k experts per MoE layer for every forward pass, keyed by its token count."""

    def __init__(self, adapter: MoEAdapter):
        self.adapter = adapter
        self.calls: list[tuple[int, list[int]]] = []  # (tokens, unique experts per layer)
        self._current: list[int] = []
        self._hooks = []

    def __enter__(self):
        def hook(mod, args, out, pos):
            index = out[2]
            if pos == 0:
                self._current = []
            self._current.append(int(torch.unique(index).numel()))
            if pos == len(self.adapter) - 1:
                self.calls.append((index.shape[0], self._current))

        self._hooks = [layer.router.register_forward_hook(
            lambda m, a, o, pos=pos: hook(m, a, o, pos)) for pos, layer in enumerate(self.adapter)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()

    def mean_unique(self, tokens: int) -> float | None:
        rows = [sum(u) / len(u) for t, u in self.calls if t == tokens]
        return sum(rows) / len(rows) if rows else None


def run(model: str, bench: str, prompts: int, max_new: int, tree: TreeSettings, root=None):
    loaded, head = loading.load_with_draft(model)
    dec = EagleDecoder(loaded.model, head, tree=tree)
    adapter = MoEAdapter(loaded.model)
    items = benchmarks.load(bench, root=root, limit=prompts)
    tok = loaded.tokenizer
    dec.generate(tok(items[0].text)["input_ids"], max_new_tokens=8)  # warm-up
    totals = {"ar": [0, 0.0], "eagle": [0, 0.0]}
    taus = []
    with ExpertCounter(adapter) as counter:
        for item in items:
            ids = tok(item.text)["input_ids"]
            for mode in ("ar", "eagle"):
                t0 = time.perf_counter()
                out = dec.generate(ids, max_new_tokens=max_new, eos_token_ids={tok.eos_token_id},
                                   autoregressive=mode == "ar")
                totals[mode][1] += time.perf_counter() - t0
                totals[mode][0] += len(out.output_ids)
                if mode == "eagle":
                    taus.append(out.mean_accepted_length)
    ar_tps = totals["ar"][0] / totals["ar"][1]
    eagle_tps = totals["eagle"][0] / totals["eagle"][1]
    return dict(model=model, bench=bench, prompts=len(items), tau=sum(taus) / len(taus),
                speed_ratio=eagle_tps / ar_tps,
                unique_verify=counter.mean_unique(tree.total_tokens),
                unique_ar=counter.mean_unique(1), experts=adapter.num_experts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=list(models.EMBEDDED))
    p.add_argument("--bench", nargs="+", default=["mbpp", "gsm8k"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--total-tokens", type=int, default=63)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--benchmarks", default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args()
    rows = []
    tree = TreeSettings(args.total_tokens, args.depth, args.top_k)
    print(f"{'model':16} {'bench':8} {'prompts':>7} {'tau':>6} {'EAGLE/AR tok/s':>15} "
          f"{'experts/layer: verify':>22} {'AR step':>8}")
    for model in args.model:
        for bench in args.bench:
            r = run(model, bench, args.prompts, args.max_new_tokens, tree, args.benchmarks)
            rows.append(r)
            print(f"{r['model']:16} {r['bench']:8} {r['prompts']:7d} {r['tau']:6.2f} "
                  f"{r['speed_ratio']:14.2f}x {r['unique_verify']:15.1f} of {r['experts']:<3d} "
                  f"{r['unique_ar']:8.1f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
