"""How one MoE layer routes: scores, top-k selection and mixing weights (DESIGN.md, Families).

For router logits ``z_t ∈ R^N`` of token t::

    scores     g_t = softmax(z_t)                or  sigmoid(z_t)             (score)
    selection  T_k(t) = top-k of g_t + bias      (selection_bias; 0 for most families)
               group-limited: keep the ``groups_kept`` of ``groups`` expert groups with the
               largest sum of their two best biased scores, then top-k within them
    mixing     ḡ_i(t) = g_i(t) for i ∈ T_k(t),   / Σ_{j∈T_k(t)} g_j(t) when ``renormalize``,
               × ``scale``

Ties are broken the same way everywhere: among equal selection scores the lower expert id wins
(:func:`top_k_lowest_id`), and a token's slots are stored by decreasing weight, ties by id
(:func:`canonical_slots`).

The rule's flags are those serving engines take (vLLM ``FusedMoE`` / SGLang ``select_experts``;
groups > 1 is their ``use_grouped_topk``):

| RoutingRule | vLLM / SGLang | HF config |
|---|---|---|
| ``top_k`` | ``top_k`` | ``num_experts_per_tok`` |
| ``score`` | ``scoring_func`` | (family) |
| ``renormalize`` | ``renormalize`` | ``norm_topk_prob`` (or the family) |
| ``scale`` | ``routed_scaling_factor`` | ``routed_scaling_factor`` |
| ``selection_bias`` | ``e_score_correction_bias`` | router buffer |
| ``groups``, ``groups_kept`` | ``num_expert_group``, ``topk_group`` | ``n_group``, ``topk_group`` |

Mixing is owned by one object, :class:`Mixing` (``rule.mixing``): the routers' weights
(:meth:`Mixing.weights`) and the closed form ``ḡ_i = a(Z) g_i`` the substitution oracle scores
with (:meth:`Mixing.coefficient`). A run's manifest records the rule as a dict
(:meth:`RoutingRule.to_dict`; :meth:`RoutingRule.from_manifest` also reads older manifests, which
carry only ``top_k`` and the ``renormalize`` bool).

Under an expert budget S, substitution applies the same rule with every expert outside S
removed (selection among S only, mixing over what was selected); a token whose natural top-k
lies inside S keeps its experts and weights unchanged (:mod:`policy.coverage`). Group-limited
routing keeps the token's own groups (chosen from all N scores) and fills from S's other
groups only when its groups hold fewer than k experts of S. ``moe.families`` builds one
rule per model family from its config; tests build them directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

import torch

SCORES = ("softmax", "sigmoid")
GROUP_TIER = 2.0 ** 20  # substitution's offset for experts outside a token's kept groups


def top_k_lowest_id(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices) [..., k]`` of the k largest entries of ``x [..., N]``, by decreasing
    value, **ties to the lower index** wherever they fall (inside the top-k or at its boundary).
    ``torch.topk`` leaves the order of equal values to the implementation (bf16 router scores tie
    often); this rule is the same on every device, in capture, replay and the online budget."""
    n = x.shape[-1]
    if k >= n:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    values, idx = x.topk(k + 1, dim=-1)  # sorted, ties in any order
    tied = values[..., k - 1] == values[..., k]  # the boundary splits a tie: search the row
    if bool(tied.any()):
        v, i = torch.sort(x[tied], dim=-1, descending=True, stable=True)
        values, idx = values.clone(), idx.clone()
        values[tied], idx[tied] = v[..., : k + 1], i[..., : k + 1]
    values, idx = values[..., :k], idx[..., :k]
    by_id = idx.argsort(-1)  # then a stable sort by value keeps equal values by id
    values, idx = values.gather(-1, by_id), idx.gather(-1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(-1, by_value), idx.gather(-1, by_value)


def canonical_slots(idx: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k slots of every token ordered by decreasing mixing weight, ties (and zero-weight
    slots) by increasing expert id: the order ``topk_ids`` are stored in (DESIGN.md)."""
    by_id = idx.argsort(-1)
    idx, weights = idx.gather(-1, by_id), weights.gather(-1, by_id)
    by_weight = weights.argsort(dim=-1, descending=True, stable=True)
    return idx.gather(-1, by_weight), weights.gather(-1, by_weight)


@dataclass(frozen=True)
class Mixing:
    """How a token's selected scores become mixing weights. With ``Z = Σ_{j∈T_k(t)} g_j`` the
    selected experts' score mass, every weight is the score times one coefficient::

        ḡ_i(t) = a(Z) · g_i(t),   a(Z) = s / (Z + ε)   when ``renormalize`` (0 where Z = 0)
                                  a(Z) = s             otherwise

    with s = ``scale`` (``routed_scaling_factor``) and ε = ``eps`` (DeepSeek-V3: 1e-20). The one
    place mixing is defined: a renormalisation not of this form must change both methods here,
    and the substitution oracle, which scores with :meth:`coefficient`, follows."""

    renormalize: bool = False
    scale: float = 1.0
    eps: float = 0.0

    def coefficient(self, mass: torch.Tensor) -> torch.Tensor | float:
        """``a(Z)`` of the class docstring for score masses ``mass`` (a float when constant)."""
        if not self.renormalize:
            return self.scale
        return torch.where(mass > 0, self.scale / (mass + self.eps), torch.zeros_like(mass))

    def weights(self, kept: torch.Tensor) -> torch.Tensor:
        """``ḡ [..., k]`` from the selected scores ``kept [..., k]`` (0 in slots to leave out),
        computed as the routers do (divide by ``Z + ε``, then scale): the same values as
        ``coefficient(Z) · kept`` up to rounding, bit for bit the model's."""
        if self.renormalize:
            kept = kept / (kept.sum(-1, keepdim=True) + self.eps)
        return kept * self.scale if self.scale != 1.0 else kept

    def describe(self) -> str:
        """In words, for ``inspect-model``."""
        text = "renormalised weights" if self.renormalize else "raw weights"
        return text if self.scale == 1.0 else f"{text} × {self.scale:g}"


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
    def mixing(self) -> Mixing:
        """The rule's mixing weights (:class:`Mixing`)."""
        return Mixing(self.renormalize, self.scale, self.renormalize_eps)

    @property
    def group_limited(self) -> bool:
        return self.groups > 1 and self.groups_kept < self.groups

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """``g``: the router scores of every expert, float32 ``[..., N]``."""
        logits = logits.float()
        return torch.softmax(logits, -1) if self.score == "softmax" else torch.sigmoid(logits)

    def kept_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: ``[..., N]`` bool, the experts of the ``groups_kept`` groups with
        the largest sum of their two best selection scores (ties to the lower group id), computed
        from all N scores: the token's own groups, whatever a shortlist keeps."""
        n = choice.shape[-1]
        size = n // self.groups
        best = choice.unflatten(-1, (self.groups, size)).topk(min(2, size), dim=-1).values
        _, top = top_k_lowest_id(best.sum(-1), self.groups_kept)
        kept = torch.zeros(*choice.shape[:-1], self.groups, dtype=torch.bool,
                           device=choice.device).scatter_(-1, top, True)
        return kept.repeat_interleave(size, -1)

    def selection_scores(self, g: torch.Tensor, allowed: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """Scores the top-k is taken of: ``g`` plus any selection bias, ``-inf`` outside
        ``allowed``. Group-limited, without ``allowed``: ``-inf`` outside the token's kept groups
        (the model's rule). With ``allowed`` (substitution), experts of S outside the token's kept
        groups rank after every expert of S inside them (float64, offset by 2²⁰: order within each
        tier is exact), so S ⊇ T_k(t) selects T_k(t) again and no token gets fewer than
        min(k, |S|) experts."""
        choice = g if self.selection_bias is None else g + self.selection_bias
        if self.group_limited:
            inside = self.kept_groups(choice)
            if allowed is None:
                choice = choice.masked_fill(~inside, float("-inf"))
            else:
                choice = choice.double() - GROUP_TIER * (~inside).double()
        if allowed is not None:
            choice = choice.masked_fill(~allowed, float("-inf"))
        return choice

    def substitution_scores(self, g: torch.Tensor) -> torch.Tensor:
        """The order substitution selects in (:meth:`selection_scores` with every expert
        allowed): group-limited, a token's kept groups a fixed tier above its other experts."""
        return self.selection_scores(g, torch.ones_like(g, dtype=torch.bool))

    def select(self, g: torch.Tensor, allowed: torch.Tensor | None = None):
        """``(T_k indices [..., k], whether each slot found an allowed expert [..., k])``, by
        decreasing selection score, ties to the lower expert id (:func:`top_k_lowest_id`)."""
        values, idx = top_k_lowest_id(self.selection_scores(g, allowed), self.top_k)
        return idx, torch.isfinite(values)

    def mix(self, g: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor | None = None):
        """Mixing weights ``ḡ [..., k]`` of the selected experts (0 for invalid slots)."""
        w = g.gather(-1, idx)
        if valid is not None:
            w = w * valid
        w = self.mixing.weights(w)
        if self.weight_dtype is not None and self.weight_dtype != w.dtype:
            w = w.to(self.weight_dtype).to(w.dtype)
        return w

    def route(self, g: torch.Tensor, allowed: torch.Tensor | None = None):
        """``(indices, weights)`` of the rule, optionally restricted to ``allowed`` experts, in
        canonical slot order (:func:`canonical_slots`)."""
        idx, valid = self.select(g, allowed)
        return canonical_slots(idx, self.mix(g, idx, None if allowed is None else valid))

    def natural(self, g: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor):
        """The router module's own top-k ``(idx [M, k], weights [M, k])`` in canonical slot order
        (long, float32), and whether any token's set was replaced: where the module's set differs
        from this rule's (equal scores at the k-th place, which ``torch.topk`` breaks in an
        implementation-defined way, e.g. bf16 routers), the rule's lower-id choice and its
        weights. Everywhere else the module's own weights are kept bit for bit."""
        idx, weights = canonical_slots(idx.long(), weights.float())
        mine_idx, mine_w = self.route(g)
        same = (idx.sort(-1).values == mine_idx.sort(-1).values).all(-1, keepdim=True)
        if bool(same.all()):
            return idx, weights, False
        return (torch.where(same, idx, mine_idx), torch.where(same, weights, mine_w.float()),
                True)

    def for_layers(self, biases: torch.Tensor | None) -> RoutingRule:
        """The same rule with per-row selection biases ``[T, 1, N]`` (a batch of layers)."""
        return replace(self, selection_bias=biases)

    def describe(self) -> str:
        """The rule in words (``inspect-model``), e.g. ``sigmoid scores, selection bias, top-k
        within 4 of 8 groups, renormalised weights × 2.5``."""
        parts = [f"{self.score} scores"]
        if self.selection_bias is not None:
            parts.append("selection bias")
        if self.group_limited:
            parts.append(f"top-k within {self.groups_kept} of {self.groups} groups")
        parts.append(self.mixing.describe())
        return ", ".join(parts)

    # --- the record in a run's manifest ---------------------------------------------------------
    def to_dict(self) -> dict:
        """The rule as JSON-ready values, one key per field. A selection bias is a per-layer
        router buffer, not part of the record: ``selection_bias`` says only whether there is one
        (:meth:`from_dict` takes the tensor)."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["selection_bias"] = self.selection_bias is not None
        if self.weight_dtype is not None:
            record["weight_dtype"] = str(self.weight_dtype).removeprefix("torch.")
        return record

    @classmethod
    def from_dict(cls, record: dict, selection_bias: torch.Tensor | None = None) -> RoutingRule:
        """The rule :meth:`to_dict` recorded; ``selection_bias`` supplies the tensor a biased rule
        needs (a record that says it has one cannot be rebuilt without it)."""
        known = {f.name for f in fields(cls)}
        unknown = set(record) - known
        if unknown:
            raise ValueError(f"unknown routing rule field(s) {', '.join(sorted(unknown))}")
        if bool(record.get("selection_bias")) != (selection_bias is not None):
            raise ValueError("the recorded rule " + ("selects with a bias: pass selection_bias"
                             if record.get("selection_bias") else "has no selection bias"))
        values = {**record, "selection_bias": selection_bias}
        if values.get("weight_dtype") is not None:
            values["weight_dtype"] = getattr(torch, values["weight_dtype"])
        return cls(**values)

    def to_json(self) -> str:
        """:meth:`to_dict` as the JSON text of the ``routing_rule`` column (catalog.schema)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_manifest(cls, manifest: dict, selection_bias: torch.Tensor | None = None
                      ) -> RoutingRule:
        """A run's rule from its manifest: the ``routing_rule`` record (a dict, or its JSON text
        as in the ``runs`` table), or, in manifests written before it, the plain softmax top-k
        rule that ``top_k`` and the ``renormalize`` bool describe."""
        record = manifest.get("routing_rule")
        if record is None:
            return cls(top_k=int(manifest["top_k"]),
                       renormalize=bool(manifest.get("renormalize", False)))
        if isinstance(record, str):
            record = json.loads(record)
        return cls.from_dict(record, selection_bias)
