"""Train the embedded tiny MoE models (``train-tiny``).

Each model is a real transformers architecture (OlmoeForCausalLM, Qwen3MoeForCausalLM,
MixtralForCausalLM) with the family's N, k, mixing-weight rule and load-balancing loss, shrunk to
hidden size 128 and 8 layers so that EAGLE-3's feature layers {2, L//2, L-3} = {2, 4, 5} are
distinct. Training is plain next-token cross-entropy plus ``router_aux_loss_coef`` times
transformers' own ``load_balancing_loss_func`` (what ``labels=…, output_router_logits=True``
returns), on the offline corpus of :mod:`training.corpus`.

tiny-deepseek-v3 balances as DeepSeek-V3 does instead: the auxiliary-loss-free selection bias
(:class:`BiasBalancer`, γ = 1e-3), plus its spec's :class:`RouterRecipe` (issue 28). With the
common recipe alone its sigmoid scores stayed near 0.5 and routing near-uniform (top-k mass 1.76×
uniform, entropy / log N 0.97 after 900 steps). Router weights at 5× the learning rate with the
usual weight decay and DeepSeek-V3's sequence-wise balance loss (α = 1e-4) reach 3.49× and 0.83
(load CV 0.59, held-out loss 3.533 vs 3.571) while the router logits stay below ~17, where float32
sigmoid scores would saturate at 1.0 and tie (10× without decay got 4.24× but saturated: the
module's top-k and the routing rule's lowest-id tie-break then disagree).

    train-tiny --model tiny-olmoe --steps 1500 --seed 0

writes ``data/models/tiny-olmoe/`` (config, fp16 safetensors, tokenizer, ``quality.json``).
Everything random draws from ``--seed``: the same command gives the same weights on the same
machine and library versions.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from moe_spec.catalog import atomic
from moe_spec.moe.families import REGISTRY, Family
from moe_spec.training import corpus, quality
from moe_spec.training.tokenizer import train_tokenizer

VOCAB_SIZE = 4096
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
              max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
              initializer_range=0.02, pad_token_id=1, eos_token_id=0, bos_token_id=None)


BIAS_UPDATE = 1e-3  # DeepSeek-V3's bias update speed γ


@dataclass(frozen=True)
class RouterRecipe:
    """How a bias-balanced (DeepSeek-V3) router is trained, beyond the common recipe.

    Its mixing weights are the selected sigmoid scores renormalised over the top-k, so the LM
    loss's gradient on ``s_i`` is scale-free among the selected (``Σ_i s_i ∂L/∂s_i = 0``) and
    zero for the rest: the scores only separate as fast as the router weights move. Hence:

    * ``lr_scale``: the router weights' learning rate is ``lr_scale`` × the schedule's;
    * ``weight_decay``: the router weights' AdamW decay (0: their logits are not shrunk);
    * ``gamma``: the selection bias's update speed γ (:class:`BiasBalancer`);
    * ``seq_aux``: α of DeepSeek-V3's sequence-wise balance loss (:func:`sequence_balance_loss`,
      averaged over MoE layers), added to the LM loss.
    """
    lr_scale: float = 1.0
    weight_decay: float = 0.1
    gamma: float = BIAS_UPDATE
    seq_aux: float = 0.0


@dataclass(frozen=True)
class TinySpec:
    """One embedded model: its transformers classes, the family's MoE settings and how the
    family balances expert load (``aux``: its load-balancing loss; ``bias``: DeepSeek-V3's
    auxiliary-loss-free update of the selection bias)."""
    model_cls: type
    config_cls: type
    config: dict = field(default_factory=dict)
    balancing: str = "aux"
    attn_implementation: str = "sdpa"
    router: RouterRecipe | None = None

    def build_config(self, **overrides):
        return self.config_cls(**{**COMMON, **self.config, **overrides})


def tiny_spec(family: Family) -> TinySpec:
    """The :class:`TinySpec` of a family's embedded model, built from its record
    (``moe.families.TinyModel``): the transformers config and causal-LM classes of its
    ``model_type``, its config overrides, balancing and router recipe, and the attention the
    family runs with."""
    config_cls = CONFIG_MAPPING[family.model_type]
    tiny = family.tiny
    return TinySpec(MODEL_FOR_CAUSAL_LM_MAPPING[config_cls], config_cls, dict(tiny.config),
                    balancing=tiny.balancing, attn_implementation=family.routing.attention,
                    router=RouterRecipe(**tiny.router) if tiny.router else None)


# tiny model name -> its spec, derived from the families' records (moe/families/: N, k and the
# mixing-weight rule follow the real checkpoints, DESIGN.md "Models"; the aux-loss coefficients
# are the real configs')
SPECS = {f.tiny.name: tiny_spec(f) for f in REGISTRY.values()}

# Share of training windows drawn from each source (stdlib dominates by size; the benchmark
# train splits teach the prompt templates capture uses).
MIXTURE = {"stdlib": 0.5, "gsm8k": 0.35, "mbpp": 0.15}


def token_streams(tokenizer, docs: dict[str, list[corpus.Document]]) -> dict[str, np.ndarray]:
    """One int32 stream per source: documents joined by EOS."""
    streams = {}
    for source, items in docs.items():
        ids = tokenizer([d.text for d in items], add_special_tokens=False)["input_ids"]
        flat = [t for seq in ids for t in (*seq, tokenizer.eos_token_id)]
        streams[source] = np.asarray(flat, dtype=np.int32)
    return streams


def sample_batch(streams: dict[str, np.ndarray], batch: int, seq: int,
                 rng: np.random.Generator, mixture: dict[str, float] = MIXTURE) -> torch.Tensor:
    """``batch`` random windows of ``seq`` tokens, each from a source drawn by ``mixture``."""
    names = list(mixture)
    picks = rng.choice(len(names), size=batch, p=[mixture[n] for n in names])
    rows = []
    for p in picks:
        stream = streams[names[p]]
        start = rng.integers(0, len(stream) - seq - 1)
        rows.append(stream[start:start + seq])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def bias_gates(model) -> list[torch.nn.Module]:
    """The routers that carry a selection bias (DeepSeek-V3's ``e_score_correction_bias``)."""
    gates = [getattr(layer.mlp, "gate", None) for layer in model.model.layers]
    return [g for g in gates if g is not None and hasattr(g, "e_score_correction_bias")]


def sequence_balance_loss(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one layer, ``Σ_i f_i P_i`` averaged over the
    batch's sequences: ``f_i = N/(k T) Σ_t 1[i ∈ T_k(t)]`` (no gradient), ``P_i = 1/T Σ_t
    s_i(t)/Σ_j s_j(t)`` with ``s = sigmoid(logits)``; ``logits`` [B, T, N], ``chosen`` [B, T, k].
    Equals 1 when routing is balanced within every sequence."""
    b, t, n = logits.shape
    s = logits.sigmoid()
    p = (s / s.sum(-1, keepdim=True)).mean(1)
    f = torch.zeros(b, n, device=logits.device).scatter_add_(
        1, chosen.reshape(b, -1), torch.ones(b, t * k, device=logits.device)) * (n / (k * t))
    return (f * p).sum(-1).mean()


class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, every layer's selection
    bias moves by γ towards under-loaded experts, ``b_i += γ·sign(mean load − load_i)``, from the
    top-k the routers chose in that step (counted by forward hooks). With ``seq_aux`` the hooks
    also keep each layer's :func:`sequence_balance_loss` of the step (``take_loss``)."""

    def __init__(self, model, gamma: float = BIAS_UPDATE, seq_aux: bool = False):
        self.gamma = gamma
        self.seq_aux = seq_aux
        self.counts: dict[torch.nn.Module, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.last_cv = 0.0
        for gate in bias_gates(model):
            gate.register_forward_hook(self._count)

    def _count(self, module, args, out):
        logits, _, idx = out
        counts = torch.bincount(idx.reshape(-1), minlength=module.num_experts).float()
        self.counts[module] = self.counts.get(module, 0) + counts
        if self.seq_aux and torch.is_grad_enabled():
            b, t = args[0].shape[:2]
            self.losses.append(sequence_balance_loss(
                logits.reshape(b, t, -1), idx.reshape(b, t, -1), idx.shape[-1]))

    def take_loss(self) -> torch.Tensor:
        """The mean over layers of this step's sequence-wise balance losses (then forgotten)."""
        loss, self.losses = torch.stack(self.losses).mean(), []
        return loss

    @torch.no_grad()
    def step(self) -> None:
        cvs = []
        for gate, load in self.counts.items():
            gate.e_score_correction_bias += self.gamma * torch.sign(load.mean() - load)
            cvs.append(float(load.std() / load.mean().clamp_min(1e-9)))
        self.last_cv = float(np.mean(cvs)) if cvs else 0.0
        self.counts = {}


def param_groups(model, router: RouterRecipe | None = None) -> list[dict]:
    """AdamW's groups: weight matrices (embeddings aside) decay by 0.1, the rest not; with a
    ``router`` recipe the bias-balanced routers' weights form a third group (its decay, its
    ``lr_scale``). Every group's learning rate is ``lr_scale`` × :func:`lr_at`."""
    routers = {id(g.weight) for g in bias_gates(model)} if router else set()
    params = [(n, p) for n, p in model.named_parameters() if id(p) not in routers]
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1, "lr_scale": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0}]
    if routers:
        groups.append({"params": [p for p in model.parameters() if id(p) in routers],
                       "weight_decay": router.weight_decay, "lr_scale": router.lr_scale})
    return groups


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(name: str, *, steps: int, batch: int, seq: int, lr: float, seed: int, out: Path,
          benchmarks_root=None) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    spec = SPECS[name]
    docs = corpus.load_corpus(benchmarks_root)
    train_docs = {s: corpus.split(d)[0] for s, d in docs.items()}
    tokenizer = train_tokenizer([d.text for ds in train_docs.values() for d in ds], VOCAB_SIZE)
    streams = token_streams(tokenizer, train_docs)

    config = spec.build_config()
    config._attn_implementation = spec.attn_implementation
    model = spec.model_cls(config)
    model.train()
    recipe = spec.router or RouterRecipe()
    balance = (BiasBalancer(model, recipe.gamma, seq_aux=recipe.seq_aux > 0)
               if spec.balancing == "bias" else None)
    opt = torch.optim.AdamW(param_groups(model, spec.router), lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=name, unit="step", disable=None)  # None: off unless a TTY
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup) * group["lr_scale"]
        ids = sample_batch(streams, batch, seq, rng)
        outputs = model(input_ids=ids, labels=ids, output_router_logits=balance is None)
        loss = outputs.loss
        if balance is not None and balance.seq_aux:
            loss = loss + recipe.seq_aux * balance.take_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if balance is not None:
            balance.step()
        if step % 20 == 0:
            aux = getattr(outputs, "aux_loss", None)
            bar.set_postfix(loss=f"{outputs.loss.item():.3f}",
                            **({"aux": f"{aux.item():.3f}"} if aux is not None else
                               {"load_cv": f"{balance.last_cv:.2f}"}))
    seconds = time.perf_counter() - start

    model.eval()
    training = dict(model=name, steps=steps, batch=batch, seq_len=seq, peak_lr=lr, seed=seed,
                    tokens=steps * batch * seq, seconds=round(seconds, 1),
                    tokens_per_second=round(steps * batch * seq / seconds),
                    torch=torch.__version__, threads=torch.get_num_threads(),
                    command=" ".join(["train-tiny", *sys.argv[1:]]))
    return save(model, tokenizer, out, training, benchmarks_root)


def save(model, tokenizer, out: Path, training: dict, benchmarks_root=None) -> dict:
    """Write the model atomically: a temporary folder beside ``out``, renamed when complete.

    Weights are stored in float16 (halves the repository's size); the quality record is measured
    on the saved weights as loaded back, so it describes exactly what users get.
    """
    with atomic.folder(out) as tmp:
        model.to(torch.float16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        reloaded = type(model).from_pretrained(
            tmp, dtype=torch.float32, attn_implementation=model.config._attn_implementation)
        reloaded_tok = AutoTokenizer.from_pretrained(tmp)
        record = quality.measure(reloaded, reloaded_tok, benchmarks_root)
        record["training"] = training
        (tmp / quality.FILENAME).write_text(json.dumps(record, indent=2) + "\n")
    return record
