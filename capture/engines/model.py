"""The model's facts routing is checked against, from its ``config.json`` alone (no weights):
N routed experts, top-k, decoder layers, which of them have a sparse MoE block (the family's
dense-layer rule) and how many shared experts run beside the routed ones, as
:func:`moe.families.facts` reads them.

``--model`` takes what ``capture`` takes (an alias, a hub id in the local cache, a folder with
a ``config.json``); the config is read with ``transformers.AutoConfig`` (its defaults fill keys a
config leaves out), offline.
"""

from __future__ import annotations

from moe_spec.capture.engines.base import ModelFacts
from moe_spec.errors import UserError
from moe_spec.moe import families, models

MAX_LAYERS = 4096  # decoder layers (the layer column is int16; real models have < 200)
MAX_EXPERTS = 32767  # routed experts (ids are stored as int16)


class ModelFactsError(UserError, ValueError):
    """A --model whose config does not say what routing needs; one line."""


def _check_size(model: str, name: str, value, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        shown = repr(value)[:40] if not isinstance(value, int) or abs(value) < 10**9 else \
            f"a {len(str(abs(value)))}-digit number"
        raise ModelFactsError(f"the config of {model!r} says {name} = {shown}: not within 1 "
                              f"… {high} (a model this workbench can read)")


def model_facts(model: str) -> ModelFacts:
    """Resolve ``--model`` and read its facts, or raise one line."""
    try:
        source = models.resolve(model)
    except models.ModelError as exc:
        raise ModelFactsError(str(exc)) from None
    # config.json (its text config), its depth checked before transformers builds per-layer
    # lists from it
    stated = families.config_view(models.read_config(model))
    depth = families.facts(stated).stated_layers
    _check_size(model, families.LAYERS_KEY, 1 if depth is None else depth, MAX_LAYERS)
    models.quiet_transformers()
    from transformers import AutoConfig
    try:  # a hub id: its config.json from the local cache (or the hub where it is reachable)
        cfg = AutoConfig.from_pretrained(source.location)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = ("; offline, put the model's config.json (no weights needed) in a folder and "
                "pass that folder" if source.hub_id else "")
        raise ModelFactsError(f"cannot read the config of {model!r} ({source.location}): "
                              f"{first[:160]}{hint}") from None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # what config.json says (read once, its size checked above) wins over class defaults
    merged = {**cfg.to_dict(), **{k: v for k, v in vars(stated).items() if v is not None}}
    found = families.facts(merged)
    if found.stated_layers is None:
        raise ModelFactsError(f"the config of {model!r} names no {families.LAYERS_KEY}")
    if not (found.num_experts and found.top_k):
        raise ModelFactsError(f"the config of {model!r} names no routed experts and top-k "
                              f"(one of {', '.join(models.EXPERT_COUNT_KEYS)} and "
                              "num_experts_per_tok): not a MoE model")
    n, k = found.num_experts, found.top_k
    for name, value, high in (("routed experts", n, MAX_EXPERTS), ("top-k", k, n)):
        _check_size(model, name, value, high)
    if not found.moe_layers:
        raise ModelFactsError(f"the config of {model!r} has no MoE layer (every layer dense)")
    return ModelFacts(name=source.name, location=source.location, model_type=found.model_type,
                      num_experts=n, top_k=k,
                      num_layers=found.num_layers, moe_layers=found.moe_layers,
                      shared_experts=found.shared_experts, hidden_size=found.hidden_size)


def facts_of_run(manifest: dict) -> ModelFacts:
    """A run's facts as its manifest states them (what an export writes against)."""
    return ModelFacts(name=manifest["model"], location=manifest.get("model_location") or "",
                      model_type=manifest.get("model_type") or "",
                      num_experts=int(manifest["num_experts"]), top_k=int(manifest["top_k"]),
                      num_layers=int(manifest.get("num_layers") or
                                     max(manifest["moe_layers"]) + 1),
                      moe_layers=tuple(int(x) for x in manifest["moe_layers"]),
                      shared_experts=int(manifest.get("shared_experts") or 0),
                      hidden_size=manifest.get("hidden_size"))
