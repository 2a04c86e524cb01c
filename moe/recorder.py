"""Hooks on the target's MoE modules during verification passes only (capture records with
them; closed-loop replay applies budgets with them).

``VerifyRecorder`` is handed to :class:`~eagle.decoding.EagleDecoder` as its ``verify_context``:
for each verification pass it registers, through the adapter,

* a forward hook on every layer's router: router scores ``g_t`` (N), natural top-k ``T_k(t)`` and
  mixing weights ``ḡ`` (slots by decreasing weight, ties by id; where equal scores tie at the
  k-th place the rule's lower-id choice replaces the router's implementation-defined one, see
  :meth:`policy.routing.RoutingRule.natural`); under an expert budget (MoE-Spec online mode,
  closed-loop replay) the hook also *replaces* the router's output with the budgeted indices/weights
  (:class:`policy.budget.Budget`), so the experts module runs only those;
* a forward hook on every sparse block: its input ``h_t`` and output (the gold ``O*_t`` without a
  budget), optionally each used expert's own output ``E_i(h_t)``;

and removes them when the pass ends, so prefill and AR steps are never touched. Rows are in tree
node order (the verify forward's token order).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from moe_spec.moe.adapter import MoEAdapter, MoELayer
from moe_spec.policy.budget import Budget, BudgetGroups
from moe_spec.policy.coverage import experts_used


@dataclass
class LayerRecord:
    layer: int
    probs: torch.Tensor  # [M, N] float32 router scores g
    topk_ids: torch.Tensor  # [M, k] natural
    topk_weights: torch.Tensor  # [M, k] natural ḡ
    applied_ids: torch.Tensor | None = None  # under a budget
    applied_weights: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # [M, H]
    output: torch.Tensor | None = None  # [M, H]
    expert_outputs: torch.Tensor | None = None  # [M, k, H] for the applied (or natural) top-k

    def rows(self, start: int, stop: int, tensors: bool = True) -> LayerRecord:
        """Tokens ``[start, stop)`` of this record (one sequence of a batched pass); without
        ``tensors`` the MoE input/output tensors are left out (the storage policy's choice)."""
        cut = lambda x, keep=True: None if x is None or not keep else x[start:stop]  # noqa: E731
        return LayerRecord(self.layer, cut(self.probs), cut(self.topk_ids),
                           cut(self.topk_weights), cut(self.applied_ids),
                           cut(self.applied_weights), cut(self.hidden, tensors),
                           cut(self.output, tensors), cut(self.expert_outputs, tensors))

    @property
    def unique_experts(self) -> int:
        return int(torch.unique(self.topk_ids).numel())

    def loaded(self) -> torch.Tensor:
        """``[N]`` bool: the experts this pass ran at this layer."""
        ids, w = (self.topk_ids, self.topk_weights) if self.applied_ids is None else \
            (self.applied_ids, self.applied_weights)
        return experts_used(ids, w, self.probs.shape[-1])

    @property
    def experts_loaded(self) -> int:
        return int(self.loaded().sum())


class VerifyRecorder:
    """Records every verification pass; ``take()`` hands the recorded passes over."""

    def __init__(self, adapter: MoEAdapter, *, store_expert_outputs: bool = False,
                 budget: Budget | BudgetGroups | None = None, record_tensors: bool = True,
                 tensor_layers: list[int] | None = None):
        self.adapter = adapter
        self.store_expert_outputs = store_expert_outputs
        self.budget = budget
        self.record_tensors = record_tensors
        # MoE layers whose input/output are recorded (None: all), and which passes do
        self.tensor_layers = None if tensor_layers is None else set(tensor_layers)
        self.keep_pass: Callable[[int], bool] = lambda step: True
        self.passes: list[tuple[int, list[LayerRecord]]] = []  # (step, per-layer records)

    def new_prompt(self, keep_pass: Callable[[int], bool] | None = None) -> None:
        """A new prompt: stateful rankings forget the previous prompt's passes; ``keep_pass``
        says which of its passes record MoE tensors."""
        if self.budget is not None:
            self.budget.reset()
        self.keep_pass = keep_pass or (lambda step: True)

    def take(self) -> list[tuple[int, list[LayerRecord]]]:
        """Hand over the recorded passes and forget them (bounded memory)."""
        passes, self.passes = self.passes, []
        return passes

    def _router_hook(self, layer: MoELayer, records: dict):
        def hook(module, args, out):
            logits, weights, idx = out
            probs = layer.rule.scores(logits)
            idx, natural_w, retied = layer.rule.natural(probs, idx, weights)
            rec = LayerRecord(layer.index, probs, idx, natural_w)
            records[layer.index] = rec
            if self.budget is None:
                # the router's own top-k unless a tie at the k-th place fell the other way
                return (logits, natural_w.to(weights.dtype), idx) if retied else None
            hidden = args[0].reshape(-1, args[0].shape[-1]) if args else None  # h_t
            routed = self.budget.route(layer.index, rec.probs, idx, natural_w, layer.rule, hidden)
            rec.applied_ids, rec.applied_weights = routed.idx, routed.weights
            # Dropped slots (weight 0) point at a shortlisted expert, so the experts module never
            # runs an expert outside the budget.
            run_idx = torch.where(routed.weights == 0, routed.anchor(), routed.idx)
            return logits, routed.weights.to(weights.dtype), run_idx
        return hook

    def _block_hook(self, layer: MoELayer, records: dict):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            rec = records[layer.index]
            h = args[0].reshape(-1, args[0].shape[-1])
            rec.hidden = h.detach()
            rec.output = out.reshape(-1, out.shape[-1]).detach()
            if self.store_expert_outputs or self._learns_from_outputs:
                idx = rec.applied_ids if rec.applied_ids is not None else rec.topk_ids
                with torch.no_grad():
                    outs = layer.all_expert_outputs(h)  # [M, N, H]
                rec.expert_outputs = outs.gather(
                    1, idx[..., None].expand(-1, -1, outs.shape[-1]).long()).detach()
        return hook

    @property
    def _learns_from_outputs(self) -> bool:
        """The budget's ranking refines itself from the outputs of the experts a pass ran."""
        return self.budget is not None and self.budget.observes_outputs

    @contextmanager
    def __call__(self, step: int, tree, prefix_len: int):
        records: dict[int, LayerRecord] = {}
        hooks = []
        tensors = self.record_tensors and self.keep_pass(step)
        for layer in self.adapter:
            hooks.append(layer.router.register_forward_hook(self._router_hook(layer, records)))
            if self._learns_from_outputs or (tensors and (
                    self.tensor_layers is None or layer.index in self.tensor_layers)):
                hooks.append(layer.block.register_forward_hook(self._block_hook(layer, records)))
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()
        layers = [records[layer.index] for layer in self.adapter]
        for budget, start, stop in self.budget.parts(len(layers[0].probs)) if self.budget else []:
            own = [r.rows(start, stop) for r in layers]  # its block of a grouped forward
            executed = {r.layer: (r.applied_ids, r.applied_weights, r.expert_outputs)
                        for r in own} if budget.observes_outputs else None
            budget.observe({r.layer: r.loaded() for r in own}, executed)
        self.passes.append((step, layers))
