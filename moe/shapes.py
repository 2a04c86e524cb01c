"""The real models' shapes, and random-weight models built with them on the fly.

Each entry is the architecture of a real checkpoint (widths, expert counts, routing, attention,
depth and vocabulary, from its published ``config.json``). The cost model projects onto these
shapes; benchmarks and tests build random-weight models with the real widths and routing but
only one or two decoder layers and a small vocabulary (:func:`random_model`), so that a real
shape's per-layer work runs on a laptop. Those models are never committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_spec.moe.families import REGISTRY, lookup


@dataclass(frozen=True)
class RealShape:
    name: str  # the registry alias
    checkpoint: str
    model_type: str
    config: dict = field(default_factory=dict)

    def build_config(self, **overrides):
        from transformers import AutoConfig
        return AutoConfig.for_model(self.model_type, **{**self.config, **overrides})


# alias -> the real checkpoint's shape, derived from the families' records (moe/families/)
REAL_SHAPES = {f.alias: RealShape(f.alias, f.hub_id, f.model_type, f.real_config)
               for f in REGISTRY.values()}


def random_model(name: str, *, layers: int = 1, vocab_size: int = 4096, seed: int = 0,
                 dtype=None):
    """A random-weight model with the real widths and routing of ``name`` (weights drawn with
    the family's own initialisation), ``layers`` decoder layers and a small vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM
    shape = REAL_SHAPES[name]
    family = lookup(shape.model_type)
    extra = family.shallow_config(layers) if family else {}  # e.g. layer types cut to its depth
    cfg = shape.build_config(num_hidden_layers=layers, vocab_size=vocab_size,
                             tie_word_embeddings=False, pad_token_id=1, eos_token_id=0,
                             bos_token_id=None, **extra)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32).eval()


def save_random_model(name: str, out: Path, *, layers: int = 1, seed: int = 0,
                      tokenizer_from: Path | None = None) -> Path:
    """:func:`random_model` saved as a Hugging Face folder (with a tokenizer whose vocabulary
    fits, by default the embedded tiny model's of the same family) that ``--model`` loads."""
    from transformers import AutoTokenizer

    from moe_spec.moe.models import EMBEDDED_DIR
    tok_dir = tokenizer_from or EMBEDDED_DIR / lookup(REAL_SHAPES[name].model_type).tiny.name
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model = random_model(name, layers=layers, vocab_size=len(tokenizer), seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
