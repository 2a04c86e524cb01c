"""The quality record of an embedded model (``quality.json`` beside its weights).

Measured on data the model never trained on, and re-measured by the tests:

* ``heldout``: mean next-token cross-entropy (nats) on the held-out corpus documents, per source
  and overall, against a unigram baseline (train-split token frequencies, add-one smoothed).
* ``routing``: on 63-token windows (one EAGLE-sized verification tree's worth of tokens) cut from
  the evaluation prompts of MBPP and GSM8K, per MoE layer:
    - ``topk_mass``: mean over tokens of ``Σ_{i∈T_k(t)} g_i(t)`` (uniform routing: k/N);
    - ``entropy_ratio``: mean router entropy ``H(g_t) / log N`` (uniform: 1);
    - ``load_cv``: coefficient of variation (std/mean) of per-expert top-k selection counts;
    - ``top_half_share``: per window, mass of the top N/2 experts by ``s_i = Σ_t g_i(t)`` over
      ``Σ_i s_i``, averaged over windows;
    - ``unique_experts``: per window ``|∪_t T_k(t)|``, averaged over windows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moe_spec.moe.adapter import MoEAdapter
from moe_spec.tasks import benchmarks
from moe_spec.training import corpus

FILENAME = "quality.json"
WINDOW = 63
SEQ = 256
MAX_HELDOUT_WINDOWS = 48  # per source: keeps the measurement to seconds on a CPU
ROUTING_PROMPTS = {"mbpp": 200, "gsm8k": 200}


def _windows(ids: list[int], size: int, limit: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)][:limit]


@torch.no_grad()
def heldout_loss(model, tokenizer, docs: list[corpus.Document]) -> tuple[float, int]:
    """(mean cross-entropy in nats, tokens scored) over non-overlapping SEQ-token windows."""
    stream = [t for d in docs for t in (*tokenizer(d.text, add_special_tokens=False)["input_ids"],
                                        tokenizer.eos_token_id)]
    windows = _windows(stream, SEQ, MAX_HELDOUT_WINDOWS)
    total, count = 0.0, 0
    for i in range(0, len(windows), 8):
        ids = torch.tensor(windows[i:i + 8], device=model.device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += ids[:, 1:].numel()
    return total / count, count


def unigram_baseline(tokenizer, train_docs: list[corpus.Document],
                     heldout_docs: list[corpus.Document]) -> float:
    """Cross-entropy of held-out tokens under add-one-smoothed train unigram frequencies."""
    vocab = len(tokenizer)
    counts = np.ones(vocab)
    for ids in tokenizer([d.text for d in train_docs], add_special_tokens=False)["input_ids"]:
        np.add.at(counts, ids, 1)
    logp = np.log(counts / counts.sum())
    held = [t for ids in tokenizer([d.text for d in heldout_docs], add_special_tokens=False)[
        "input_ids"] for t in ids]
    return float(-logp[held].mean())


@torch.no_grad()
def routing_stats(model, tokenizer, benchmarks_root=None) -> dict:
    adapter = MoEAdapter(model)
    windows = []
    for bench, count in ROUTING_PROMPTS.items():
        for prompt in benchmarks.load(bench, root=benchmarks_root, limit=count):
            ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
            if len(ids) >= WINDOW:
                windows.append(ids[:WINDOW])
    ids = torch.tensor(windows, device=model.device)
    routed = {}
    hooks = [layer.router.register_forward_hook(
        lambda mod, args, out, i=layer.index: routed.__setitem__(i, (out[0], out[2])))
        for layer in adapter]
    try:
        model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    n, k = adapter.num_experts, adapter.top_k
    per_layer = []
    for layer in adapter:
        logits, chosen = routed[layer.index]
        scores = layer.rule.scores(logits)  # shares of the router's scores over routed experts
        probs = (scores / scores.sum(-1, keepdim=True)).reshape(len(windows), WINDOW, n)
        top_i = chosen.long().reshape(len(windows), WINDOW, k)  # the model's own top-k
        top_p = probs.gather(-1, top_i)
        counts = torch.bincount(top_i.reshape(-1), minlength=n).double()
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        s = probs.sum(1)  # [W, N] router mass per window
        half = s.topk(n // 2, dim=-1).values.sum(-1) / s.sum(-1)
        hit = torch.zeros(len(windows), n, dtype=torch.bool, device=probs.device)
        hit.scatter_(1, top_i.reshape(len(windows), -1), True)
        per_layer.append(dict(
            layer=layer.index,
            topk_mass=top_p.sum(-1).mean().item(),
            entropy_ratio=(entropy / math.log(n)).mean().item(),
            load_cv=(counts.std(unbiased=False) / counts.mean()).item(),
            top_half_share=half.mean().item(),
            unique_experts=hit.sum(-1).double().mean().item(),
        ))
    keys = [k_ for k_ in per_layer[0] if k_ != "layer"]
    summary = {key: float(np.mean([row[key] for row in per_layer])) for key in keys}
    return dict(windows=len(windows), window_tokens=WINDOW, num_experts=n, top_k=k,
                uniform_topk_mass=k / n, mean=summary, per_layer=per_layer)


def measure(model, tokenizer, benchmarks_root=None) -> dict:
    model.eval()
    docs = corpus.load_corpus(benchmarks_root)
    heldout, scored = {}, 0
    total = 0.0
    for source, items in docs.items():
        loss, count = heldout_loss(model, tokenizer, corpus.split(items)[1])
        heldout[source] = loss
        total += loss * count
        scored += count
    train_all = [d for items in docs.values() for d in corpus.split(items)[0]]
    held_all = [d for items in docs.values() for d in corpus.split(items)[1]]
    return dict(
        heldout=dict(loss=total / scored, tokens=scored, per_source=heldout,
                     unigram_baseline=unigram_baseline(tokenizer, train_all, held_all)),
        routing=routing_stats(model, tokenizer, benchmarks_root),
        parameters=sum(p.numel() for p in model.parameters()),
    )
