"""Closed-loop replay: re-verify captured trees through the whole target under a budget.

Open-loop replay perturbs one layer at a time on captured inputs; a budget in every layer also
changes the downstream hidden states and routing. For each captured tree (T = 0 captures) this
rebuilds the target cache over the committed prefix, verifies the tree once without a budget
(reproducing the captured pass) and once per runtime ranking × coverage × budget with the budget
applied inside every MoE layer (the shortlist from that layer's own tree-token router
probabilities, as MoE-Spec does at run time), and records

    accepted length under the budget vs captured, whether the accepted path (and bonus token) is
    unchanged, top-1 agreement over the tree's nodes, mean_t KL(p_t ‖ p_t^B) over nodes.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import torch
from transformers import DynamicCache

from capture.eagle import acceptance, verify
from capture.eagle.tree import DraftTree
from capture.moe_adapter import MoEAdapter
from capture.recorder import BudgetSettings, VerifyRecorder
from replay import rankings
from replay.data import CapturedRun, ReplayError


def _prompt_tables(run: CapturedRun, prompt: int):
    read = lambda t, cols: pq.read_table(  # noqa: E731
        [str(p) for p in sorted(run.dirs[t].glob(f"part-{prompt:06d}-*.parquet"))], columns=cols)
    seq = read("sequences", ["prompt_token_ids", "output_token_ids"]).to_pylist()[0]
    trees = read("trees", ["step", "prefix_len", "accepted_length"]).sort_by("step").to_pylist()
    nodes = read("nodes", ["step", "node", "parent", "depth", "token_id", "draft_logprob",
                           "accepted"]).sort_by([("step", "ascending"), ("node", "ascending")])
    return seq, trees, nodes.to_pydict()


def _trees_by_step(nodes: dict, device) -> dict[int, tuple[DraftTree, list[int]]]:
    out, steps = {}, nodes["step"]
    lo = 0
    while lo < len(steps):
        hi = lo
        while hi < len(steps) and steps[hi] == steps[lo]:
            hi += 1
        col = lambda c: torch.tensor(nodes[c][lo:hi], device=device)  # noqa: E731
        tree = DraftTree(col("token_id"), col("parent").long(), col("depth").long(),
                         col("draft_logprob").float())
        path = sorted((j for j in range(hi - lo) if nodes["accepted"][lo + j]),
                      key=lambda j: nodes["depth"][lo + j])
        out[steps[lo]] = (tree, path)
        lo = hi
    return out


@torch.no_grad()
def closed_loop_rows(run: CapturedRun, prompt: int, adapter: MoEAdapter, settings, stats) -> list:
    if run.manifest["settings"].get("temperature", 0) > 0:
        raise ReplayError(f"closed-loop replay compares greedy acceptance; run {run.name} was "
                          "captured at T > 0 (capture with --temperature 0)")
    if run.manifest["settings"].get("budget") is not None:
        raise ReplayError(f"run {run.name} was captured under a budget; replay needs a plain "
                          "EAGLE capture")
    model = adapter.model
    dev = next(model.parameters()).device
    seq, trees, nodes = _prompt_tables(run, prompt)
    by_step = _trees_by_step(nodes, dev)
    committed = seq["prompt_token_ids"] + seq["output_token_ids"]
    cache = DynamicCache(config=model.config)
    cached = 0
    pid = run.manifest["prompt_ids"][prompt - run.manifest["settings"]["offset"]]
    rows = []
    combos = [(r, c, b) for r in settings.rankings if r in rankings.RUNTIME
              for c in settings.coverages for b in settings.budgets
              if not (c == "substitution" and b < adapter.top_k)]
    for t in trees:
        prefix = t["prefix_len"]
        if prefix > cached:
            verify.forward_tokens(model, None, cache, torch.tensor(committed[cached:prefix],
                                                                   device=dev), cached)
            cached = prefix
        tree, captured_path = by_step[t["step"]]
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        ref_logits, _ = verify.verify_tree(model, None, cache, tree, prefix)
        verify.compact_cache(cache, prefix, empty)
        ref = acceptance.accept_greedy(tree, ref_logits)
        ref_logp = torch.log_softmax(ref_logits.float(), -1)
        for ranking, coverage, budget in combos:
            rec = VerifyRecorder(adapter, budget=BudgetSettings(budget, ranking, coverage, stats),
                                 record_tensors=False)
            with rec(t["step"], tree, prefix):
                logits, _ = verify.verify_tree(model, None, cache, tree, prefix)
            verify.compact_cache(cache, prefix, empty)
            got = acceptance.accept_greedy(tree, logits)
            logp = torch.log_softmax(logits.float(), -1)
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
            loaded = [r.experts_loaded for r in rec.take()[0][1]]
            rows.append(dict(prompt_index=prompt, prompt_id=pid, step=t["step"], ranking=ranking,
                             coverage=coverage, budget=budget, accepted_length=len(got.path),
                             captured_accepted_length=t["accepted_length"],
                             path_unchanged=got.path == captured_path and got.bonus == ref.bonus,
                             top1_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1))
                                                  .float().mean()),
                             mean_kl=float(kl.mean()), experts_loaded=loaded))
    return rows
