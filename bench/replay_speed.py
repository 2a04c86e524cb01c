"""Replay speed and memory, as ratios measured in one run on this machine.

    python bench/replay_speed.py sweep --traces traces --run demo-eval --calibration demo-cal
    python bench/replay_speed.py closed --traces traces --run demo-eval --budgets 8 16 24 32
    python bench/replay_speed.py rss --trees 500 2000
    python bench/replay_speed.py width --shape olmoe

``sweep``: the full open-loop sweep (static, router, oracle, coact × truncation and substitution
× the paper's budgets) through the engine, vs one all-experts recompute of the same tree-layers
(goal ≤ 3×); the same without the oracle; and ``replay --ranking oracle --budget 24`` vs the
capture's decoding time of the same prompts (Σ ``sequences.wall_seconds``; goal ≤ 2×). Model
loading is excluded on both sides.

``closed``: closed-loop re-verification of the run's trees under ``--rankings`` × both coverages
× ``--budgets`` (model loaded, start-up excluded) vs the capture's own verification of the same
trees, ``median(trees.verify_seconds) × trees × cells`` (goal ≤ 2×).

``rss``: peak RSS of ``replay --ranking oracle --budget 24`` (a fresh process each) on synthetic
runs of N trees × 8 layers of tiny-olmoe (goal ≤ 2 GiB, flat in N).

``width``: tree-layers/s of ``replay --ranking router oracle --budget 24`` and of the full sweep
on a synthetic run with a random-weight model of a real shape (one MoE layer, real widths, a
synthetic calibration run for static and coact), vs tiny-olmoe.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

from moe_spec.catalog import Catalog, location, reader
from moe_spec.moe import models, shapes
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.replay.run import ReplayRequest, calibration_stats, parse_budgets, replay

ROOT = Path(__file__).resolve().parent.parent


def recompute_seconds(items, adapter) -> float:
    """One all-experts recompute of the tree-layers ``items``, one call per tree-layer (round
    1's baseline) and per batch of 64 tree-layers of a layer (the engine's); the faster one."""
    param = next(adapter.model.parameters())
    hidden = [torch.from_numpy(tl.hidden).to(param.device, param.dtype) for tl in items]
    with torch.no_grad():
        t0 = time.perf_counter()
        for tl, h in zip(items, hidden):
            adapter.layer(tl.layer).all_expert_outputs(h)
        single = time.perf_counter() - t0
        t0 = time.perf_counter()
        for layer in adapter:
            hs = [h for tl, h in zip(items, hidden) if tl.layer == layer.index]
            for i in range(0, len(hs), 64):
                layer.all_expert_outputs(torch.cat(hs[i:i + 64]))
        batched = time.perf_counter() - t0
    return min(single, batched)


def gram_seconds(items, adapter) -> float:
    """The float64 Gram ``Q_t = E_t E_tᵀ`` of every tree-layer (what the exact substitution oracle
    needs, however it is organised), in batches of 64 tree-layers: a floor under the full sweep."""
    param = next(adapter.model.parameters())
    with torch.no_grad():
        outs = [adapter.layer(tl.layer).all_expert_outputs(
            torch.from_numpy(tl.hidden).to(param.device, param.dtype), torch.float32)
            for tl in items]
        t0 = time.perf_counter()
        for i in range(0, len(outs), 64):
            e = torch.cat(outs[i:i + 64]).double()  # [tokens, N, H]
            torch.bmm(e, e.transpose(1, 2))
        return time.perf_counter() - t0


def timed_replay(cat, runs, adapter, rankings, budgets, stats, cal, device,
                 mode: str = "open") -> tuple[float, int]:
    out = Path(tempfile.mkdtemp(prefix="replay-bench-"))
    try:
        request = ReplayRequest(tuple(rankings), ("truncation", "substitution"), tuple(budgets),
                                mode=mode)
        t0 = time.perf_counter()
        outcome = replay(cat, runs, adapter, request, stats, cal, out, device=device,
                         progress=False)
        return time.perf_counter() - t0, outcome.tree_layers or outcome.trees
    finally:
        shutil.rmtree(out)


def loaded_run(args):
    """(catalog, [the run], the loaded model, its MoE adapter) for ``--traces``/``--run``."""
    torch.set_num_threads(args.threads)
    cat = Catalog(args.traces)
    runs = cat.runs(names=[args.run])
    loaded = models.load(runs[0].model, device=args.device)
    return cat, runs, loaded, MoEAdapter(loaded.model)


def sweep(args) -> dict:
    cat, runs, loaded, adapter = loaded_run(args)
    stats, cal = calibration_stats(cat, [args.calibration], runs[0].model, runs, adapter, False,
                                   rankings_used=("static", "router", "oracle", "coact"))
    budgets = parse_budgets("sweep", adapter.num_experts)
    items = list(reader.tree_layers(runs))  # read once, for both reference timings
    base = recompute_seconds(items, adapter)
    print(f"{runs[0].model}, run {args.run}: {len(items)} tree-layers, {args.threads} torch "
          "threads")
    print(f"  one all-experts recompute: {base:.3f} s")
    found = dict(model=runs[0].model, tree_layers=len(items), recompute_s=base)
    gram = gram_seconds(items, adapter)
    print(f"  float64 Gram of every tree-layer alone (the substitution oracle's floor): "
          f"{gram:.3f} s = {gram / base:.2f}x the recompute")
    found["gram_s"] = gram
    for key, label, ranks in (("full_sweep", "full sweep (static router oracle coact)",
                               ["static", "router", "oracle", "coact"]),
                              ("sweep_without_oracle",
                               "sweep without the oracle (static router coact)",
                               ["static", "router", "coact"])):
        sec, tl = timed_replay(cat, runs, adapter, ranks, budgets, stats, cal, loaded.device)
        found[key] = dict(seconds=sec, tree_layers=tl, budgets=budgets)
        print(f"  {label} × 2 policies × {len(budgets)} budgets: {sec:.3f} s = "
              f"{sec / base:.2f}x the recompute ({tl / sec:.0f} tree-layers/s)")
    decode = sum(location.read_table(runs[0].files("sequences"), columns=["wall_seconds"])
                 ["wall_seconds"].to_pylist())
    sec = found["full_sweep"]["seconds"]
    print(f"  full sweep vs capture decoding the same prompts {decode:.3f} s = {sec / decode:.2f}x")
    found["full_sweep"]["capture_decode_s"] = decode
    sec, tl = timed_replay(cat, runs, adapter, ["oracle"], [24], None, [], loaded.device)
    print(f"  replay --ranking oracle --budget 24 (both policies): {sec:.3f} s "
          f"({tl / sec:.0f} tree-layers/s) vs capture decoding the same prompts {decode:.3f} s "
          f"= {sec / decode:.2f}x")
    found["oracle_24"] = dict(seconds=sec, tree_layers=tl, capture_decode_s=decode)
    return found


def closed(args) -> dict:
    cat, runs, loaded, adapter = loaded_run(args)
    verify_s = location.read_table(runs[0].files("trees"), columns=["verify_seconds"])[
        "verify_seconds"].to_numpy()
    cells = len(args.rankings) * 2 * len(args.budgets)
    sec, trees = timed_replay(cat, runs, adapter, args.rankings, args.budgets, None, [],
                              loaded.device, mode="closed")
    base = float(np.median(verify_s)) * len(verify_s) * cells
    print(f"{runs[0].model}, run {args.run}: {len(verify_s)} trees × {cells} cells "
          f"({' '.join(args.rankings)} × 2 policies × budgets {args.budgets}), "
          f"{args.threads} torch threads")
    print(f"  closed-loop re-verification {sec:.2f} s vs the capture's verification of the same "
          f"trees (median {np.median(verify_s) * 1e3:.1f} ms × trees × cells) {base:.2f} s = "
          f"{sec / base:.2f}x")
    return dict(model=runs[0].model, trees=len(verify_s), cells=cells, seconds=sec,
                captured_verify_s=base, ratio=sec / base)


def rss(args) -> dict:
    found = {}
    for trees in args.trees:
        root = Path(tempfile.mkdtemp(prefix="replay-rss-"))
        per_prompt = min(50, trees)  # 50 trees a prompt (fewer trees: one prompt)
        try:
            code = ("from moe_spec.bench.synthetic import write_run; "
                    "from moe_spec.moe import models; from pathlib import Path; "
                    "m = models.load('tiny-olmoe', device='cpu').model; "
                    f"write_run(Path('{root}'), 'tiny-olmoe', m, prompts={trees // per_prompt}, "
                    f"trees_per_prompt={per_prompt})")
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
            gen = time.perf_counter() - t0
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "moe_spec.replay.cli", "--traces", str(root),
                            "--ranking", "oracle", "--budget", "24", "--no-progress"],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            sec = time.perf_counter() - t0
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            note = "" if peak > before else " (not above an earlier child's peak)"
            size = sum(p.stat().st_size for p in root.rglob("*.parquet")) / 2**30
            print(f"  {trees} trees × 8 layers ({trees * 8} tree-layers, {size:.2f} GiB of "
                  f"traces, generated in {gen:.0f} s): replay {sec:.0f} s "
                  f"({trees * 8 / sec:.0f} tree-layers/s incl. start-up), peak RSS "
                  f"{peak / 2**20:.2f} GiB{note}")
            found[str(trees)] = dict(tree_layers=trees * 8, traces_gib=size, replay_s=sec,
                                     peak_rss_gib=peak / 2**20, above_earlier_peak=not note)
        finally:
            shutil.rmtree(root)
    return found


def width(args) -> dict:
    from moe_spec.bench.synthetic import write_run
    torch.set_num_threads(args.threads)
    found = {}
    for name in ("tiny-olmoe", args.shape):
        root = Path(tempfile.mkdtemp(prefix="replay-width-"))
        try:
            if name.startswith("tiny-"):
                model_path, model = name, models.load(name, device="cpu").model
            else:
                model_path = str(shapes.save_random_model(args.shape, root / "model"))
                model = models.load(model_path, device="cpu").model
            write_run(root / "traces", model_path, model, prompts=2,
                      trees_per_prompt=args.trees // 2)
            write_run(root / "traces", model_path, model, prompts=2,
                      trees_per_prompt=args.trees // 2, run="cal", bench="synthetic-cal",
                      seed=1, role="calibration")
            cat = Catalog(root / "traces")
            adapter = MoEAdapter(model)
            runs = cat.runs(names=["synthetic"])
            items = list(reader.tree_layers(runs))
            base, n = recompute_seconds(items, adapter), len(items)
            head = (f"  {name} (hidden {adapter.facts.hidden_size}, {adapter.num_experts} "
                    f"experts, top-{adapter.top_k}): {n} tree-layers,")
            sec, tl = timed_replay(cat, runs, adapter, ["router", "oracle"], [24], None, [],
                                   torch.device("cpu"))
            found[name] = dict(tree_layers=n, recompute_s=base,
                               router_oracle_24=dict(seconds=sec, tree_layers=tl))
            print(f"{head} router+oracle@24 both policies {tl / sec:.1f} tree-layers/s = "
                  f"{sec / base:.2f}x one all-experts recompute")
            stats, cal = calibration_stats(cat, ["cal"], model_path, runs, adapter, False,
                                           rankings_used=("static", "router", "oracle", "coact"))
            budgets = parse_budgets("sweep", adapter.num_experts)
            sec, tl = timed_replay(cat, runs, adapter, ["static", "router", "oracle", "coact"],
                                   budgets, stats, cal, torch.device("cpu"))
            found[name]["full_sweep"] = dict(seconds=sec, tree_layers=tl, budgets=budgets)
            print(f"{head} full sweep (static router oracle coact × 2 policies × "
                  f"{len(budgets)} budgets) {tl / sec:.1f} tree-layers/s = {sec / base:.2f}x "
                  f"one all-experts recompute")
            del model, adapter
        finally:
            shutil.rmtree(root)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--traces", type=Path, default=Path("traces"))
    s.add_argument("--run", default="demo-eval")
    s.add_argument("--calibration", default="demo-cal")
    s.add_argument("--device", default="cpu")
    s.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("closed")
    c.add_argument("--traces", type=Path, default=Path("traces"))
    c.add_argument("--run", default="demo-eval")
    c.add_argument("--rankings", nargs="+", default=["router"])
    c.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 24, 32])
    c.add_argument("--device", default="cpu")
    c.add_argument("--threads", type=int, default=2)
    r = sub.add_parser("rss")
    r.add_argument("--trees", type=int, nargs="+", default=[500, 2000])
    w = sub.add_parser("width")
    w.add_argument("--shape", default="olmoe", choices=list(shapes.REAL_SHAPES))
    w.add_argument("--trees", type=int, default=8)
    w.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    models.quiet_transformers()
    found = {"sweep": sweep, "closed": closed, "rss": rss, "width": width}[args.what](args)
    if args.out:
        args.out.write_text(json.dumps({args.what: found}, indent=1))


if __name__ == "__main__":
    pl.Config.set_tbl_hide_dataframe_shape(True)
    main()
