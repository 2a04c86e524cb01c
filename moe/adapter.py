"""One MoE adapter over transformers' router and experts modules, for every supported family.

The adapter finds each decoder layer's sparse block from the family's routing spec
(:mod:`moe.families`), exposes its router, experts and shared experts, and computes what capture
and replay need from them. It copies no model code and owns no weights; the experts' layout
(fused or transposed weights, biases, gating) is read from the flags transformers' experts
modules declare, and the gate is the module's own gate function.

Notation (DESIGN.md): ``g_t ∈ R^N`` the router scores of token t, ``T_k(t)`` its top-k,
``ḡ_t`` the mixing weights, ``E_i`` expert i, ``O*_t`` the block's output (routed + shared).

    >>> adapter = MoEAdapter(model)
    >>> layer = adapter.layers[0]
    >>> g = layer.router_scores(h)               # [T, N]
    >>> outs = layer.all_expert_outputs(h)       # [T, N, H]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from moe_spec.errors import UserError
from moe_spec.moe.families import FamilySpec, UnsupportedModelError, facts, spec_for
from moe_spec.policy.routing import RoutingRule


@dataclass
class MoELayer:
    """The router, experts and (if any) shared experts of one decoder layer's sparse block."""

    index: int  # decoder layer index
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    shared: nn.Module | None
    rule: RoutingRule
    num_experts: int

    @property
    def top_k(self) -> int:
        return self.rule.top_k

    @property
    def renormalize(self) -> bool:
        return self.rule.renormalize

    # --- routing -------------------------------------------------------------------------------
    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, N]`` for MoE inputs ``hidden [T, H]`` (the router module's own)."""
        return self.router(hidden)[0]

    def router_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``g_t`` over all N experts, float32 ``[T, N]`` (softmax or sigmoid, per family)."""
        return self.rule.scores(self.router_logits(hidden))

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own natural routing: ``(top_k_index [T, k], mixing weights ḡ [T, k])``."""
        _, weights, index = self.router(hidden)
        return index, weights

    # --- experts -------------------------------------------------------------------------------
    def all_expert_outputs(self, hidden: torch.Tensor,
                           dtype: torch.dtype | None = None) -> torch.Tensor:
        """``E_i(h_t)`` for every expert and token in one batched call: ``[T, N, H]``; with
        ``dtype`` (e.g. float32 for a bf16 model) the weights are upcast for the call."""
        ex = self.experts
        transposed = getattr(ex, "is_transposed", False)
        gated = getattr(ex, "has_gate", True)
        bias = getattr(ex, "has_bias", False)

        def w(param: torch.Tensor) -> torch.Tensor:
            return param if dtype is None or param.dtype == dtype else param.to(dtype)

        hidden = hidden if dtype is None else hidden.to(dtype)
        w_in = w(ex.gate_up_proj if gated else ex.up_proj)
        up = torch.matmul(hidden.unsqueeze(0), w_in if transposed else w_in.transpose(1, 2))
        if bias:
            up = up + w(ex.gate_up_proj_bias if gated else ex.up_proj_bias)[:, None, :]
        act = ex._apply_gate(up) if gated else ex.act_fn(up)  # the module's own gate: [N, T, I]
        down = w(ex.down_proj)
        out = torch.matmul(act, down if transposed else down.transpose(1, 2))
        if bias:
            out = out + w(ex.down_proj_bias)[:, None, :]
        return out.transpose(0, 1)

    def expert_output(self, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """``E_i(h)`` for one expert through the experts module's own forward, ``[T, H]``."""
        idx = torch.full((hidden.shape[0], 1), expert, dtype=torch.long, device=hidden.device)
        return self.experts(hidden, idx, torch.ones(idx.shape, dtype=hidden.dtype,
                                                    device=hidden.device))

    def moe_output(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """``Σ_j w_j(t) E_{idx_j(t)}(h_t)`` for any indices and weights, computed by the model's
        own experts module (so it is exactly what the model would compute)."""
        return self.experts(hidden, top_k_index, top_k_weights.to(hidden.dtype))

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The always-on shared experts' output ``[T, H]``, or None for families without them."""
        return None if self.shared is None else self.shared(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block's output under natural routing, ``O*_t`` (routed + shared experts)."""
        index, weights = self.route(hidden)
        out = self.moe_output(hidden, index, weights)
        shared = self.shared_output(hidden)
        return out if shared is None else out + shared


def _sparse_block(layer: nn.Module, spec: FamilySpec) -> nn.Module | None:
    block = getattr(layer, "mlp", None)
    experts = getattr(block, "experts", None)
    if block is None or experts is None or not hasattr(block, spec.router):
        return None
    return block


class NoMoELayer(UserError, KeyError):
    """A decoder layer asked for that has no MoE block; one line for the user."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0])


class MoEAdapter:
    """Every MoE layer of a causal LM, in decoder order, per its family's routing spec."""

    def __init__(self, model: nn.Module, *, check: bool = True):
        config = model.config
        self.spec = spec_for(config)
        self.facts = facts(config)  # what its config says (the one reader of a model config)
        base = getattr(model, "model", model)
        decoder_layers = getattr(base, "layers", None)
        if decoder_layers is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no decoder layers at "
                                        ".model.layers")
        self.model = model
        self.num_decoder_layers = len(decoder_layers)
        dense = self.facts.dense_layers
        self.layers: list[MoELayer] = []
        for i, layer in enumerate(decoder_layers):
            block = _sparse_block(layer, self.spec)
            if (block is None) != (i in dense):
                raise UnsupportedModelError(
                    f"layer {i} of this {self.facts.model_type} model is "
                    f"{'dense' if block is None else 'sparse'} but its config says otherwise")
            if block is None:
                continue
            router = getattr(block, self.spec.router)
            shared = getattr(block, self.spec.shared_experts) if self.spec.shared_experts \
                else None
            self.layers.append(MoELayer(i, block, router, block.experts, shared,
                                        self.spec.rule(config, router),
                                        num_experts=router.weight.shape[0]))
        if not self.layers:
            raise UnsupportedModelError(f"{type(model).__name__} has no sparse MoE layers")
        self._by_index = {layer.index: layer for layer in self.layers}
        if check:
            self.check_routing()

    @torch.no_grad()
    def check_routing(self, tokens: int = 16, seed: int = 0) -> None:
        """Refuse a model whose routers do not compute what the family's spec says: on random
        probes, the rule's top-k and mixing weights must equal each router module's own."""
        param = next(self.model.parameters())
        g = torch.Generator(device="cpu").manual_seed(seed)
        for layer in self.layers:
            h = torch.randn(tokens, self.facts.hidden_size, generator=g)
            h = h.to(param.device, param.dtype)
            logits, weights, index = layer.router(h)
            layer.rule = replace(layer.rule, weight_dtype=weights.dtype)  # as the router returns
            scores = layer.rule.scores(logits)
            idx, w = layer.rule.route(scores)
            same = (idx.sort(-1).values == index.long().sort(-1).values).all(-1)
            # a set may differ only where equal scores tie at the k-th place (bf16 routers)
            choice = layer.rule.selection_scores(scores).float()
            kth = choice.gather(-1, idx).min(-1).values
            theirs_kth = choice.gather(-1, index.long()).min(-1).values
            same_sets = bool((same | (kth == theirs_kth)).all())
            order = idx.argsort(-1)
            mine = w.gather(-1, order)[same]
            theirs = weights.float().gather(-1, index.long().argsort(-1))[same]
            tol = 1e-5 if param.dtype == torch.float32 else 2e-2
            if not same_sets or not torch.allclose(mine, theirs, rtol=tol, atol=tol):
                raise UnsupportedModelError(
                    f"layer {layer.index}: the {self.spec.model_type} router does not compute "
                    "what its routing spec says (top-k or mixing weights differ); this "
                    "transformers version or checkpoint is not supported")

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def layer(self, index: int) -> MoELayer:
        """The MoE layer of decoder layer ``index``."""
        try:
            return self._by_index[index]
        except KeyError:
            raise NoMoELayer(f"decoder layer {index} has no MoE block; MoE layers: "
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

    @property
    def rule(self) -> RoutingRule:
        """The family's routing rule, as a run's manifest records it (layer 0's: the layers'
        rules differ only in their selection biases, see :meth:`batch_rule`)."""
        return self.layers[0].rule

    @property
    def moe_layers(self) -> list[int]:
        return [layer.index for layer in self.layers]

    @torch.no_grad()
    def expert_outputs(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Every expert's output on MoE inputs from a trace, computed in float32 whatever the
        model's dtype, on the CPU: ``[M, H] → [M, N, H]``."""
        param = next(self.model.parameters())
        return self.layer(layer).all_expert_outputs(hidden.to(param.device), torch.float32).cpu()

    def batch_rule(self, layers: torch.Tensor) -> RoutingRule:
        """One routing rule for a batch of tree-layers at ``layers [T]``: the family's rule, with
        per-row selection biases ``[T, 1, N]`` where the family has them."""
        rule = self.layers[0].rule
        if rule.selection_bias is None:
            return rule
        biases = torch.stack([self.layer(int(i)).rule.selection_bias for i in layers.tolist()])
        return rule.for_layers(biases[:, None, :].to(layers.device))

    @property
    def has_shared_experts(self) -> bool:
        return self.layers[0].shared is not None
