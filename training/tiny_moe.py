"""Train the embedded tiny MoE models (``train-tiny``).

Each model is a real transformers architecture (OlmoeForCausalLM, Qwen3MoeForCausalLM,
MixtralForCausalLM) with the family's N, k, mixing-weight rule and load-balancing loss, shrunk to
hidden size 128 and 8 layers so that EAGLE-3's feature layers {2, L//2, L-3} = {2, 4, 5} are
distinct. Training is plain next-token cross-entropy plus ``router_aux_loss_coef`` times
transformers' own ``load_balancing_loss_func`` (what ``labels=…, output_router_logits=True``
returns), on the offline corpus of :mod:`training.corpus`.

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
from transformers import (
    AutoTokenizer,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import console
from catalog import atomic
from moe import models
from moe.models import EMBEDDED_DIR
from training import corpus, quality
from training.tokenizer import train_tokenizer

VOCAB_SIZE = 4096
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
              max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
              initializer_range=0.02, pad_token_id=1, eos_token_id=0, bos_token_id=None)


@dataclass(frozen=True)
class TinySpec:
    """One embedded model: its transformers classes and the family's MoE settings."""
    model_cls: type
    config_cls: type
    config: dict = field(default_factory=dict)

    def build_config(self, **overrides):
        return self.config_cls(**{**COMMON, **self.config, **overrides})


# N, k and the mixing-weight rule follow the real checkpoints (DESIGN.md, "Models"); the aux-loss
# coefficients are the real configs' (OLMoE 0.01, Qwen3-30B-A3B 0.001, Mixtral-8x7B 0.02).
SPECS = {
    "tiny-olmoe": TinySpec(OlmoeForCausalLM, OlmoeConfig, dict(
        num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, intermediate_size=16,
        norm_topk_prob=False, router_aux_loss_coef=0.01)),
    "tiny-qwen3-moe": TinySpec(Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        num_key_value_heads=2, head_dim=32, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=8, intermediate_size=256, norm_topk_prob=True,
        router_aux_loss_coef=0.001)),
    "tiny-mixtral": TinySpec(MixtralForCausalLM, MixtralConfig, dict(
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=128,
        router_aux_loss_coef=0.02, router_jitter_noise=0.0)),
}

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
    model = spec.model_cls(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=name, unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        ids = sample_batch(streams, batch, seq, rng)
        outputs = model(input_ids=ids, labels=ids, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        outputs.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{outputs.loss.item():.3f}", aux=f"{outputs.aux_loss.item():.3f}")
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
        reloaded = type(model).from_pretrained(tmp, dtype=torch.float32)
        reloaded_tok = AutoTokenizer.from_pretrained(tmp)
        record = quality.measure(reloaded, reloaded_tok, benchmarks_root)
        record["training"] = training
        (tmp / quality.FILENAME).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(
        prog="train-tiny",
        description="Train one embedded tiny MoE model on the offline corpus and write it, with "
                    "its tokenizer and quality record, as a Hugging Face folder.")
    p.add_argument("--model", required=True, choices=sorted(SPECS), help="which tiny model")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output folder (default {EMBEDDED_DIR}/<model>)")
    p.add_argument("--benchmarks", default=None, help="benchmarks folder (train splits)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    models.quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or EMBEDDED_DIR / args.model
    record = train(args.model, steps=args.steps, batch=args.batch, seq=args.seq_len, lr=args.lr,
                   seed=args.seed, out=out, benchmarks_root=args.benchmarks)
    print(models.format_quality_record(record))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
