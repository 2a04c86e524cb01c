"""Hooks on the target's MoE modules during verification passes only.

``VerifyRecorder`` is handed to :class:`~capture.eagle.decoding.EagleDecoder` as its
``verify_context``: for each verification pass it registers, through the adapter,

* a forward hook on every layer's router: full softmax ``g_t`` (N), natural top-k ``T_k(t)`` and
  mixing weights ``ḡ``; in MoE-Spec online mode the hook also *replaces* the router's output with
  the budgeted indices/weights (``replay.budget``), so the experts module runs only those;
* a forward hook on every sparse block: its input ``h_t`` and output (the gold ``O*_t`` without a
  budget), optionally each used expert's own output ``E_i(h_t)``;

and removes them when the pass ends, so prefill and AR steps are never touched. Rows are in tree
node order (the verify forward's token order).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from capture.moe_adapter import MoEAdapter
from replay import budget as budgets
from replay.coact import CoactStats
from replay.rankings import keep_mask, runtime_order


@dataclass(frozen=True)
class BudgetSettings:
    budget: int
    ranking: str = "router"  # a runtime ranking: router | static | coact
    coverage: str = "substitution"  # truncation | substitution
    stats: CoactStats | None = None  # calibration statistics for static and coact


@dataclass
class LayerRecord:
    layer: int
    probs: torch.Tensor  # [M, N] float32
    topk_ids: torch.Tensor  # [M, k] natural
    topk_weights: torch.Tensor  # [M, k] natural ḡ
    applied_ids: torch.Tensor | None = None  # under a budget
    applied_weights: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # [M, H]
    output: torch.Tensor | None = None  # [M, H]
    expert_outputs: torch.Tensor | None = None  # [M, k, H] for the applied (or natural) top-k

    @property
    def unique_experts(self) -> int:
        return int(torch.unique(self.topk_ids).numel())

    @property
    def experts_loaded(self) -> int:
        if self.applied_ids is None:
            return self.unique_experts
        return int(budgets.experts_used(self.applied_ids, self.applied_weights).numel())


class VerifyRecorder:
    def __init__(self, adapter: MoEAdapter, *, store_expert_outputs: bool = False,
                 budget: BudgetSettings | None = None, record_tensors: bool = True):
        self.adapter = adapter
        self.store_expert_outputs = store_expert_outputs
        self.budget = budget
        self.record_tensors = record_tensors
        self.passes: list[tuple[int, list[LayerRecord]]] = []  # (step, per-layer records)
        self.on_pass = None  # called after each recorded pass (the writer flushes from here)

    def take(self) -> list[tuple[int, list[LayerRecord]]]:
        """Hand over the recorded passes and forget them (bounded memory)."""
        passes, self.passes = self.passes, []
        return passes

    def _router_hook(self, layer, records: dict):
        def hook(module, args, out):
            logits, weights, idx = out
            probs = torch.softmax(logits.float(), dim=-1)
            rec = LayerRecord(layer.index, probs, idx, weights.float())
            records[layer.index] = rec
            if self.budget is None:
                return None
            b = self.budget
            order = runtime_order(b.ranking, probs, idx, weights, layer.index, b.stats)
            keep = keep_mask(order, b.budget, layer.num_experts)
            new_idx, new_w = budgets.apply(probs, idx, weights.float(), keep, b.coverage,
                                           layer.renormalize)
            rec.applied_ids, rec.applied_weights = new_idx, new_w
            # Dropped truncation slots (weight 0) point at a shortlisted expert, so the experts
            # module never runs an expert outside the budget.
            run_idx = torch.where(new_w == 0, order[0], new_idx)
            return logits, new_w.to(weights.dtype), run_idx
        return hook

    def _block_hook(self, layer, records: dict):
        def hook(module, args, out):
            rec = records[layer.index]
            h = args[0].reshape(-1, args[0].shape[-1])
            rec.hidden = h.detach()
            rec.output = out.reshape(-1, out.shape[-1]).detach()
            if self.store_expert_outputs:
                idx = rec.applied_ids if rec.applied_ids is not None else rec.topk_ids
                with torch.no_grad():
                    outs = layer.all_expert_outputs(h)  # [M, N, H]
                rec.expert_outputs = outs.gather(
                    1, idx[..., None].expand(-1, -1, outs.shape[-1]).long()).detach()
        return hook

    @contextmanager
    def __call__(self, step: int, tree, prefix_len: int):
        records: dict[int, LayerRecord] = {}
        hooks = []
        for layer in self.adapter:
            hooks.append(layer.router.register_forward_hook(self._router_hook(layer, records)))
            if self.record_tensors:
                hooks.append(layer.block.register_forward_hook(self._block_hook(layer, records)))
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()
        self.passes.append((step, [records[layer.index] for layer in self.adapter]))
        if self.on_pass is not None:
            self.on_pass()
