"""EAGLE draft heads: EAGLE-3 (fused three-layer target features) and EAGLE-1/2.

Both read and write the official checkpoint layout (``config.json`` + ``model.safetensors`` or
``pytorch_model.bin``, native key names) and refuse any missing or unexpected key: the official
loader's ``strict=False`` silently leaves mismatched weights random.

EAGLE-3 (SafeAILab ``cnets.Model``), target hidden Ht, draft hidden H::

    fc        : Linear(3·Ht → H), applied only to target features (width ≠ H)
    midlayer  : e = input_layernorm(embed(tok)); h' = hidden_norm(h); x = [e; h']  (2H)
                h = h + o_proj(Attn(q,k,v = Linear(2H → ·)(x)));  h = h + MLP(post_attention_layernorm(h))
    logits    : lm_head(norm(h)) over the draft vocabulary; target id = draft id + d2t[draft id]
    recurrent : the un-normed midlayer output h feeds the next tree level

EAGLE-1/2 (``cnets1.Model``, the public Mixtral head)::

    x = fc([embed(tok); feature])  (2H → H, bias);  Llama decoder layers (layer 0 without its
    input_layernorm);  logits = target lm_head(x);  feature = the target's final post-norm hidden
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moe_spec.errors import UserError
from moe_spec.moe import families


class DraftHeadError(UserError, ValueError):
    """A draft head that cannot be loaded or does not fit its target; one line for the user."""


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_hidden_layers: int = 1
    bias: bool = True  # EAGLE-1 fc bias
    # HF hidden_states indices (= inputs of these decoder layers) fused as EAGLE-3 features
    feature_layers: list[int] | None = None
    eagle_version: int = 3
    # Which target the head was trained for (``model_type`` and layer count); official
    # checkpoints do not say, heads trained here do, and a mismatch is refused.
    target_model_type: str | None = None
    target_num_layers: int | None = None
    architectures: list[str] = field(default_factory=lambda: ["Eagle3DraftHead"])

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, raw: dict) -> "DraftConfig":
        known = {f for f in cls.__dataclass_fields__}
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        if cfg.feature_layers is None:
            # SpecForge/SGLang exports name layer *outputs*: output i is the input of layer i+1.
            ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if ids:
                cfg.feature_layers = [i + 1 for i in ids]
        if isinstance(raw.get("rope_scaling"), dict) and raw["rope_scaling"].get("rope_theta"):
            cfg.rope_theta = raw["rope_scaling"]["rope_theta"]
        return cfg


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default: inputs of decoder layers {2, L//2, L-3} (HF hidden_states indices)."""
    return [2, num_layers // 2, num_layers - 3]


# --- building blocks ----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(positions: torch.Tensor, dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama rotary tables ``[T, dim]`` for integer positions ``[T]`` (``[B, 1, T, dim]`` for
    per-sequence positions ``[B, T]``, broadcasting over heads)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device).float() / dim)
    ang = positions.float()[..., None] * inv
    if ang.dim() == 3:
        ang = ang[:, None]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Multi-head attention with GQA, explicit positions, a KV prefix and a boolean mask."""

    def __init__(self, cfg: DraftConfig, in_dim: int):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.dim_head, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(in_dim, nh * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)

    def forward(self, x, positions, past: tuple | None, mask: torch.Tensor):
        """x ``[B, T, in]``, positions ``[T]`` or ``[B, T]``, past ``(k, v)`` each ``[B, nkv, P, hd]``,
        mask ``[B or 1, 1, T, P+T]`` (True = attend). Returns (out, (k_all, v_all))."""
        b, t, _ = x.shape
        hd, nh, nkv = self.cfg.dim_head, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.q_proj(x).view(b, t, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        cos, sin = rope(positions, hd, self.cfg.rope_theta, x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        rep = nh // nkv
        out = nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, nh * hd)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's single decoder layer over ``[input_layernorm(embed); hidden_norm(hidden)]``."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, emb, hidden, positions, past, mask):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        attn, kv = self.self_attn(x, positions, past, mask)
        hidden = hidden + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


class LlamaLayer(nn.Module):
    """A Llama decoder layer (EAGLE-1 heads; layer 0 has no input_layernorm)."""

    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        self.input_layernorm = None if first else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, hidden, positions, past, mask):
        x = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        attn, kv = self.self_attn(x, positions, past, mask)
        hidden = hidden + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


# --- heads --------------------------------------------------------------------------------------


class DraftHead(nn.Module):
    """What the tree builder needs from any EAGLE head.

    ``forward(features, input_ids, positions, past, mask) -> (hidden, past)`` runs the head on
    ``B×T`` (feature, token) pairs; ``logits(hidden)`` gives draft-vocabulary logits and
    ``to_target_ids`` maps draft ids to target ids. ``past`` is a list of per-layer (k, v).
    """

    config: DraftConfig

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if getattr(self, "d2t", None) is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items()
                 if not k.startswith(("embed_tokens", "target_lm_head"))}
        save_file(state, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")


class Eagle3Draft(DraftHead):
    def __init__(self, cfg: DraftConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = cfg
        target_h = cfg.target_hidden_size or cfg.hidden_size
        self.embed_tokens = embed_tokens  # the target's, frozen
        self.fc = nn.Linear(3 * target_h, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab, bias=False)
        if cfg.draft_vocab != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    def forward(self, features, input_ids, positions, past=None, mask=None):
        hidden = self.fc(features) if features.shape[-1] != self.config.hidden_size else features
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        hidden, kv = self.midlayer(emb, hidden, positions, past[0] if past else None, mask)
        return hidden, [kv]

    def logits(self, hidden):
        return self.lm_head(self.norm(hidden))


class Eagle1Draft(DraftHead):
    def __init__(self, cfg: DraftConfig, embed_tokens: nn.Embedding, target_lm_head: nn.Module):
        super().__init__()
        self.config = cfg
        self.embed_tokens = embed_tokens
        self.target_lm_head = target_lm_head
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.layers = nn.ModuleList(LlamaLayer(cfg, i == 0) for i in range(cfg.num_hidden_layers))
        self.d2t = None

    def forward(self, features, input_ids, positions, past=None, mask=None):
        emb = self.embed_tokens(input_ids).to(features.dtype)
        hidden = self.fc(torch.cat([emb, features], dim=-1))
        new = []
        for i, layer in enumerate(self.layers):
            hidden, kv = layer(hidden, positions, past[i] if past else None, mask)
            new.append(kv)
        return hidden, new

    def logits(self, hidden):
        return self.target_lm_head(hidden)


# --- loading ------------------------------------------------------------------------------------


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "pytorch_model.bin").is_file():  # the official loader tries .bin first
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    raise DraftHeadError(f"draft head folder {folder} has neither pytorch_model.bin nor "
                         "model.safetensors")


def new_eagle3(target: nn.Module, *, intermediate_size: int, draft_vocab_size: int | None = None,
               feature_layers: list[int] | None = None) -> Eagle3Draft:
    """A fresh EAGLE-3 head for ``target`` (linear weights N(0, 0.02)); with a smaller
    ``draft_vocab_size`` the caller fills the ``d2t``/``t2d`` mapping."""
    t = families.facts(target.config)  # the target's (the draft head's own config is cfg)
    cfg = DraftConfig(hidden_size=t.hidden_size, intermediate_size=intermediate_size,
                      num_attention_heads=t.heads, num_key_value_heads=t.heads,
                      vocab_size=t.vocab, draft_vocab_size=draft_vocab_size, rms_norm_eps=1e-6,
                      rope_theta=t.rope_theta or 10000.0,
                      feature_layers=feature_layers or default_feature_layers(t.num_layers),
                      target_model_type=t.model_type, target_num_layers=t.num_layers,
                      architectures=["Eagle3DraftHead"])
    head = Eagle3Draft(cfg, target.get_input_embeddings())
    for m in head.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    return head


def load_draft(folder: str | Path, target: nn.Module, eagle_version: int | None = None) -> DraftHead:
    """Load a draft head for ``target`` (a transformers causal LM), refusing any key mismatch
    and any head whose shapes do not fit the target."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise DraftHeadError(f"draft head folder {folder} has no config.json")
    raw = json.loads((folder / "config.json").read_text())
    cfg = DraftConfig.from_dict(raw)
    state = _read_state(folder)
    version = eagle_version or raw.get("eagle_version") or (3 if "midlayer.self_attn.q_proj.weight"
                                                            in state else 1)
    cfg.eagle_version = version
    t = families.facts(target.config)  # the target's facts (cfg: the draft head's own)
    embed = target.get_input_embeddings()
    trained_for = (cfg.target_model_type, cfg.target_num_layers)
    if cfg.target_model_type and trained_for != (t.model_type, t.num_layers):
        raise DraftHeadError(f"draft head {folder} was trained for a {cfg.target_model_type} "
                             f"target with {cfg.target_num_layers} layers, not this "
                             f"{t.model_type} with {t.num_layers}; pass its own --draft")
    if cfg.vocab_size != t.vocab:
        raise DraftHeadError(f"draft head {folder} has vocab {cfg.vocab_size} but the target has "
                             f"{t.vocab}: it was trained for another model")
    if version == 3:
        if (cfg.target_hidden_size or cfg.hidden_size) != t.hidden_size:
            raise DraftHeadError(f"draft head {folder} expects target hidden size "
                                 f"{cfg.target_hidden_size or cfg.hidden_size}, target has "
                                 f"{t.hidden_size}")
        head = Eagle3Draft(cfg, embed)
        if "embed_tokens.weight" in state:  # shipped when the draft's hidden differs
            embed = nn.Embedding.from_pretrained(state.pop("embed_tokens.weight"), freeze=True)
            head.embed_tokens = embed
        if cfg.feature_layers is None:
            cfg.feature_layers = default_feature_layers(t.num_layers)
        outside = [i for i in cfg.feature_layers if not 0 <= i < t.num_layers]
        if outside:
            raise DraftHeadError(f"draft head {folder} fuses the inputs of decoder layers "
                                 f"{cfg.feature_layers}, but the target has layers 0.."
                                 f"{t.num_layers - 1}; fix feature_layers in its "
                                 "config.json")
    else:
        head = Eagle1Draft(cfg, embed, target.get_output_embeddings())
        state.pop("embed_tokens.weight", None)
    expected = {k for k in head.state_dict() if not k.startswith(("embed_tokens", "target_lm_head"))}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise DraftHeadError(f"draft head {folder} does not match the EAGLE-{version} layout: "
                             f"missing {missing[:4]}{'…' if len(missing) > 4 else ''}, "
                             f"unexpected {unexpected[:4]}{'…' if len(unexpected) > 4 else ''}")
    own = head.state_dict()
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise DraftHeadError(f"draft head {folder}: {key} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(own[key].shape)}")
    head.load_state_dict(state, strict=False)
    param = next(target.parameters())
    return head.to(device=param.device, dtype=param.dtype).eval()

