"""Model families: everything the workbench knows about one family, in one record per module.

Every module of this folder is a family: it declares ``FAMILY``, a :class:`Family` holding the
family's routing rules (:class:`FamilySpec`), its public alias, hub checkpoint, default EAGLE
draft head and that head's feature layers, the real checkpoint's config (the cost model's target
shape), and its embedded tiny model (name, config overrides, load balancing, router training
recipe). Nothing else lists the families: :data:`REGISTRY` is found here (:func:`discover`), and
``moe.models.ALIASES``/``EMBEDDED``, ``moe.shapes.REAL_SHAPES``, :data:`FAMILIES` and
``training.tiny_moe.SPECS`` are derived from it, so adding a family is adding its module
(docs/architecture.md, "Add a model family").

transformers 5.x builds every sparse block from a router module returning ``(logits, top-k
weights, top-k indices)`` and an experts module with fused weights, called as
``experts(hidden, top_k_index, top_k_weights)``. What differs between families — and what the
workbench must never guess — is written in each family's :class:`FamilySpec`, one per
``model_type``:

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

This package imports neither torch nor transformers: every command-line parser reads the
registry (through ``moe.models``), and ``--help`` must not wait for them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable

from moe_spec.errors import UserError

if TYPE_CHECKING:
    from torch import nn

    from moe_spec.policy.routing import RoutingRule


class UnsupportedModelError(UserError, ValueError):
    """A model the workbench cannot replay faithfully; the message is one line."""


def no_dense_layers(config) -> set[int]:
    return set()


def no_overrides(layers: int) -> dict:
    return {}


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
    dense_layers: Callable[[object], set[int]] = no_dense_layers
    attention: str = "sdpa"  # the implementation tree verification runs with (4-D masks)

    def rule(self, config, router: nn.Module) -> RoutingRule:
        """The routing rule of one layer (its router holds any per-layer selection bias)."""
        from moe_spec.policy.routing import RoutingRule
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


@dataclass(frozen=True)
class TinyModel:
    """A family's embedded tiny model, as data: ``train-tiny --model <name>`` trains it into
    ``data/models/<name>/`` (training/tiny_moe.py builds its ``TinySpec`` from this).

    ``config`` is what it sets beyond the tiny models' common settings (``training.tiny_moe.
    COMMON``: hidden size 128, 8 layers, 4096-token vocabulary), passed to the family's
    transformers config class as keyword arguments; ``balancing`` is how the family balances
    expert load (``aux``: its load-balancing loss; ``bias``: DeepSeek-V3's auxiliary-loss-free
    update of the selection bias); ``router`` the fields of ``training.tiny_moe.RouterRecipe``
    for a bias-balanced router, or None. It trains with the family's ``FamilySpec.attention``."""

    name: str
    config: dict = field(default_factory=dict)
    balancing: str = "aux"  # "aux" | "bias"
    router: dict | None = None


def _int(value) -> int | None:
    """A positive int a config states (never a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def config_view(config):
    """A model config as attributes: a transformers config (its text config for a multimodal
    one) as it is, a ``config.json`` dict (its ``text_config`` where it nests one) as a
    namespace, None as an empty one."""
    from types import SimpleNamespace
    if config is None:
        return SimpleNamespace()
    if isinstance(config, dict):
        inner = config.get("text_config")
        return SimpleNamespace(**(inner if isinstance(inner, dict) else config))
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def any_family_dense_layers(config) -> set[int]:
    """The dense layers of a config of no registered family, by the keys every family uses:
    the first ``first_k_dense_replace``, those in ``mlp_only_layers``, those off the
    ``decoder_sparse_step``."""
    layers = int(config.num_hidden_layers)
    dense = set(range(min(int(getattr(config, "first_k_dense_replace", 0) or 0), layers)))
    dense |= {int(i) for i in (getattr(config, "mlp_only_layers", None) or [])}
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return dense | {i for i in range(layers) if (i + 1) % step != 0}


LAYERS_KEY = "num_hidden_layers"  # the config key of the decoder-layer count


@dataclass(frozen=True)
class ConfigFacts:
    """What the workbench reads of a model's config, read in one place (:meth:`Family.facts`,
    :func:`facts`): N routed experts and top-k, the decoder layers and which are dense, the
    always-on shared experts, and the widths the cost model needs. None where the config does
    not say (``dense_layers`` empty when the depth is unknown).

    ``stated_layers`` is the depth as the config states it, unchecked (``LAYERS_KEY``'s value,
    a string or 10**12 included): a size check reads it before anything builds per-layer lists.
    The dense layers are worked out on first use only, so reading the facts of a config stating
    an absurd depth costs nothing until they are asked for."""

    model_type: str
    num_experts: int | None  # N routed experts (the family's key: Family.experts_key)
    top_k: int | None
    num_layers: int | None
    shared_experts: int  # always-on shared experts beside the routed ones (never in a budget)
    hidden_size: int | None
    expert_inter: int | None  # one routed expert's intermediate width
    shared_inter: int  # the shared experts' intermediate width per MoE layer (0: none)
    dense_inter: int | None  # a dense layer's MLP width
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    vocab: int | None
    max_positions: int | None
    rope_theta: float | None  # the rotary base (``rope_theta``, or in ``rope_parameters``)
    stated_layers: object  # LAYERS_KEY's value as stated, unchecked (None: not stated)
    view: object = field(default=None, repr=False, compare=False)  # the config (config_view)
    dense_rule: Callable[[object], set[int]] = field(default=no_dense_layers, repr=False,
                                                     compare=False)

    @cached_property
    def dense_layers(self) -> frozenset[int]:
        """The decoder layers with a dense MLP, not experts (the family's rule)."""
        if not self.num_layers:
            return frozenset()
        try:  # (a family's rule may read a key a partial config.json leaves to the class default)
            return frozenset(self.dense_rule(self.view))
        except (AttributeError, TypeError):
            return frozenset(any_family_dense_layers(self.view))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder layers with a sparse MoE block."""
        return tuple(i for i in range(self.num_layers or 0) if i not in self.dense_layers)


def _rope_theta(cfg) -> float | None:
    params = getattr(cfg, "rope_parameters", None)
    theta = getattr(cfg, "rope_theta", None) or \
        (params.get("rope_theta") if isinstance(params, dict) else None)
    return theta if isinstance(theta, (int, float)) and not isinstance(theta, bool) else None


def read_facts(config, experts_keys: tuple[str, ...],
               dense_layers: Callable[[object], set[int]]) -> ConfigFacts:
    """:class:`ConfigFacts` of ``config`` (see :func:`config_view`), N from the first of
    ``experts_keys`` it states, the dense layers by ``dense_layers(config)``."""
    cfg = config_view(config)
    get = lambda key: getattr(cfg, key, None)  # noqa: E731
    layers = _int(get(LAYERS_KEY))
    n = next((v for v in map(_int, map(get, experts_keys)) if v), None)
    hidden, heads = _int(get("hidden_size")), _int(get("num_attention_heads"))
    inter = get("moe_intermediate_size") or get("intermediate_size")
    shared = get("n_shared_experts")
    if isinstance(shared, int):
        shared_inter = (shared or 0) * (inter or 0)
    else:  # one shared expert of its own width (Qwen2-MoE's layout)
        shared_inter = int(get("shared_expert_intermediate_size") or 0)
        shared = 1 if shared_inter > 0 else 0
    return ConfigFacts(
        model_type=str(get("model_type") or ""), num_experts=n,
        top_k=_int(get("num_experts_per_tok")), num_layers=layers,
        shared_experts=int(shared), hidden_size=hidden, expert_inter=inter,
        shared_inter=shared_inter, dense_inter=get("intermediate_size"), heads=heads,
        kv_heads=get("num_key_value_heads"),
        head_dim=get("head_dim") or (hidden // heads if hidden and heads else None),
        vocab=get("vocab_size"), max_positions=_int(get("max_position_embeddings")),
        rope_theta=_rope_theta(cfg), stated_layers=get(LAYERS_KEY), view=cfg,
        dense_rule=dense_layers)


@dataclass(frozen=True)
class Family:
    """Everything about one model family, in one place (one module of ``moe/families/``)."""

    routing: FamilySpec  # its routing rules; the family's ``model_type`` is routing.model_type
    alias: str  # the public ``--model`` alias of the real checkpoint
    hub_id: str  # the real checkpoint on the Hugging Face hub
    real_config: dict  # the real checkpoint's config.json (widths, experts, routing, depth, …)
    tiny: TinyModel  # the embedded tiny model of the family
    draft: str | None = None  # default EAGLE draft head (hub id) for the real checkpoint
    feature_layers: tuple[int, ...] | None = None  # EAGLE-3 layers that head expects
    experts_key: str = "num_experts"  # the config key naming N routed experts
    # config a random-weight model of the real shape with only ``layers`` layers needs
    # (moe.shapes.random_model), e.g. a layer-type list cut to its depth
    shallow_config: Callable[[int], dict] = no_overrides
    order: int = 100  # its place in every list of families, aliases and embedded models

    @property
    def model_type(self) -> str:
        return self.routing.model_type

    def facts(self, config) -> ConfigFacts:
        """What ``config`` (a transformers config or a ``config.json`` dict) says, read by this
        family's keys and dense-layer rule: the one reader of a model config."""
        return read_facts(config, (self.experts_key, *EXPERT_COUNT_KEYS),
                          self.routing.dense_layers)


def discover(package: str = __name__) -> dict[str, Family]:
    """Every module of ``package`` as a family, keyed by ``model_type``, in ``order`` (then
    module name). A module that declares no ``FAMILY`` is refused by name, so a stray file
    never silently drops out of the registry; so are two families claiming one model type,
    alias or tiny model name."""
    found = []
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise TypeError(f"{module.__file__} is in the families' folder but is no family: it "
                            "declares no FAMILY = Family(...)")
        found.append((family.order, info.name, family))
    registry: dict[str, Family] = {}
    names: set[str] = set()
    for _, module, family in sorted(found, key=lambda item: item[:2]):
        clash = sorted({family.model_type} & set(registry) | {family.alias, family.tiny.name} & names)
        if clash:
            raise ValueError(f"{package}.{module} declares {', '.join(clash)}, which another family "
                             "of the folder already declares")
        registry[family.model_type] = family
        names |= {family.alias, family.tiny.name}
    return registry


# model_type -> its family record, in order: the one list of families
REGISTRY: dict[str, Family] = discover()
# model_type -> routing spec (derived)
FAMILIES: dict[str, FamilySpec] = {t: f.routing for t, f in REGISTRY.items()}
# the config keys naming N routed experts, one per family (derived)
EXPERT_COUNT_KEYS: tuple[str, ...] = tuple(dict.fromkeys(f.experts_key for f in REGISTRY.values()))


def facts(config) -> ConfigFacts:
    """What a model's config says (:meth:`Family.facts` of its ``model_type``'s family; a
    config of no registered family by the keys every family uses). Code outside the family
    records reads a config only through this (``tests/test_family_recipe.py``)."""
    family = REGISTRY.get(getattr(config_view(config), "model_type", None))
    if family is not None:
        return family.facts(config)
    return read_facts(config, EXPERT_COUNT_KEYS, any_family_dense_layers)


def lookup(model_type: str | None = None, name: str | None = None) -> Family | None:
    """The family of a ``model_type`` (a config's), else of a model ``name`` (its public alias,
    hub id or tiny model's name), or None."""
    if model_type in REGISTRY:
        return REGISTRY[model_type]
    return next((f for f in REGISTRY.values() if name in (f.alias, f.hub_id, f.tiny.name)), None)


def spec_for(config) -> FamilySpec:
    model_type = getattr(config, "model_type", None)
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported MoE families: "
            f"{', '.join(FAMILIES)}") from None
