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

from moe import models
from moe.adapter import MoEAdapter
from replay import budget as budgets
from replay import rankings
from replay.data import find_runs, iter_tree_layers
from replay.run import ReplaySettings, calibrate, open_loop_rows, parse_budgets


def olmoe_sized(items, settings, stats, renormalize) -> None:
    """The same sweep on the same routing, with one OLMoE-1B-7B-sized expert layer (N=64,
    H=2048, I=1024, random weights): the recompute grows with the experts, the sweep barely."""
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    from moe.adapter import MoELayer
    from replay.data import TreeLayerData
    torch.manual_seed(0)
    block = OlmoeSparseMoeBlock(OlmoeConfig(hidden_size=2048, intermediate_size=1024,
                                            num_experts=64, num_experts_per_tok=8))
    for p_ in block.parameters():
        torch.nn.init.normal_(p_, std=0.02)
    layer = MoELayer(0, block, block.gate, block.experts, 64, 8, renormalize)
    big = []
    with torch.no_grad():
        for tl in items:
            h = torch.randn(tl.probs.shape[0], 2048)
            out = layer.moe_output(h, tl.idx, tl.weights)
            big.append(TreeLayerData(tl.prompt_index, tl.prompt_id, tl.step, tl.layer, tl.probs,
                                     tl.idx, tl.weights, h, out))
        t0 = time.perf_counter()
        for tl in big:
            layer.all_expert_outputs(tl.hidden)
        recompute = time.perf_counter() - t0
    t0 = time.perf_counter()
    for tl in big:
        open_loop_rows(tl, layer, settings, stats, "float32", "olmoe-sized")
    sweep = time.perf_counter() - t0
    print(f"  same sweep at OLMoE-1B-7B expert size ({len(big)} tree-layers): "
          f"{sweep / recompute:.2f}x one all-experts recompute")


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
    rows = sum(len(b["budget"]) for tl in items for b in open_loop_rows(
        tl, adapter.layer(tl.layer), settings, stats, hidden_dtype, run.name))
    sweep = time.perf_counter() - t0
    print(f"{len(items)} tree-layers, {rows} result rows ({', '.join(ranks)} x 2 policies x "
          f"{len(settings.budgets)} budgets)")
    print(f"full sweep / one all-experts recompute: {sweep / recompute:.2f}x (goal <= 3x)")
    olmoe_sized(items[:16], settings, stats, adapter.renormalize)

    # selection vs the verification forward, both timed here on the first prompt's trees
    from transformers import DynamicCache

    from eagle import verify
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
