"""Closed-loop replay: re-verify captured trees through the whole target under a budget.

Open-loop replay perturbs one layer at a time on captured inputs; a budget in every layer also
changes the downstream hidden states and routing. For each captured tree (T = 0 captures) this
rebuilds the target cache over the committed prefix, verifies the tree once without a budget
(reproducing the captured pass) and once per ranking × coverage × budget with the budget applied
inside every MoE layer (the shortlist from that layer's own tree-token router scores, as MoE-Spec
does at run time), and records

    accepted length under the budget vs captured, whether the accepted path (and bonus token) is
    unchanged, top-1 agreement over the tree's nodes, mean_t KL(p_t ‖ p_t^B) over nodes.

A stateful ranking keeps one state per (task, budget) across the trees of a prompt, as it would
at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from catalog import replay_metrics, schema
from catalog.results import Block, UnitResults
from catalog.runs import CatalogError, Run
from eagle import acceptance, verify
from eagle.tree import DraftTree
from moe.adapter import MoEAdapter
from moe.recorder import VerifyRecorder
from policy.budget import Budget
from policy.calibration import CalibrationStats
from policy.coverage import Coverage
from policy.rankings import Ranking


@dataclass
class ClosedTask:
    unit: UnitResults
    block: Block
    ranking: type[Ranking]
    coverage: Coverage
    calibration: CalibrationStats | None
    budgets: dict[int, Budget] = field(default_factory=dict)

    def budget(self, size: int) -> Budget:
        if size not in self.budgets:
            self.budgets[size] = Budget(size, self.ranking().fit(self.calibration), self.coverage)
        return self.budgets[size]


def check_replayable(run: Run) -> None:
    if run.settings.get("temperature", 0) > 0:
        raise CatalogError(f"closed-loop replay compares greedy acceptance; run {run.name} was "
                           "captured at T > 0 (capture with --temperature 0)")
    if run.settings.get("budget") is not None:
        raise CatalogError(f"run {run.name} was captured under a budget; replay needs a plain "
                           "EAGLE capture")


def _prompt_tables(run: Run, prompt: int):
    def read(table, cols):
        return pq.read_table([str(p) for p in run.parts(table, prompt)], columns=cols)
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
def replay_prompt(run: Run, prompt: int, adapter: MoEAdapter, tasks: list[ClosedTask]) \
        -> dict[int, list[dict]]:
    """Rows of one prompt per task (by position in ``tasks``)."""
    model = adapter.model
    dev = next(model.parameters()).device
    seq, trees, nodes = _prompt_tables(run, prompt)
    by_step = _trees_by_step(nodes, dev)
    committed = seq["prompt_token_ids"] + seq["output_token_ids"]
    cache = verify.new_cache(model)
    cached = 0
    pid = run.manifest["prompt_ids"][prompt - run.settings["offset"]]
    rows: dict[int, list[dict]] = {i: [] for i in range(len(tasks))}
    for task in tasks:
        for b in task.block.budgets:
            task.budget(b).reset()
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
        for i, task in enumerate(tasks):
            for b in task.block.budgets:
                rec = VerifyRecorder(adapter, budget=task.budget(b), record_tensors=False)
                with rec(t["step"], tree, prefix):
                    logits, _ = verify.verify_tree(model, None, cache, tree, prefix)
                verify.compact_cache(cache, prefix, empty)
                got = acceptance.accept_greedy(tree, logits)
                loaded = [r.experts_loaded for r in rec.take()[0][1]]
                rows[i].append(dict(
                    prompt_index=prompt, prompt_id=pid, step=t["step"], ranking=task.ranking.name,
                    coverage=task.coverage.name, budget=b,
                    **tree_metrics(got, ref, captured_path, t["accepted_length"], logits,
                                   ref_logits, ref_logp, loaded)))
    return rows


def tree_metrics(got, ref, captured_path: list[int], captured_accepted: int,
                 logits: torch.Tensor, ref_logits: torch.Tensor, ref_logp: torch.Tensor,
                 loaded: list[int]) -> dict:
    """One tree's closed-loop metrics, one value per metric that
    :data:`catalog.replay_metrics.METRICS` declares for ``replay_closed``, by its name: for the
    acceptance ``got`` under the budget and ``ref`` without it (``path``, ``bonus``), the logits
    under the budget and the unbudgeted ones (and their log-softmax ``ref_logp``):

        accepted_length = |path under B|            captured_accepted_length = τ captured
        path_unchanged  = path = captured path and bonus = unbudgeted bonus
        top1_agreement  = mean_t [argmax p_t^B = argmax p_t]
        mean_kl         = mean_t KL(p_t ‖ p_t^B)     experts_loaded = per MoE layer
    """
    logp = torch.log_softmax(logits.float(), -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return dict(
        accepted_length=len(got.path), captured_accepted_length=captured_accepted,
        path_unchanged=got.path == captured_path and got.bonus == ref.bonus,
        top1_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
        mean_kl=float(kl.mean()), experts_loaded=loaded)


def replay_run(run: Run, adapter: MoEAdapter, tasks: list[ClosedTask], progress,
               prompts: list[int] | None = None, finish: bool = True) -> int:
    """Every pending prompt (or only ``prompts``) of every task; returns the trees
    re-verified. With ``finish`` the tasks' blocks are marked complete afterwards."""
    check_replayable(run)
    done = {i: task.unit.done_prompts(task.block) for i, task in enumerate(tasks)}
    verified = 0
    for prompt in progress(run.prompt_indices() if prompts is None else prompts):
        todo = [i for i in range(len(tasks)) if prompt not in done[i]]
        if not todo:
            continue
        rows = replay_prompt(run, prompt, adapter, [tasks[i] for i in todo])
        for j, i in enumerate(todo):
            tasks[i].unit.write_part(tasks[i].block, prompt, pa.Table.from_pylist(
                rows[j], schema=schema.REPLAY_TABLES[replay_metrics.CLOSED_TABLE]))
        verified += len(rows[0]) // max(1, len(tasks[todo[0]].block.budgets))
    if finish:
        for task in tasks:
            task.unit.finish(task.block)
    return verified
