"""Closed-loop replay: re-verify captured trees through the whole target under a budget.

Open-loop replay perturbs one layer at a time on captured inputs; a budget in every layer also
changes the downstream hidden states and routing. For each captured tree (T = 0 captures) this
rebuilds the target cache over the committed prefix, verifies the tree once without a budget
(reproducing the captured pass) and under every ranking × coverage × budget with the budget
applied inside every MoE layer (the shortlist from that layer's own tree-token router scores, as
MoE-Spec does at run time), and records

    accepted length under the budget vs captured, whether the accepted path (and bonus token) is
    unchanged, top-1 agreement over the tree's nodes, mean_t KL(p_t ‖ p_t^B) over nodes.

**Over batches** (``replay --mode closed --batch-size b``, table ``replay_closed_batch``): the
trees of one (virtual or real) verification pass (:mod:`replay.virtual_batch`) are re-verified
together in ONE batched target forward (:func:`eagle.batched.verify_batch`: each tree over its
own prompt's cache row, with its own tree mask and positions). The MoE hooks then see all
``Σ M_i`` tree tokens of the pass in one call per layer, so each layer's shortlist is ranked on
the router scores of every tree token of the pass, exactly as capture's online budget does
(``capture --batch-size b --budget B``, the same :class:`moe.recorder.VerifyRecorder`):

    S_l = shortlist_B( {g_t : t ∈ trees of the pass} )       one per (pass, layer)

MoE tokens interact only through S_l, so each tree's metrics are computed from its own rows of
the batched logits, as at b = 1; ``experts_loaded`` is then the pass's (the union every tree of
the pass shares). Each tree's cache over its committed prefix is built alone, without a budget
(the captured tokens), as at b = 1. b = 1 is the same code with one tree per pass (``ClosedLoop``:
each prompt a group of its own, a pass its step), bit for bit the per-tree replay.

**Cells batched.** A pass is re-verified under all its (ranking × coverage × budget) cells in
as few forwards as fit: its trees repeated once per cell (at most :data:`TREES_PER_FORWARD`
trees a forward, the cache rows repeated with them), and in every MoE call each cell's block of
tokens routed by its own budget alone (:class:`policy.budget.BudgetGroups`), so a cell's
shortlists are exactly those of a forward of its own. Only float rounding differs from one
forward per cell (a batched matmul may sum in another order: KL within ~1e-6 relative, the
discrete metrics equal in the tests).

A stateful ranking keeps one state per (task, budget) across the passes of a group (a prompt at
b = 1, a batch at b > 1), reset before each group, as it would at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import torch

from moe_spec.catalog import location, schema
from moe_spec.catalog.results import Block, UnitResults
from moe_spec.catalog.runs import CatalogError, Run
from moe_spec.eagle import acceptance, batched, verify
from moe_spec.eagle.tree import DraftTree
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.moe.recorder import VerifyRecorder
from moe_spec.policy import index
from moe_spec.policy.budget import AdaptiveBudget, Budget, BudgetGroups
from moe_spec.policy.calibration import CalibrationStats
from moe_spec.policy.coverage import Coverage
from moe_spec.policy.prices import Prices
from moe_spec.policy.rankings import Ranking

TREES_PER_FORWARD = 32  # a pass is re-verified under several (ranking, budget) cells at once:
# its trees repeated once per cell in one batched forward (policy.budget.BudgetGroups), at most
# this many trees per forward (the cache is repeated too)


@dataclass
class ClosedTask:
    unit: UnitResults
    block: Block
    ranking: type[Ranking]
    coverage: Coverage
    calibration: CalibrationStats | None
    budgets: dict[int, Budget] = field(default_factory=dict)
    budget_mode: str = index.FIXED  # every row's budget_mode (policy.index.budget_mode)
    prices: Prices | None = None  # adaptive: the calibrated price rule; budgets are means B̄

    def budget(self, size: int) -> Budget:
        if size not in self.budgets:
            ranking = self.ranking().fit(self.calibration)
            self.budgets[size] = Budget(size, ranking, self.coverage) if self.prices is None \
                else AdaptiveBudget(size, ranking, self.coverage, prices=self.prices)
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
        return location.read_table(run.parts(table, prompt), columns=cols)
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


class PromptState:
    """One prompt of a group: its captured trees, and the target's cache over its committed
    tokens, extended (without a budget) up to each tree's prefix as its passes come."""

    def __init__(self, run: Run, prompt: int, device):
        seq, self.trees, nodes = _prompt_tables(run, prompt)
        self.index = prompt
        self.id = run.manifest["prompt_ids"][prompt - run.settings["offset"]]
        self.by_step = _trees_by_step(nodes, device)
        self.committed = seq["prompt_token_ids"] + seq["output_token_ids"]
        self.device = device
        self.cache, self.cached = None, 0

    def cache_at(self, model, prefix: int):
        """The cache over the first ``prefix`` committed tokens."""
        if self.cache is None:
            self.cache = verify.new_cache(model)
        if prefix > self.cached:
            verify.forward_tokens(model, None, self.cache, torch.tensor(
                self.committed[self.cached:prefix], device=self.device), self.cached)
            self.cached = prefix
        return self.cache


def passes(states: list[PromptState], pass_of: Callable[[int, int], int]) \
        -> list[tuple[int, list[tuple[PromptState, dict]]]]:
    """The group's verification passes in order: (pass, [(prompt, its trees row)]), each pass's
    trees in the order of ``states`` (a prompt has at most one tree per pass)."""
    out: dict[int, list[tuple[PromptState, dict]]] = {}
    for state in states:
        for t in state.trees:
            members = out.setdefault(pass_of(state.index, t["step"]), [])
            if any(s is state for s, _ in members):
                raise CatalogError(f"prompt {state.index} has two trees in pass "
                                   f"{pass_of(state.index, t['step'])}")
            members.append((state, t))
    return sorted(out.items(), key=lambda item: item[0])


@torch.no_grad()
def replay_group(run: Run, prompts: list[int], pass_of: Callable[[int, int], int],
                 adapter: MoEAdapter, tasks: list[ClosedTask]) -> dict[int, list[dict]]:
    """Rows of one group of prompts per task (by position in ``tasks``): every pass's trees
    re-verified in one batched forward without a budget, then once per task × budget with the
    budget in every MoE layer (one shortlist per pass and layer, over all its trees' tokens).
    Each row is one tree's; ``batch_pass`` and ``trees`` say which pass held it and how many
    trees that pass had."""
    model = adapter.model
    dev = next(model.parameters()).device
    window = verify.sliding_window(model)
    states = [PromptState(run, p, dev) for p in prompts]
    order = passes(states, pass_of)
    last = {id(s): number for number, members in order for s, _ in members}
    rows: dict[int, list[dict]] = {i: [] for i in range(len(tasks))}
    for task in tasks:
        for b in task.block.budgets:
            task.budget(b).reset()
    for number, members in order:
        trees = [s.by_step[t["step"]][0] for s, t in members]
        if len({tree.size for tree in trees}) > 1:
            raise CatalogError(f"run {run.name}: the trees of pass {number} differ in size "
                               f"({sorted({tree.size for tree in trees})}); a batched pass "
                               "verifies trees of one size")
        prefixes = [t["prefix_len"] for _, t in members]
        padded = batched.stack_caches([s.cache_at(model, p) for (s, _), p in
                                       zip(members, prefixes)])

        # every forward on its own copy (stack_caches): padded keeps its width
        ref_logits = batched.verify_batch(model, batched.stack_caches([padded]), trees, prefixes,
                                          window).logits
        refs = [acceptance.accept_greedy(tree, ref_logits[i]) for i, tree in enumerate(trees)]
        ref_logp = torch.log_softmax(ref_logits.float(), -1)
        cells = [(i, task, b) for i, task in enumerate(tasks) for b in task.block.budgets]
        per = max(1, TREES_PER_FORWARD // len(trees))  # (task, budget) cells per forward
        for lo in range(0, len(cells), per):
            chunk = cells[lo:lo + per]
            rec = VerifyRecorder(adapter, record_tensors=False, budget=BudgetGroups(
                [task.budget(b) for _, task, b in chunk]))
            with rec(number, trees, prefixes):
                logits = batched.verify_batch(
                    model, batched.stack_caches([padded] * len(chunk)), trees * len(chunk),
                    prefixes * len(chunk), window).logits  # [cells · trees, M, V]
            records = rec.take()[0][1]
            tokens = len(trees) * trees[0].size  # one cell's block of every MoE call
            for g, (i, task, b) in enumerate(chunk):
                loaded = [r.rows(g * tokens, (g + 1) * tokens, False).experts_loaded
                          for r in records]
                for j, ((state, t), tree) in enumerate(zip(members, trees)):
                    mine = logits[g * len(trees) + j]
                    rows[i].append(dict(
                        prompt_index=state.index, prompt_id=state.id, step=t["step"],
                        ranking=task.ranking.name, coverage=task.coverage.name, budget=b,
                        budget_mode=task.budget_mode,
                        price=None if task.prices is None else task.prices.prices[b],
                        batch_pass=number, trees=len(members),
                        **tree_metrics(acceptance.accept_greedy(tree, mine), refs[j],
                                       state.by_step[t["step"]][1], t["accepted_length"],
                                       mine, ref_logits[j], ref_logp[j], loaded)))
        for state, _ in members:
            if last[id(state)] == number:  # its last tree: its cache is not needed again
                state.cache = None
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
        mean_kl         = mean_t KL(p_t ‖ p_t^B)     experts_loaded = per MoE layer (the pass's)
    """
    logp = torch.log_softmax(logits.float(), -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return dict(
        accepted_length=len(got.path), captured_accepted_length=captured_accepted,
        path_unchanged=got.path == captured_path and got.bonus == ref.bonus,
        top1_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
        mean_kl=float(kl.mean()), experts_loaded=loaded)


def replay_run(run: Run, adapter: MoEAdapter, tasks: list[ClosedTask], progress,
               prompts: list[int] | None = None, finish: bool = True, source=None,
               constants: dict | None = None) -> int:
    """Every pending unit of every task; returns the trees re-verified. ``source`` says what a
    unit is (default :class:`replay.virtual_batch.PromptSource`: each prompt, its trees one per
    pass; ``BatchSource``: each (virtual) batch and its passes), ``prompts`` limits the units
    (the source's keys), ``constants`` are key columns every row gets (``batch_size``). With
    ``finish`` the tasks' blocks are marked complete afterwards."""
    from moe_spec.replay.virtual_batch import PromptSource
    check_replayable(run)
    source = source or PromptSource(run)
    done = {i: task.unit.done_prompts(task.block) for i, task in enumerate(tasks)}
    verified = 0
    for key in progress(source.keys() if prompts is None else prompts):
        todo = [i for i in range(len(tasks)) if key not in done[i]]
        if not todo:
            continue
        rows = replay_group(run, source.members(key), source.pass_of(), adapter,
                            [tasks[i] for i in todo])
        for j, i in enumerate(todo):
            sch = schema.REPLAY_TABLES[tasks[i].unit.table]
            extra = dict(batch_index=key, **(constants or {}))
            tasks[i].unit.write_part(tasks[i].block, key, pa.Table.from_pylist(
                [{name: {**extra, **row}[name] for name in sch.names} for row in rows[j]],
                schema=sch))
        verified += len(rows[0]) // max(1, len(tasks[todo[0]].block.budgets))
    if finish:
        for task in tasks:
            task.unit.finish(task.block)
    return verified
