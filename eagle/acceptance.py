"""Which drafted path the target accepts, and the token it adds after it.

* Greedy (T = 0): walk from the root; at each node the target's argmax either equals one child's
  token (siblings are distinct, so at most one) and the walk goes on, or the walk stops. The
  accepted path is therefore the longest one matching the target's greedy continuation, and the
  bonus token is the argmax at its last node. Lossless: identical to greedy decoding.
* Sampling (T > 0): EAGLE's multi-candidate rejection with the (deterministic) draft treated as a
  point mass. At the current node with target distribution ``p`` (after the logits processors),
  try its children in order of draft score: accept child ``x`` with probability ``p(x)``;
  otherwise set ``p(x) = 0`` and renormalise (the residual ``norm(max(0, p − δ_x))``) and try the
  next. If every child is rejected, the next token is sampled from the residual; if the walk
  reaches a leaf, from the full ``p`` at the leaf. Each emitted token is then distributed exactly
  as under plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from moe_spec.eagle.tree import DraftTree


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def processors(self) -> LogitsProcessorList:
        procs = LogitsProcessorList()
        if not self.greedy:
            if self.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k > 0:
                procs.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                procs.append(TopPLogitsWarper(self.top_p))
        return procs


def target_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Target sampling distribution(s) after the processors, float32 ``[..., V]``."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    flat = settings.processors()(None, flat)
    return torch.softmax(flat, dim=-1).reshape(logits.shape)


def next_token(logits: torch.Tensor, settings: SamplingSettings,
               generator: torch.Generator | None) -> int:
    """Plain decoding of one token from ``logits [V]`` (prefill and the AR baseline)."""
    if settings.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, settings), 1, generator=generator))


@dataclass
class Acceptance:
    path: list[int]  # node ids, root first
    bonus: int  # the token the target adds after the path (next root)


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    preds = logits.argmax(-1).tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    child_by_token: dict[tuple[int, int], int] = {(p, t): j for j, (p, t) in
                                                  enumerate(zip(parents, tokens)) if j > 0}
    path = [0]
    while (path[-1], preds[path[-1]]) in child_by_token:
        path.append(child_by_token[(path[-1], preds[path[-1]])])
    return Acceptance(path, preds[path[-1]])


def accept_sampling(tree: DraftTree, logits: torch.Tensor, settings: SamplingSettings,
                    generator: torch.Generator | None) -> Acceptance:
    probs = target_probs(logits, settings)
    path = [0]
    tokens = tree.tokens.tolist()
    while True:
        node = path[-1]
        p = probs[node].clone()
        children = tree.children(node)
        if not children:
            return Acceptance(path, int(torch.multinomial(p, 1, generator=generator)))
        for child in children:
            x = tokens[child]
            u = torch.rand((), generator=generator, device=p.device)
            if u < p[x]:
                path.append(child)
                break
            p[x] = 0
            total = p.sum()
            if total <= 0:  # every token with mass was a rejected child: cannot happen for p(x)<1
                raise AssertionError("residual distribution vanished")
            p /= total
        else:
            return Acceptance(path, int(torch.multinomial(p, 1, generator=generator)))


def accept(tree: DraftTree, logits: torch.Tensor, settings: SamplingSettings,
           generator: torch.Generator | None) -> Acceptance:
    if settings.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, settings, generator)
