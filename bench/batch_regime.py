"""Does an expert budget still pay at serving batch sizes? Measured with batched EAGLE.

    python bench/batch_regime.py                                   # tiny-olmoe and tiny-qwen3-moe
    python bench/batch_regime.py --models tiny-olmoe --batch-sizes 1 4 --prompts 8

For each model and batch size b, on the same evaluation prompts (MBPP, seeded):

* **decoding speed**: tokens/s of autoregressive decoding and of EAGLE decoding with b sequences
  per verification pass (:class:`eagle.batched.BatchedDecoder`, continuous batching), plain and
  with an online budget B (router ranking, substitution: the cap is on the union over the whole
  batch's tree tokens); speedup = EAGLE tokens/s ÷ AR tokens/s at the same b.
* **unique experts** per MoE layer per verification pass: the union over the b trees of a pass.
* **RSE at B** for router and coact (calibration: disjoint MBPP prompts) over each pass's union:
  every (pass, layer) is one shortlist for all b·M tree tokens, errors exact from every expert's
  output on the recorded MoE inputs (the definitions of :mod:`replay.open_loop`).

Prints a table per model and writes ``batch_regime.json`` (``--out``). Timings come from this
machine, one run each (noisy on a shared CPU); read ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import torch

from analysis import moesd
from eagle import loading
from eagle.batched import BatchedDecoder, BatchPass
from eagle.decoding import EagleDecoder
from moe.adapter import MoEAdapter
from moe.recorder import VerifyRecorder
from policy import coverage, rankings
from policy.batch import ExpertTerms, RoutingBatch
from policy.budget import Budget
from policy.calibration import CalibrationStats
from replay.open_loop import metrics
from tasks import benchmarks


def prompts(tokenizer, offset: int, count: int, length: int) -> list[list[int]]:
    return [tokenizer(p.text)["input_ids"][:length]
            for p in benchmarks.load("mbpp", offset=offset, limit=count)]


@dataclass
class Decoded:
    tokens_per_s: float
    passes: list  # the recorder's (pass, records)
    timings: list[dict]  # per verification pass: batch (sequences), gamma (tokens each), seconds
    tau: float  # mean tokens added per sequence per pass


def decode(dec: EagleDecoder, ids: list[list[int]], b: int, new_tokens: int, *,
           autoregressive: bool = False, recorder=None) -> Decoded:
    """Decode every prompt b at a time; tokens/s over the whole run (prefill and drafting
    included) and every verification pass's time."""
    if recorder is not None:
        recorder.new_prompt()
    start = time.perf_counter()
    tokens, passes, timings, added, trees = 0, [], [], 0, 0
    for event in BatchedDecoder(dec, b, verify_context=recorder).run(
            enumerate(ids), max_new_tokens=new_tokens, autoregressive=autoregressive):
        finished = event.finished if isinstance(event, BatchPass) else [event]
        tokens += sum(len(g.output_ids) for _, g in finished)
        if isinstance(event, BatchPass) and event.slots:
            timings.append(dict(batch=len(event.slots), gamma=event.tokens_verified //
                                len(event.slots), seconds=event.verify_seconds))
            added += sum(r.accepted_length for r in event.records)
            trees += len(event.records)
            if recorder is not None:
                passes.extend(recorder.take())
    return Decoded(tokens / (time.perf_counter() - start), passes, timings, added / max(1, trees))


def calibration(adapter: MoEAdapter, dec: EagleDecoder, ids: list[list[int]], new_tokens: int):
    """coact's statistics from b = 1 EAGLE passes on other prompts."""
    recorder = VerifyRecorder(adapter)
    passes = decode(dec, ids, 1, new_tokens, recorder=recorder).passes
    layers = (SimpleNamespace(layer=r.layer, probs=r.probs, idx=r.topk_ids, weights=r.topk_weights,
                              hidden=r.hidden.float()) for _, recs in passes for r in recs)
    return CalibrationStats.collect(layers, adapter)


def union_errors(adapter: MoEAdapter, passes: list, ranked: dict, budgets: list[int]) -> dict:
    """Mean RSE over (pass, layer) of each ranking × budget, every pass's b·M tokens one
    shortlist (substitution), and the mean unique experts per layer per pass."""
    sums = {(name, b): 0.0 for name in ranked for b in budgets}
    unique, count = 0.0, 0
    cover = coverage.get("substitution")
    for _, records in passes:
        for r in records:
            layer = adapter.layer(r.layer)
            with torch.no_grad():
                experts = layer.all_expert_outputs(r.hidden, torch.float32)
                shared = layer.shared_output(r.hidden)
            batch = RoutingBatch.single(r.probs.float(), r.topk_ids, r.topk_weights, r.layer,
                                        layer.rule)
            batch.terms = ExpertTerms.from_outputs(
                experts[None].float(), batch.idx, batch.weights,
                None if shared is None else shared[None].float())
            unique += int(batch.union().sum())
            count += 1
            for name, ranking in ranked.items():
                keep, _ = ranking.shortlists(batch, cover, budgets)
                rse = metrics(batch, keep, cover)["rse"][0]
                for j, b in enumerate(budgets):
                    sums[(name, b)] += float(rse[j])
    return dict(unique_experts=unique / max(1, count),
                rse={f"{n}@{b}": s / max(1, count) for (n, b), s in sums.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny-olmoe", "tiny-qwen3-moe"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--budget", type=int, default=16, help="online budget for the speed column")
    p.add_argument("--rse-budgets", nargs="+", type=int, default=[16, 32])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--cal-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, default=Path("batch_regime.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    report = {}
    for model in args.models:
        loaded, head = loading.load_with_draft(model, device="cpu", dtype="float32")
        adapter = MoEAdapter(loaded.model)
        dec = EagleDecoder(loaded.model, head)
        ids = prompts(loaded.tokenizer, 0, args.prompts, args.prompt_tokens)
        stats = calibration(adapter, dec, prompts(loaded.tokenizer, 200, args.cal_prompts,
                                                  args.prompt_tokens), args.new_tokens)
        ranked = {"router": rankings.get("router")().fit(None),
                  "coact": rankings.get("coact")().fit(stats)}
        rows, points = [], []
        for b in args.batch_sizes:
            ar = decode(dec, ids, b, args.new_tokens, autoregressive=True)
            recorder = VerifyRecorder(adapter)
            eagle = decode(dec, ids, b, args.new_tokens, recorder=recorder)
            budgeted = VerifyRecorder(adapter, record_tensors=False, budget=Budget(
                args.budget, rankings.get("router")().fit(None), coverage.get("substitution")))
            eagle_b = decode(dec, ids, b, args.new_tokens, recorder=budgeted)
            points += ar.timings + eagle.timings
            found = union_errors(adapter, eagle.passes, ranked, args.rse_budgets)
            rows.append(dict(batch_size=b, ar_tokens_per_s=ar.tokens_per_s,
                             eagle_tokens_per_s=eagle.tokens_per_s,
                             eagle_budget_tokens_per_s=eagle_b.tokens_per_s,
                             speedup=eagle.tokens_per_s / ar.tokens_per_s,
                             speedup_budget=eagle_b.tokens_per_s / ar.tokens_per_s,
                             tau=eagle.tau, passes=len(eagle.passes), **found))
        # MoESD's pass-time model fitted to the measured verification passes (median per b, γ)
        measured = pl.DataFrame(points).group_by("batch", "gamma").agg(pl.col("seconds").median())
        coef = moesd.fit(measured, adapter.num_experts, adapter.top_k)
        gamma = dec.tree_settings.total_tokens
        for r in rows:  # verification-only speedup the fit predicts: τ · T(b, 1) / T(b, γ)
            t = [coef["c0"] + coef["c1"] * float(moesd_e) + coef["c2"] * r["batch_size"] * g
                 for g, moesd_e in ((1, moesd.moesd_uniform(adapter.num_experts, adapter.top_k,
                                                            np.array([r["batch_size"]]))[0]),
                                    (gamma, moesd.moesd_uniform(
                                        adapter.num_experts, adapter.top_k,
                                        np.array([r["batch_size"] * gamma]))[0]))]
            r["moesd_verify_speedup"] = r["tau"] * t[0] / t[1]
        report[model] = dict(rows=rows, moesd_fit=coef, points=measured.to_dicts())
        n = adapter.num_experts
        print(f"\n{model} ({n} experts, top-{adapter.top_k}); {args.prompts} prompts x "
              f"{args.new_tokens} new tokens; RSE under substitution over each pass's union")
        rse_cols = [f"{r}@{b}" for b in args.rse_budgets for r in ranked]
        print(f"{'b':>3} {'unique/layer':>13} " + " ".join(f"{'RSE ' + c:>14}" for c in rse_cols)
              + f" {'AR tok/s':>9} {'EAGLE tok/s':>11} {'speedup':>8} "
                f"{'speedup B=' + str(args.budget):>13} {'tau':>5} {'MoESD verify-only':>18}")
        for r in rows:
            print(f"{r['batch_size']:>3} {r['unique_experts']:>13.1f} "
                  + " ".join(f"{r['rse'][c]:>14.4f}" for c in rse_cols)
                  + f" {r['ar_tokens_per_s']:>9.1f} {r['eagle_tokens_per_s']:>11.1f} "
                    f"{r['speedup']:>7.2f}x {r['speedup_budget']:>12.2f}x {r['tau']:>5.2f} "
                    f"{r['moesd_verify_speedup']:>17.2f}x")
        print(f"MoESD pass-time fit T = {coef['c0'] * 1e3:.2f} ms + {coef['c1'] * 1e3:.3f} ms x "
              f"E(b*gamma) + {coef['c2'] * 1e3:.4f} ms x b*gamma over {measured.height} (b, gamma)"
              f" points: relative RMSE {coef['relative_rmse']:.1%}")
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
