"""Model registry and loading: ``--model`` takes an alias, a hub id or a local folder.

Everything loads through ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``; the embedded tiny models are ordinary Hugging Face folders
under ``data/models/``, so they exercise exactly the code path a real checkpoint takes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from moe_spec.errors import UserError
from moe_spec.moe import families
from moe_spec.moe.families import REGISTRY

if TYPE_CHECKING:
    import torch

# torch and transformers are imported where a model is loaded, never at import time: every
# command-line parser reads this registry, and `--help` must not wait for torch.

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DIR = REPO_ROOT / "data" / "models"
DRAFTS_DIR = REPO_ROOT / "data" / "drafts"
DEFAULT_MODEL = "tiny-olmoe"


class ModelError(UserError, ValueError):
    """A model that cannot be resolved or loaded; the message is one line for the user."""


@dataclass(frozen=True)
class Alias:
    name: str
    hub_id: str | None  # None for embedded models
    embedded_alternative: str | None = None
    draft: str | None = None  # default draft head (hub id); embedded: data/drafts/<name>
    feature_layers: tuple[int, ...] | None = None  # EAGLE-3 layers the default head expects

    @property
    def path(self) -> Path | None:
        return None if self.hub_id else EMBEDDED_DIR / self.name


# alias -> Alias, derived from the families' records (moe/families/): each family's real
# checkpoint, in family order, then each family's embedded tiny model
ALIASES = {a.name: a for a in (
    *(Alias(f.alias, f.hub_id, f.tiny.name, f.draft, f.feature_layers) for f in REGISTRY.values()),
    *(Alias(f.tiny.name, None) for f in REGISTRY.values()),
)}
EMBEDDED = tuple(name for name, a in ALIASES.items() if a.hub_id is None)


@dataclass(frozen=True)
class ModelSource:
    """Where a ``--model`` value points: a local folder or a hub id (never both)."""
    name: str  # the alias, or the value as given
    path: Path | None
    hub_id: str | None
    alias: Alias | None = None

    @property
    def location(self) -> str:
        return str(self.path) if self.path else self.hub_id


def resolve(model: str) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource`, or raise a one-line ModelError."""
    if model in ALIASES:
        alias = ALIASES[model]
        if alias.path is not None:
            if not (alias.path / "config.json").is_file():
                from moe_spec.console import command
                raise ModelError(f"embedded model {model!r} is missing from {alias.path}; "
                                 f"retrain it with `{command('train-tiny')} --model {model}`")
            return ModelSource(model, alias.path, None, alias)
        return ModelSource(model, None, alias.hub_id, alias)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"folder {path} has no config.json; pass a Hugging Face model folder")
        return ModelSource(model, path.resolve(), None)
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return ModelSource(model, None, model)
    raise ModelError(f"unknown model {model!r}; known aliases: {', '.join(ALIASES)}; "
                     "or pass a hub id (org/name) or a local model folder")


def _hub_is_cached(hub_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache
    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


def hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _ensure_available(source: ModelSource) -> None:
    """Fail at once, in one line, when a hub model is neither cached nor downloadable."""
    if source.hub_id is None or _hub_is_cached(source.hub_id) or hub_reachable():
        return
    alt = source.alias.embedded_alternative if source.alias else None
    hint = f"use --model {alt} (embedded, offline)" if alt else \
        f"use one of the embedded models ({', '.join(EMBEDDED)}) or a local folder"
    raise ModelError(f"model {source.name!r} ({source.hub_id}) is not in the local Hugging Face "
                     f"cache and the hub cannot be reached (offline); {hint}")


def check_available(model: str) -> ModelSource:
    """Resolve ``model`` and check it can load (a hub model cached or downloadable), without
    importing torch or transformers: commands call this before their heavy imports, so a model
    that cannot load is refused in one line at once. Raises :class:`ModelError`."""
    source = resolve(model)
    _ensure_available(source)
    return source


def read_config(model: str) -> dict | None:
    """The ``config.json`` of ``model`` as a dict, read without torch or transformers (a local
    folder, an embedded model, or a hub model already in the local cache); None where it is not
    at hand or cannot be read (the load that follows says why, in one line)."""
    import json
    try:
        source = resolve(model)
        if source.path is not None:
            path = source.path / "config.json"
        else:
            from huggingface_hub import try_to_load_from_cache
            found = try_to_load_from_cache(source.hub_id, "config.json")
            if not isinstance(found, str):
                return None
            path = Path(found)
        config = json.loads(path.read_text())
    except (ModelError, OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


EXPERT_COUNT_KEYS = families.EXPERT_COUNT_KEYS  # the config keys naming N, one per family


def expert_shape(config: dict | None) -> tuple[int, int] | None:
    """(N routed experts, top-k) a model's ``config.json`` names (the keys differ per family:
    :func:`moe.families.facts` reads them), or None where it names them not."""
    found = families.facts(config if isinstance(config, dict) else None)
    return (found.num_experts, found.top_k) if found.num_experts and found.top_k else None


def max_positions(config: dict | None) -> int | None:
    """The longest sequence a model's ``config.json`` admits (``max_position_embeddings``), or
    None where it names none."""
    return families.facts(config if isinstance(config, dict) else None).max_positions


def quiet_transformers() -> None:
    """Command-line tools print their own progress and one-line errors: silence transformers'
    weight-loading bars and advisory warnings."""
    from transformers.utils import logging
    logging.disable_progress_bar()
    logging.set_verbosity_error()


def pick_device(device: str = "auto") -> torch.device:
    import torch
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ModelError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for but CUDA is not available; use --device cpu")
    return dev


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # --dtype spelling -> torch dtype name


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA, fp32 on CPU."""
    import torch
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[dtype])


@dataclass
class LoadedModel:
    source: ModelSource
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.source.name


def load(model: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto",
         attn_implementation: str | None = None,
         experts_implementation: str = "eager", revision: str | None = None,
         trust_remote_code: bool = False) -> LoadedModel:
    """Resolve and load model + tokenizer (eval mode) on the chosen device and dtype.

    Attention defaults to the family's (``sdpa``, which accepts the 4-D tree masks of
    verification, or ``eager`` where transformers has nothing else); the ``eager`` experts loop
    is transformers' reference implementation, the one capture hooks into. ``revision`` and
    ``trust_remote_code`` are ``from_pretrained``'s (a hub branch, tag or commit; run the
    repository's own modelling code).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from moe_spec.moe.families import spec_for

    source = resolve(model)
    _ensure_available(source)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    location = source.location
    try:
        # the family first: an unsupported one is refused before any weight is read
        hub = dict(revision=revision, trust_remote_code=trust_remote_code)
        spec = spec_for(AutoConfig.from_pretrained(location, **hub))
        if attn_implementation is None:
            attn_implementation = spec.attention
        tokenizer = AutoTokenizer.from_pretrained(location, **hub)
        net = AutoModelForCausalLM.from_pretrained(
            location, dtype=dt, attn_implementation=attn_implementation,
            experts_implementation=experts_implementation, **hub)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"could not load model {source.name!r} from {location}: {first}") from exc
    net.to(dev).eval()
    return LoadedModel(source, net, tokenizer, dev, dt)


# Routing that says little about expert budgets (issue 28): top-k mass under this multiple of
# uniform's k/N, or entropy / log N above this. Meaningful routing has at least / at most these.
MEANINGFUL_TOPK_MASS_RATIO = 2.5
MEANINGFUL_ENTROPY_RATIO = 0.9


def near_uniform_routing(record: dict) -> str | None:
    """One line when a quality record's routing is near-uniform, else None."""
    r = record["routing"]
    ratio = r["mean"]["topk_mass"] / r["uniform_topk_mass"]
    entropy = r["mean"]["entropy_ratio"]
    if ratio >= MEANINGFUL_TOPK_MASS_RATIO and entropy <= MEANINGFUL_ENTROPY_RATIO:
        return None
    return (f"routing is near-uniform (top-k mass {ratio:.2f}× uniform, entropy / log N "
            f"{entropy:.2f}; meaningful routing has ≥ {MEANINGFUL_TOPK_MASS_RATIO}× and ≤ "
            f"{MEANINGFUL_ENTROPY_RATIO}): rankings and budgets measured on it say little")


def quality_record(location: str | Path) -> dict | None:
    """The ``quality.json`` a local model folder carries (embedded models), or None."""
    import json
    path = Path(location) / "quality.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def format_quality_record(record: dict) -> str:
    """The ``quality.json`` an embedded model carries, as a few lines of text."""
    h, r = record["heldout"], record["routing"]
    m = r["mean"]
    lines = [
        f"held-out loss {h['loss']:.3f} nats (unigram baseline {h['unigram_baseline']:.3f}) "
        f"over {h['tokens']} tokens; per source "
        + ", ".join(f"{s} {v:.3f}" for s, v in h["per_source"].items()),
        f"routing over {r['windows']} windows of {r['window_tokens']} tokens "
        f"(N={r['num_experts']}, k={r['top_k']}):",
        f"  top-k mass {m['topk_mass']:.3f} (uniform {r['uniform_topk_mass']:.3f}), "
        f"entropy/log N {m['entropy_ratio']:.3f}, load CV {m['load_cv']:.3f}",
        f"  top-N/2 share {m['top_half_share']:.3f}, unique experts per window "
        f"{m['unique_experts']:.1f} of {r['num_experts']}",
    ]
    return "\n".join(lines)
