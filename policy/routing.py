"""How one MoE layer routes: scores, top-k selection and mixing weights (DESIGN.md, Families).

For router logits ``z_t ∈ R^N`` of token t::

    scores     g_t = softmax(z_t)                or  sigmoid(z_t)             (score)
    selection  T_k(t) = top-k of g_t + bias      (selection_bias; 0 for most families)
               group-limited: keep the ``groups_kept`` of ``groups`` expert groups with the
               largest sum of their two best biased scores, then top-k within them
    mixing     ḡ_i(t) = g_i(t) for i ∈ T_k(t),   / Σ_{j∈T_k(t)} g_j(t) when ``renormalize``,
               × ``scale``

Under an expert budget S, substitution applies the same rule with every expert outside S
removed (selection among S only, mixing over what was selected). ``moe.families`` builds one
rule per model family from its config; tests build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingRule:
    top_k: int
    score: str = "softmax"
    renormalize: bool = False
    scale: float = 1.0
    renormalize_eps: float = 0.0  # DeepSeek-V3 adds 1e-20 to the denominator
    selection_bias: torch.Tensor | None = None  # [N], or [T, 1, N] for a batch of layers
    groups: int = 1
    groups_kept: int = 1
    weight_dtype: torch.dtype | None = None  # the router returns weights in this dtype (bf16
    # models round them); mix() rounds the same way

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"unknown score function {self.score!r}; use one of {SCORES}")

    @property
    def group_limited(self) -> bool:
        return self.groups > 1 and self.groups_kept < self.groups

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """``g``: the router scores of every expert, float32 ``[..., N]``."""
        logits = logits.float()
        return torch.softmax(logits, -1) if self.score == "softmax" else torch.sigmoid(logits)

    def _choice(self, g: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Scores used for selection: biased, with experts outside ``allowed`` (and outside the
        kept groups) at -inf."""
        choice = g if self.selection_bias is None else g + self.selection_bias
        if allowed is not None:
            choice = choice.masked_fill(~allowed, float("-inf"))
        if self.group_limited:
            n = choice.shape[-1]
            grouped = choice.unflatten(-1, (self.groups, n // self.groups))
            best = grouped.topk(min(2, n // self.groups), dim=-1).values
            group_score = best.nan_to_num(neginf=-1e30).sum(-1)  # [..., groups]
            kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                -1, group_score.topk(self.groups_kept, dim=-1).indices, True)
            choice = choice.masked_fill(~kept.repeat_interleave(n // self.groups, -1),
                                        float("-inf"))
        return choice

    def select(self, g: torch.Tensor, allowed: torch.Tensor | None = None):
        """``(T_k indices [..., k], whether each slot found an allowed expert [..., k])``."""
        values, idx = self._choice(g, allowed).topk(self.top_k, dim=-1)
        return idx, torch.isfinite(values)

    def mix(self, g: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor | None = None):
        """Mixing weights ``ḡ [..., k]`` of the selected experts (0 for invalid slots)."""
        w = g.gather(-1, idx)
        if valid is not None:
            w = w * valid
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + self.renormalize_eps)
        w = w * self.scale if self.scale != 1.0 else w
        if self.weight_dtype is not None and self.weight_dtype != w.dtype:
            w = w.to(self.weight_dtype).to(w.dtype)
        return w

    def route(self, g: torch.Tensor, allowed: torch.Tensor | None = None):
        """``(indices, weights)`` of the rule, optionally restricted to ``allowed`` experts."""
        idx, valid = self.select(g, allowed)
        return idx, self.mix(g, idx, None if allowed is None else valid)

    def for_layers(self, biases: torch.Tensor | None) -> RoutingRule:
        """The same rule with per-row selection biases ``[T, 1, N]`` (a batch of layers)."""
        from dataclasses import replace
        return replace(self, selection_bias=biases)
