"""Replay cost, as ratios measured in one run on the same captured trees.

    python bench/replay_speed.py --traces traces --run RUN [--calibration CAL]

1. Full open-loop sweep (static, router, oracle, coact × truncation and substitution × the
   budget sweep) vs one all-experts recompute of the same tree-layers (goal ≤ 3×).
2. Router-ranking selection (scores, shortlist, substitution routing) for all MoE layers of a
   tree vs the verification forward it would precede (the captured ``verify_seconds``; goal ≤ 3%).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from capture import models
from capture.moe_adapter import MoEAdapter
from replay import budget as budgets
from replay import rankings
from replay.data import find_runs, iter_tree_layers
from replay.run import ReplaySettings, calibrate, open_loop_rows, parse_budgets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces"))
    p.add_argument("--run", required=True)
    p.add_argument("--calibration", default=None, help="run for static/coact (else router+oracle)")
    args = p.parse_args()
    run = find_runs(args.traces, runs=[args.run])[0]
    loaded = models.load(run.model)
    adapter = MoEAdapter(loaded.model)
    stats = calibrate(find_runs(args.traces, runs=[args.calibration]), adapter) \
        if args.calibration else None
    ranks = ("static", "router", "oracle", "coact") if stats else ("router", "oracle")
    settings = ReplaySettings(ranks, ("truncation", "substitution"),
                              tuple(parse_budgets("sweep", adapter.num_experts)))
    items = [tl for prompt in run.prompt_indices() for tl in iter_tree_layers(run, prompt)]
    hidden_dtype = run.manifest["settings"]["hidden_dtype"]

    t0 = time.perf_counter()
    with torch.no_grad():
        for tl in items:
            adapter.layer(tl.layer).all_expert_outputs(tl.hidden)
    recompute = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = sum(len(open_loop_rows(tl, adapter.layer(tl.layer), settings, stats, hidden_dtype,
                                  run.name)) for tl in items)
    sweep = time.perf_counter() - t0
    print(f"{len(items)} tree-layers, {rows} result rows ({', '.join(ranks)} x 2 policies x "
          f"{len(settings.budgets)} budgets)")
    print(f"full sweep / one all-experts recompute: {sweep / recompute:.2f}x (goal <= 3x)")

    # selection vs the verification forward, both timed here on the first prompt's trees
    from transformers import DynamicCache

    from capture.eagle import verify
    from replay.closed_loop import _prompt_tables, _trees_by_step
    prompt = run.prompt_indices()[0]
    seq, trees, nodes = _prompt_tables(run, prompt)
    by_step = _trees_by_step(nodes, loaded.device)
    layers = {}
    for tl in items:
        if tl.prompt_index == prompt:
            layers.setdefault(tl.step, []).append(tl)
    committed = seq["prompt_token_ids"] + seq["output_token_ids"]
    cache, cached, sel, ver = DynamicCache(config=loaded.model.config), 0, 0.0, 0.0
    budget = 32 if adapter.num_experts >= 32 else adapter.top_k
    with torch.no_grad():
        for t in trees:
            if t["prefix_len"] > cached:
                verify.forward_tokens(loaded.model, None, cache, torch.tensor(
                    committed[cached:t["prefix_len"]], device=loaded.device), cached)
                cached = t["prefix_len"]
            t0 = time.perf_counter()
            verify.verify_tree(loaded.model, None, cache, by_step[t["step"]][0], cached)
            ver += time.perf_counter() - t0
            verify.compact_cache(cache, cached, torch.zeros(0, dtype=torch.long))
            t0 = time.perf_counter()
            for tl in layers[t["step"]]:
                order = rankings.runtime_order("router", tl.probs, tl.idx, tl.weights, tl.layer,
                                               None)
                keep = rankings.keep_mask(order, budget, adapter.num_experts)
                budgets.apply(tl.probs, tl.idx, tl.weights, keep, "substitution",
                              adapter.renormalize)
            sel += time.perf_counter() - t0
    print(f"router selection (B={budget}, all layers) / verify forward: {sel / ver:.1%} over "
          f"{len(trees)} trees (goal <= 3%)")

if __name__ == "__main__":
    main()
