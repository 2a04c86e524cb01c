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


@dataclass(frozen=True)
class RealShape:
    name: str  # the registry alias
    checkpoint: str
    model_type: str
    config: dict = field(default_factory=dict)

    def build_config(self, **overrides):
        from transformers import AutoConfig
        return AutoConfig.for_model(self.model_type, **{**self.config, **overrides})


REAL_SHAPES = {s.name: s for s in (
    RealShape("olmoe", "allenai/OLMoE-1B-7B-0924", "olmoe", dict(
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, num_attention_heads=16, num_key_value_heads=16,
        num_hidden_layers=16, vocab_size=50304, max_position_embeddings=4096)),
    RealShape("qwen3-moe", "Qwen/Qwen3-30B-A3B", "qwen3_moe", dict(
        hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_hidden_layers=48, vocab_size=151936,
        max_position_embeddings=40960)),
    RealShape("mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000,
        max_position_embeddings=32768)),
    RealShape("deepseek-v3", "deepseek-ai/DeepSeek-V3", "deepseek_v3", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
        num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
        num_hidden_layers=61, vocab_size=129280, max_position_embeddings=163840)),
    RealShape("gpt-oss", "openai/gpt-oss-20b", "gpt_oss", dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        num_hidden_layers=24, vocab_size=201088, max_position_embeddings=131072)),
)}


def random_model(name: str, *, layers: int = 1, vocab_size: int = 4096, seed: int = 0,
                 dtype=None):
    """A random-weight model with the real widths and routing of ``name`` (weights drawn with
    the family's own initialisation), ``layers`` decoder layers and a small vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM
    shape = REAL_SHAPES[name]
    extra = {}
    if shape.model_type == "gpt_oss":  # sliding and full attention alternate
        extra["layer_types"] = ["sliding_attention", "full_attention"] * layers
        extra["layer_types"] = extra["layer_types"][:layers]
    if shape.model_type == "deepseek_v3":  # keep the MoE layers (the real first 3 are dense)
        extra["first_k_dense_replace"] = 0
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

    from moe.models import EMBEDDED_DIR
    tok_dir = tokenizer_from or EMBEDDED_DIR / f"tiny-{name}"
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model = random_model(name, layers=layers, vocab_size=len(tokenizer), seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
