"""One MoE adapter for transformers' Olmoe, Qwen3Moe and Mixtral models.

transformers 5.x builds every sparse block the same way: ``layer.mlp.gate`` is a router module
returning ``(logits, top-k weights, top-k indices)`` and ``layer.mlp.experts`` holds fused weights
``gate_up_proj [N, 2I, H]`` and ``down_proj [N, H, I]``, called as
``experts(hidden, top_k_index, top_k_weights)``. The adapter finds those modules and exposes them
per layer; it copies no model code and owns no weights. Capture and replay both go through it.

Notation (DESIGN.md): ``g_t ∈ R^N`` the router softmax of token t, ``T_k(t)`` its top-k,
``ḡ_t`` the mixing weights (renormalised over the top-k when the model says so), ``E_i`` expert i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """The model has no MoE block the adapter understands; message is one line."""


def _renormalises(router: nn.Module) -> bool:
    """Whether ḡ is renormalised over the top-k: OLMoE/Qwen3-MoE say so in ``norm_topk_prob``;
    Mixtral's router always renormalises."""
    if hasattr(router, "norm_topk_prob"):
        return bool(router.norm_topk_prob)
    if type(router).__name__.startswith("Mixtral"):
        return True
    raise UnsupportedModelError(f"router {type(router).__name__} does not say whether it "
                                "renormalises its top-k weights")


@dataclass
class MoELayer:
    """The router and experts modules of one decoder layer's sparse MoE block."""

    index: int  # decoder layer index
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int
    renormalize: bool

    # --- routing -------------------------------------------------------------------------------
    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, N]`` for MoE inputs ``hidden [T, H]`` (the router's own linear)."""
        return self.router(hidden)[0]

    def router_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """``g_t``: softmax of the router logits over all N experts, in float32 ``[T, N]``."""
        return torch.softmax(self.router_logits(hidden).float(), dim=-1)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own natural routing: ``(top_k_index [T, k], mixing weights ḡ [T, k])``."""
        _, weights, index = self.router(hidden)
        return index, weights

    def mixing_weights(self, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``ḡ_i(t)`` for the experts in ``index [T, j]``: ``g_i(t)``, divided by
        ``Σ_{i'∈index(t)} g_i'(t)`` when the model renormalises."""
        weights = probs.gather(-1, index)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights

    # --- experts -------------------------------------------------------------------------------
    def expert_output(self, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """``E_i(h)`` for one expert: ``down_i(act(gate_i h) ⊙ up_i h)``, ``[T, H]``."""
        gate_up = hidden @ self.experts.gate_up_proj[expert].T
        return self.experts._apply_gate(gate_up) @ self.experts.down_proj[expert].T

    def all_expert_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """``E_i(h_t)`` for every expert and token in one batched call: ``[T, N, H]``."""
        gate_up = torch.matmul(hidden.unsqueeze(0), self.experts.gate_up_proj.transpose(1, 2))
        act = self.experts._apply_gate(gate_up)  # [N, T, I]
        out = torch.matmul(act, self.experts.down_proj.transpose(1, 2))  # [N, T, H]
        return out.transpose(0, 1)

    def moe_output(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """``Σ_j w_j(t) E_{idx_j(t)}(h_t)`` for any given indices and weights, computed by the
        model's own experts module (so it is exactly what the model would compute)."""
        return self.experts(hidden, top_k_index, top_k_weights.to(hidden.dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MoE output under natural routing, ``O*_t`` (equals the block's own output)."""
        index, weights = self.route(hidden)
        return self.moe_output(hidden, index, weights)


def _is_sparse_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (hasattr(module, "gate") and experts is not None
            and getattr(experts, "gate_up_proj", None) is not None
            and getattr(experts, "down_proj", None) is not None)


class MoEAdapter:
    """Every MoE layer of a causal LM, in decoder order.

    >>> adapter = MoEAdapter(model)
    >>> layer = adapter.layers[0]
    >>> probs = layer.router_probs(h)           # [T, N]
    >>> outs = layer.all_expert_outputs(h)      # [T, N, H]
    """

    def __init__(self, model: nn.Module):
        base = getattr(model, "model", model)
        decoder_layers = getattr(base, "layers", None)
        if decoder_layers is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no decoder layers at .model.layers")
        self.model = model
        self.num_decoder_layers = len(decoder_layers)
        self.layers: list[MoELayer] = []
        for i, layer in enumerate(decoder_layers):
            block = getattr(layer, "mlp", None)
            if block is None or not _is_sparse_block(block):
                continue  # e.g. Qwen3-MoE's dense `mlp_only_layers`
            experts = block.experts
            if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) \
                    or not getattr(experts, "has_gate", True):
                raise UnsupportedModelError(f"layer {i}: experts layout of "
                                            f"{type(experts).__name__} is not [N, 2I, H] gated")
            self.layers.append(MoELayer(
                index=i, block=block, router=block.gate, experts=experts,
                num_experts=experts.gate_up_proj.shape[0], top_k=block.gate.top_k,
                renormalize=_renormalises(block.gate)))
        if not self.layers:
            raise UnsupportedModelError(f"{type(model).__name__} has no sparse MoE layers")
        self._by_index = {layer.index: layer for layer in self.layers}

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def layer(self, index: int) -> MoELayer:
        """The MoE layer of decoder layer ``index``."""
        try:
            return self._by_index[index]
        except KeyError:
            raise KeyError(f"decoder layer {index} has no MoE block; MoE layers: "
                           f"{sorted(self._by_index)}") from None

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts

    @property
    def top_k(self) -> int:
        return self.layers[0].top_k

    @property
    def renormalize(self) -> bool:
        return self.layers[0].renormalize
