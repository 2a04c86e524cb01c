"""Routing specs: each supported model family's MoE rules, stated once, explicitly.

transformers 5.x builds every sparse block from a router module returning ``(logits, top-k
weights, top-k indices)`` and an experts module with fused weights, called as
``experts(hidden, top_k_index, top_k_weights)``. What differs between families — and what the
workbench must never guess — is written here, one entry per ``model_type``:

| model_type | scores | top-k | mixing weights | shared | dense layers |
|---|---|---|---|---|---|
| ``olmoe`` | softmax | plain | per ``norm_topk_prob`` (raw in OLMoE) | – | – |
| ``qwen3_moe`` | softmax | plain | per ``norm_topk_prob`` | – | ``mlp_only_layers``, sparse step |
| ``mixtral`` | softmax | plain | renormalised | – | – |
| ``deepseek_v3`` | sigmoid (+ bias to select) | in 4 of 8 groups | per config, × scale | yes | first k |
| ``gpt_oss`` | softmax (router bias) | plain | renormalised over the top-k | – | – |

DeepSeek-V3: scores ``sigmoid(z)``; selection by ``scores + e_score_correction_bias`` within the
``topk_group`` of ``n_group`` groups with the best two-expert sums; weights from the unbiased
scores, renormalised per ``norm_topk_prob``, times ``routed_scaling_factor``; one MLP of
``n_shared_experts`` always-on shared experts; the first ``first_k_dense_replace`` layers dense.
gpt-oss: the router has a bias and takes the softmax of the top-k logits, which is the softmax
over all N renormalised over the top-k.

gpt-oss experts have biases and a clamped SWiGLU with interleaved gate/up columns, declared by
the experts module itself (``has_bias``, ``is_transposed``, its gate); the adapter reads them
there. DeepSeek-V3's shared experts are always computed: they belong to the gold output and are
never counted in a budget B; rankings, coverage and co-activation are over routed experts.

An unlisted ``model_type`` is refused at load with one line naming the supported ones. At load
the adapter also checks, on random probes, that every layer's router computes exactly what its
spec says (:meth:`moe.adapter.MoEAdapter.check_routing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from errors import UserError
from policy.routing import RoutingRule


class UnsupportedModelError(UserError, ValueError):
    """A model the workbench cannot replay faithfully; the message is one line."""


def _no_dense_layers(config) -> set[int]:
    return set()


def _first_k_dense(config) -> set[int]:
    """DeepSeek-V3: the first ``first_k_dense_replace`` layers have a dense MLP."""
    return set(range(min(config.first_k_dense_replace or 0, config.num_hidden_layers)))


def _qwen3_dense_layers(config) -> set[int]:
    """Qwen3-MoE: a layer is dense when listed in ``mlp_only_layers`` or off the sparse step."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    listed = set(getattr(config, "mlp_only_layers", []) or [])
    return {i for i in range(config.num_hidden_layers) if i in listed or (i + 1) % step != 0}


@dataclass(frozen=True)
class FamilySpec:
    """One family's MoE routing, as data: every flag of its :class:`RoutingRule` is either a
    constant here or the name of the config attribute (or router buffer) that holds it, under the
    names serving engines use (vLLM ``FusedMoE``, SGLang ``select_experts``)."""

    model_type: str
    scoring_func: str  # "softmax" | "sigmoid"
    renormalize: bool | str  # constant, or the config flag that decides (e.g. "norm_topk_prob")
    renormalize_eps: float = 0.0  # added to the renormalisation's denominator
    routed_scaling_factor: str | None = None  # config attribute the weights are multiplied by
    e_score_correction_bias: str | None = None  # router buffer added to scores for selection only
    grouped_topk: tuple[str, str] | None = None  # config (num_expert_group, topk_group)
    router: str = "gate"  # attribute of the sparse block holding the router module
    shared_experts: str | None = None  # attribute of the sparse block, always computed
    dense_layers: Callable[[object], set[int]] = _no_dense_layers
    attention: str = "sdpa"  # the implementation tree verification runs with (4-D masks)

    def rule(self, config, router: nn.Module) -> RoutingRule:
        """The routing rule of one layer (its router holds any per-layer selection bias)."""
        renormalize = self.renormalize if isinstance(self.renormalize, bool) else \
            bool(getattr(config, self.renormalize, False))
        scale = float(getattr(config, self.routed_scaling_factor)) \
            if self.routed_scaling_factor else 1.0
        bias = getattr(router, self.e_score_correction_bias).detach().float() \
            if self.e_score_correction_bias else None
        groups, groups_kept = (int(getattr(config, name)) for name in self.grouped_topk) \
            if self.grouped_topk else (1, 1)
        return RoutingRule(
            top_k=config.num_experts_per_tok, score=self.scoring_func, renormalize=renormalize,
            scale=scale, renormalize_eps=self.renormalize_eps, selection_bias=bias,
            groups=groups, groups_kept=groups_kept)


FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in (
    FamilySpec("olmoe", scoring_func="softmax", renormalize="norm_topk_prob"),
    FamilySpec("qwen3_moe", scoring_func="softmax", renormalize="norm_topk_prob",
               dense_layers=_qwen3_dense_layers),
    FamilySpec("mixtral", scoring_func="softmax", renormalize=True),
    FamilySpec("deepseek_v3", scoring_func="sigmoid", renormalize="norm_topk_prob",
               renormalize_eps=1e-20, routed_scaling_factor="routed_scaling_factor",
               e_score_correction_bias="e_score_correction_bias",
               grouped_topk=("n_group", "topk_group"), shared_experts="shared_experts",
               dense_layers=_first_k_dense),
    FamilySpec("gpt_oss", scoring_func="softmax", renormalize=True, router="router",
               attention="eager"),  # transformers has no sdpa path for its attention sinks
)}


def spec_for(config) -> FamilySpec:
    model_type = getattr(config, "model_type", None)
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported MoE families: "
            f"{', '.join(FAMILIES)}") from None
