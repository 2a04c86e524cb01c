"""Train an EAGLE-3 draft head for a target (``train-draft``).

Data: the target's own greedy continuations of the train-split prompts (MBPP 601–974, GSM8K
train) — EAGLE-3 trains on target-generated responses — mixed with corpus windows.

Objective, EAGLE-3's training-time test (TTT) unrolled over ``--ttt`` steps. With target features
``f_t`` (inputs of the feature layers, fused by ``fc``), tokens ``x`` and the target's next-token
distribution ``p_t`` restricted to the draft vocabulary:

    step 0, position t:  h⁰_t = draft(f_t, x_{t+1})           predicts p_{t+1}
    step j, position t:  hʲ_t = draft(hʲ⁻¹_t, x_{t+1+j})       predicts p_{t+1+j}
    loss = Σ_j 0.8^j · mean_t CE(p_{t+1+j}, softmax(lm_head(norm(hʲ_t))))

At step j position t attends to the step-0 keys at positions ≤ t (the committed prefix) and to
its own keys of steps 1..j (its chain of ancestors in a tree), and sits at RoPE position t + j,
exactly as a depth-(j+1) node does at inference. The draft vocabulary is the ``--draft-vocab``
most frequent target tokens of the training data (``d2t``/``t2d`` as in EAGLE-3).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moe_spec.catalog import atomic
from moe_spec.eagle.draft_head import Eagle3Draft, load_draft, new_eagle3
from moe_spec.eagle.verify import FeatureTap
from moe_spec.moe import families, models
from moe_spec.tasks import benchmarks
from moe_spec.training import corpus
from moe_spec.training.tiny_moe import MIXTURE, sample_batch, token_streams

DECAY = 0.8


@torch.no_grad()
def generate_responses(target, tokenizer, prompts: list[str], new_tokens: int,
                       batch: int = 32) -> list[list[int]]:
    """Prompt + greedy continuation token ids for every prompt (left-padded batches)."""
    tokenizer.padding_side = "left"
    seqs = []
    for i in tqdm(range(0, len(prompts), batch), desc="target responses", leave=False,
                  disable=None):
        enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True)
        out = target.generate(**enc, do_sample=False, max_new_tokens=new_tokens,
                              pad_token_id=tokenizer.pad_token_id)
        for row, mask in zip(out, enc["attention_mask"]):
            pad = int((mask == 0).sum())
            seqs.append([t for t in row[pad:].tolist() if t != tokenizer.pad_token_id])
    return seqs


def draft_vocabulary(streams: list[np.ndarray], vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids, ascending (EAGLE-3's ``used`` list)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for s in streams:
        counts += np.bincount(s, minlength=vocab)
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(top))


def ttt_mask(seq: int, step: int, device) -> torch.Tensor:
    """Mask ``[1, 1, S, (step+1)·S]``: causal over step-0 keys, diagonal over steps 1..step."""
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    eye = torch.eye(seq, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)[None, None]


def ttt_loss(head: Eagle3Draft, features, ids, target_logp, used, steps: int):
    """EAGLE-3 TTT loss and per-step top-1 accuracy for one batch.

    features ``[B, S, 3H]``, ids ``[B, S]``, target_logp ``[B, S, V]`` (target log-probs at each
    position, i.e. of the token after it)."""
    n = features.shape[1] - steps - 1  # positions that have a label at every step
    hidden = head.fc(features[:, :n])
    target_p = torch.softmax(target_logp[..., used], -1)  # restricted to the draft vocab
    past = None
    loss, accs = 0.0, []
    for j in range(steps):
        pos = torch.arange(j, n + j, device=ids.device)
        emb = head.embed_tokens(ids[:, 1 + j:n + 1 + j])
        hidden, past = head.midlayer(emb, hidden, pos, past, ttt_mask(n, j, ids.device))
        logq = torch.log_softmax(head.logits(hidden).float(), -1)
        p = target_p[:, 1 + j:n + 1 + j]
        loss = loss + DECAY ** j * -(p * logq).sum(-1).mean()
        accs.append((logq.argmax(-1) == p.argmax(-1)).float().mean().item())
    return loss, accs


def train(target_name: str, *, steps: int, batch: int, seq: int, lr: float, seed: int,
          ttt: int, draft_vocab: int, intermediate: int, new_tokens: int, out: Path,
          benchmarks_root=None) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    loaded = models.load(target_name, device="cpu", dtype="float32")
    target, tok = loaded.model, loaded.tokenizer
    for p in target.parameters():
        p.requires_grad_(False)
    prompts = [p.text for name in ("mbpp", "gsm8k")
               for p in benchmarks.load_train(name, root=benchmarks_root)]
    prompts = prompts[:374 + 1000]
    responses = generate_responses(target, tok, prompts, new_tokens)
    response_stream = np.asarray([t for r in responses for t in (*r, tok.eos_token_id)], np.int32)
    docs = corpus.load_corpus(benchmarks_root)
    streams = token_streams(tok, {s: corpus.split(d)[0] for s, d in docs.items()})
    used = draft_vocabulary([response_stream, *streams.values()],
                            families.facts(target.config).vocab, draft_vocab)

    head = new_eagle3(target, intermediate_size=intermediate, draft_vocab_size=draft_vocab)
    cfg = head.config
    head.d2t.copy_(used - torch.arange(draft_vocab))
    head.t2d.zero_()
    head.t2d[used] = True
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    tap = FeatureTap(target, cfg.feature_layers)
    sources = {"responses": response_stream, **streams}
    mix = {"responses": 0.6, **{k: 0.4 * v for k, v in MIXTURE.items()}}
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"draft for {target_name}", unit="step", disable=None)
    for step in bar:
        frac = step / max(1, steps - 1)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * (1 - frac))
        ids = sample_batch(sources, batch, seq, rng, mix)
        with torch.no_grad(), tap.active():
            logits = target(input_ids=ids).logits
            feats = tap.features()
        loss, accs = ttt_loss(head, feats, ids, torch.log_softmax(logits.float(), -1), used, ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{accs[0]:.2f}", acc3=f"{accs[3]:.2f}")
    seconds = time.perf_counter() - start
    record = dict(target=target_name, steps=steps, batch=batch, seq_len=seq, peak_lr=lr,
                  seed=seed, ttt_steps=ttt, draft_vocab=draft_vocab, seconds=round(seconds, 1),
                  final_loss=round(loss.item(), 4), final_step_accuracy=[round(a, 3) for a in accs],
                  responses=len(responses), command=" ".join(["train-draft", *sys.argv[1:]]))
    with atomic.folder(out) as tmp:
        head.to(torch.float16).save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        load_draft(tmp, target)  # what we wrote must load strictly
    return record
