"""Open-loop replay: what a budget costs in reconstruction error, batched over tree-layers.

For a batch of T tree-layers (each one captured tree at one MoE layer, M tokens, N experts):
every expert's output ``E [T, M, N, H]`` is recomputed once from the captured MoE inputs with the
model's own weights, checked against the captured output, turned into per-token Gram terms
(:class:`policy.batch.ExpertTerms`), and shared by every ranking, coverage and budget. For
shortlists S (B experts) and the indices/weights ``(i, w)`` the coverage policy gives each token,
DESIGN.md's metrics are, per tree-layer:

    RSE       = Σ_t ||O*_t − Ô_t||² / Σ_t ||O*_t||²
    token     = mean_t ||O*_t − Ô_t|| / ||O*_t||
    excluded  = Σ_{i∉S} s_i / Σ_i s_i,        s_i = Σ_t g_i(t)
    loaded    = #{i : w_i(t) ≠ 0 for some t}
    unique    = |∪_t T_k(t)|                   (without a budget)
    predicted = the same RSE on a surrogate's predicted outputs (:func:`predicted_rse`)

with ``||O*_t − Ô_t||²`` from the Gram expansion (O(M·k²) per candidate, never O(M·k·H)), so all
budgets × policies of a batch come out of a few tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from moe_spec.catalog.reader import PromptTreeLayers
from moe_spec.errors import UserError
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.policy.adaptive import predicted_errors
from moe_spec.policy.batch import ExpertTerms, RoutingBatch, combine, pair_index
from moe_spec.policy.coverage import Coverage, experts_used
from moe_spec.policy.prices import Prices, excluded_mass
from moe_spec.policy.rankings import Ranking
from moe_spec.policy.rankings.base import batch_shortlists

# relative tolerance of the recomputed vs captured MoE output of a tree-layer, by the coarser of
# the storage dtype and the dtype the model ran in
GOLD_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 3e-2}


def captured_weight_dtype(manifest: dict) -> torch.dtype:
    """The dtype the captured model's routers returned mixing weights in (its own dtype)."""
    return getattr(torch, str(manifest.get("dtype", "torch.float32")).removeprefix("torch."),
                   torch.float32)


def gold_tolerance(manifest: dict) -> float:
    """How close a recomputed MoE output must be to the captured one for this run."""
    storage = manifest.get("storage", {}).get("dtype") or \
        manifest.get("settings", {}).get("hidden_dtype", "float32")
    model = str(manifest.get("dtype", "torch.float32")).removeprefix("torch.")
    return max(GOLD_TOLERANCE.get(storage, 3e-2), GOLD_TOLERANCE.get(model, 3e-2))


class GoldMismatch(UserError, ValueError):
    """The recomputed MoE output differs from the captured one: wrong model or corrupt trace."""


@dataclass
class Slice:
    """Tree-layers ``rows`` of one prompt's data: what a batch is built from."""

    data: PromptTreeLayers
    rows: list[int]


def pad(slices: list[Slice], attr: str, width: int, dtype) -> np.ndarray:
    """``[T, M, width]`` of one per-row array (``[rows, width]`` or ``[rows]``) of the slices'
    tree-layers, zero-padded to the longest tree."""
    counts = [s.data.bounds[r + 1] - s.data.bounds[r] for s in slices for r in s.rows]
    out = np.zeros((len(counts), max(counts), width), dtype=dtype)
    t = 0
    for s in slices:
        arr = getattr(s.data, attr)
        for r in s.rows:
            rows = s.data.rows(r)
            out[t, :rows.stop - rows.start] = arr[rows].reshape(rows.stop - rows.start, width)
            t += 1
    return out


def load_batch(slices: list[Slice], adapter: MoEAdapter, device, tolerance: float, run: str,
               weight_dtype: torch.dtype = torch.float32, with_terms: bool = True) -> RoutingBatch:
    """A padded :class:`RoutingBatch` of the slices' tree-layers, with every expert's output
    recomputed (one batched call per layer present) and checked against the capture."""
    layers = torch.tensor([int(s.data.layer[r]) for s in slices for r in s.rows])
    k = slices[0].data.topk_ids.shape[1]
    n = slices[0].data.probs.shape[1]
    counts = torch.tensor([int(s.data.bounds[r + 1] - s.data.bounds[r])
                           for s in slices for r in s.rows])
    m = int(counts.max())
    mask = torch.arange(m)[None] < counts[:, None]
    probs = torch.from_numpy(pad(slices, "probs", n, np.float32))
    idx = torch.from_numpy(pad(slices, "topk_ids", k, np.int64))
    weights = torch.from_numpy(pad(slices, "topk_weights", k, np.float32))
    rule = replace(adapter.batch_rule(layers.to(device)), weight_dtype=weight_dtype)
    batch = RoutingBatch(probs.to(device), idx.to(device), weights.to(device), mask.to(device),
                         layers.to(device), rule)
    if not with_terms:
        return batch
    hidden = torch.from_numpy(pad(slices, "hidden", slices[0].data.hidden.shape[1], np.float32))
    batch.hidden = hidden.to(device)  # h_t, what token-aware rankings read (before any expert)
    experts, shared = expert_outputs(adapter, hidden, layers, mask, device)
    gold = combine(experts, batch.idx, batch.weights)
    if shared is not None:
        gold = gold + shared
    if slices[0].data.output is not None:
        captured = torch.from_numpy(pad(slices, "output", hidden.shape[-1], np.float32))
        check_gold(gold, captured.to(device), slices, tolerance, run)
    else:  # the storage policy recomputes outputs: check the per-token norms it kept
        norms = torch.from_numpy(pad(slices, "output_norm", 1, np.float32))
        check_gold(gold.norm(dim=-1, keepdim=True), norms.to(device), slices, tolerance, run)
    batch.terms = ExpertTerms.from_outputs(experts, batch.idx, batch.weights, shared)
    return batch


def expert_outputs(adapter: MoEAdapter, hidden: torch.Tensor, layers: torch.Tensor,
                   mask: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``E [T, M, N, H]`` (float32, 0 on padding) and the shared experts' output ``[T, M, H]`` or
    None: one batched call per distinct layer in the batch, padding included (then zeroed)."""
    param = next(adapter.model.parameters())
    t, m, h = hidden.shape
    experts = torch.empty(t, m, adapter.num_experts, h, dtype=torch.float32, device=device)
    shared = None
    real = mask.to(device)[..., None]
    with torch.no_grad():
        for layer in layers.unique().tolist():
            rows = (layers == layer).nonzero().flatten()
            x = hidden[rows].reshape(-1, h).to(param.device)  # [rows·M, H]
            moe = adapter.layer(layer)
            out = moe.all_expert_outputs(x, torch.float32).to(device)  # [rows·M, N, H], fp32
            experts[rows.to(device)] = out.view(len(rows), m, *out.shape[1:])
            so = moe.shared_output(x.to(param.dtype))
            if so is not None:
                if shared is None:
                    shared = torch.zeros(t, m, h, device=device)
                shared[rows.to(device)] = so.float().to(device).view(len(rows), m, h)
    if not bool(mask.all()):  # padding rows of experts with biases are not 0 by themselves
        experts *= real[..., None]
        if shared is not None:
            shared *= real
    return experts, shared


def check_gold(recomputed: torch.Tensor, captured: torch.Tensor, slices: list[Slice],
               tolerance: float, run: str) -> None:
    """Refuse a tree-layer whose recomputed MoE output differs from the captured one (or holds a
    non-finite value): wrong ``--model`` or a corrupt trace."""
    diff = (captured - recomputed).double().pow(2).sum((-1, -2))
    norm = captured.double().pow(2).sum((-1, -2)).clamp_min(1e-30)
    rel = diff / norm
    bad = ~torch.isfinite(rel) | (rel > tolerance ** 2)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        s, r = _locate(slices, i)
        raise GoldMismatch(
            f"run {run}: recomputed MoE output of prompt {s.data.prompt_index} step "
            f"{int(s.data.step[r])} layer {int(s.data.layer[r])} differs from the captured one "
            f"(relative error {float(rel[i]) ** 0.5:.2e}); wrong --model or corrupt trace")


def _locate(slices: list[Slice], i: int) -> tuple[Slice, int]:
    for s in slices:
        if i < len(s.rows):
            return s, s.rows[i]
        i -= len(s.rows)
    raise IndexError(i)


def metrics(batch: RoutingBatch, keep: torch.Tensor, coverage: Coverage,
            surrogate_ranked: torch.Tensor | None = None,
            predict: Callable[[RoutingBatch, torch.Tensor], RoutingBatch] | None = None
            ) -> dict[str, torch.Tensor]:
    """RSE, mean per-token relative error, mass excluded, experts loaded, unique experts,
    whether a surrogate ranked the tree-layer and the surrogate's predicted RSE, ``[T, B]`` each,
    for shortlists ``keep [T, B, N]`` that a ranking chose (``surrogate_ranked [T]``: its
    :meth:`Ranking.surrogate_ranked`; None: none was; ``predict``: its :meth:`Ranking.predicted`,
    for :func:`predicted_rse`): one tensor per metric that
    :data:`catalog.replay_metrics.METRICS` declares for ``replay_open``, by its name."""
    idx, w = coverage.apply(batch, keep)  # [T, B, M, k]
    sq = coverage.sq_errors(batch, keep, idx, w)  # [T, B, M], exact
    gold_sq = batch.terms.gold_sq[:, None, :]  # [T, 1, M]
    rse = sq.sum(-1) / gold_sq.sum(-1).clamp_min(1e-30)
    ratio = sq.sqrt() / gold_sq.sqrt().clamp_min(1e-30)
    real = batch.mask[:, None, :]
    token = (ratio * real).sum(-1) / real.sum(-1)
    excluded = excluded_mass(batch, keep)
    loaded = experts_used(idx, w * real[..., None], batch.n).sum(-1)
    unique = batch.union().sum(-1)[:, None].expand_as(loaded)
    if surrogate_ranked is None:
        surrogate_ranked = torch.zeros(batch.size, dtype=torch.bool, device=keep.device)
    ranked = surrogate_ranked.to(keep.device)[:, None].expand_as(loaded)
    predicted = predicted_rse(batch, keep, coverage, surrogate_ranked, predict)
    return dict(rse=rse, token_error=token, mass_excluded=excluded, experts_loaded=loaded,
                unique_experts=unique, surrogate_ranked=ranked, predicted_rse=predicted)


def predicted_rse(batch: RoutingBatch, keep: torch.Tensor, coverage: Coverage,
                  surrogate_ranked: torch.Tensor,
                  predict: Callable[[RoutingBatch, torch.Tensor], RoutingBatch] | None
                  ) -> torch.Tensor:
    """``ê [T, B]`` (NaN, stored as null, where no surrogate ranked the tree-layer): the error
    the ranking's surrogate predicts for its own shortlists before any expert loads,
    ``Σ_t ||Ô_t − Ô_t(S)||² / Σ_t ||Ô_t||²`` on predicted outputs (the formula's one owner:
    :func:`policy.adaptive.predicted_errors`, which the product's adaptive budgets read at run
    time too). (A ranking that refits its surrogate per budget during the prompt, sketch-post,
    predicts here with its calibration surrogate: ``predict`` is the replayed instance's, not
    each budget's stream's.)"""
    return predicted_errors(batch, keep, coverage, surrogate_ranked, predict)


@dataclass
class Stream:
    """Where a stateful ranking is in the captured passes (batches arrive in prompt, step order),
    and, for rankings that learn from executed experts, their one instance per budget."""

    prompt: int | None = None
    per_budget: dict[int, Ranking] = field(default_factory=dict)
    starts: dict[str, Stream] = field(default_factory=dict)  # the oracle's stateful starts
    used: dict = field(default_factory=dict)  # adaptive budgets with a pass cap: experts each
    # pass's earlier layers loaded (a pass may span batches)
    deficit: dict = field(default_factory=dict)  # paced adaptive budgets: each prompt's running
    # deficit, or the run's (policy.adaptive, pacing; a prompt may span batches)


def adaptive_shortlists(ranking: Ranking, batch: RoutingBatch, coverage: Coverage,
                        means: list[int], prices: Prices, prompts: torch.Tensor,
                        steps: torch.Tensor, stream: Stream) -> torch.Tensor:
    """``keep [T, len(means), N]`` of adaptive budgets at mean budgets ``means``: per tree-layer
    the ranking's shortlists at every B of ``B_min .. B_max`` (:func:`shortlists`), the router
    mass each excludes, the price rule's ``B_l`` from the predicted gains
    (:meth:`policy.prices.Prices.choose`; with a pass cap, each (prompt, step) a pass, carried
    across batches in ``stream``; paced, each prompt a stream, or the run one, its deficit
    carried alike) and the shortlist at ``B_l``. Batched over the tree-layers."""
    keep, _ = shortlists(ranking, batch, coverage, prices.budgets, prompts, steps, stream)
    passes = prompts.long() * (1 << 32) + steps.long()
    present = set(passes.unique().tolist())  # only a pass of this batch can go on in the next
    stream.used = {p: u for p, u in stream.used.items() if p in present}
    streams = prices.paced_streams(prompts)
    going = set(streams.unique().tolist())  # (batches arrive in prompt, step order)
    stream.deficit = {p: d for p, d in stream.deficit.items() if p in going}
    chosen = prices.choose(prices.curves(batch, keep, coverage, ranking), batch.layers, means,
                           passes, stream.used, streams, stream.deficit)
    return prices.pick(keep, chosen)


def shortlists(ranking: Ranking, batch: RoutingBatch, coverage: Coverage, budgets: list[int],
               prompts: torch.Tensor, steps: torch.Tensor, stream: Stream):
    """A ranking's shortlists for the batch. A stateful ranking sees the passes in order: one
    call per (prompt, step), after observing what the previous captured pass loaded (in open
    loop: the union of its natural top-k, what the unbudgeted capture loaded). A ranking that
    learns from executed experts keeps one instance per budget B and observes, after each pass,
    the outputs of exactly the experts the budgeted pass ran (coverage applied at B)."""
    if not ranking.stateful:
        if ranking.stateful_starts:  # the oracle: each stateful ranking streamed as its own task
            starts = [shortlists(other, batch, coverage, budgets, prompts, steps,
                                 stream.starts.setdefault(other.name, Stream()))[0]
                      for other in ranking.stateful_starts]
            return ranking.shortlists(batch, coverage, budgets, starts=starts)
        return batch_shortlists(ranking, batch, coverage, budgets)
    keep = torch.zeros(batch.size, len(budgets), batch.n, dtype=torch.bool, device=batch.device)
    union = batch.union()
    routing = replace(batch, terms=None)  # what a runtime ranking sees (no expert outputs)
    for b in budgets if ranking.observes_outputs else []:
        if b not in stream.per_budget:
            stream.per_budget[b] = ranking.clone()
    for prompt, step in sorted(set(zip(prompts.tolist(), steps.tolist()))):
        new_prompt = prompt != stream.prompt
        stream.prompt = prompt
        rows = ((prompts == prompt) & (steps == step)).nonzero().flatten()
        part = routing.take(rows)
        if not ranking.observes_outputs:
            if new_prompt:
                ranking.reset()
            keep[rows] = ranking.shortlists(part, coverage, budgets)[0]
            ranking.observe(part.layers, union[rows])
            continue
        instances = [stream.per_budget[b] for b in budgets]
        if new_prompt:
            for own in instances:
                own.reset()
        masks = type(ranking).shortlists_each(instances, part, coverage, budgets)  # [R, B, N]
        keep[rows] = masks
        idx, w = coverage.apply(part, masks)  # what each budgeted pass ran: [R, B, M, k]
        w = w * part.mask[:, None, :, None]
        # what the passes computed: the executed outputs [R, B, M, k, H] for a ranking that
        # learns from them, else only their inner products [R, B, M, k, k]
        vectors = executed_outputs(batch, rows, idx) if ranking.observes_output_vectors else None
        dots = None if vectors is not None else executed_dots(batch, rows, idx)
        for j, own in enumerate(instances):
            own.observe(part.layers, experts_used(idx[:, j], w[:, j], batch.n))
            own.observe_outputs(part.layers, idx[:, j], w[:, j],
                                None if vectors is None else vectors[:, j],
                                dots=None if dots is None else dots[:, j])
    return keep, budgets


def executed_outputs(batch: RoutingBatch, rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``E_a(h_t) [R, B, M, k, H]`` of the experts ``idx [R, B, M, k]`` that each budget's pass
    ran for the tree-layers ``rows`` (for rankings that learn from the outputs themselves)."""
    experts = batch.terms.experts
    if experts is None:
        raise RuntimeError("the batch's raw expert outputs were dropped; replay keeps them for "
                           "rankings that observe output vectors")
    experts = experts[rows.to(experts.device)][:, None]  # [R, 1, M, N, H]
    experts = experts.expand(-1, idx.shape[1], -1, -1, -1)
    return experts.gather(3, idx[..., None].expand(*idx.shape, experts.shape[-1]))


def executed_dots(batch: RoutingBatch, rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``⟨E_a(h_t), E_b(h_t)⟩ [R, B, M, k, k]`` (float64) of the experts ``idx [R, B, M, k]`` that
    each budget's pass ran for the tree-layers ``rows``, read from the batch's per-token Gram
    (:meth:`policy.batch.ExpertTerms.gram`, computed once per batch) instead of gathering the
    outputs for every budget."""
    q = batch.terms.gram()[0]  # [T, M, N, N]
    m, n, k = q.shape[1], batch.n, idx.shape[-1]
    token = rows.to(idx.device)[:, None, None] * m + torch.arange(m, device=idx.device)  # [R, 1, M]
    return q.reshape(-1).take(token[..., None] * (n * n) + pair_index(idx, n)).unflatten(-1, (k, k))
