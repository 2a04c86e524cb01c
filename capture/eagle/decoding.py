"""The EAGLE decoding loop (and the autoregressive baseline through the same loop).

    prefill prompt → root₀ ; draft prefix = (features of prompt, prompt[1:] + root₀)
    repeat:  tree = build_tree(draft)                              (EAGLE-2 dynamic tree)
             logits, feats = verify_tree(target, tree)             (one forward, tree mask)
             path, bonus = accept(tree, logits)                    (greedy or rejection sampling)
             keep the path's cache rows; emit path[1:] + bonus; next root = bonus
             draft prefix += (feats[path], tokens after each path node)
    until EOS, max_new_tokens or the context limit.

Every verification pass is recorded as a :class:`StepRecord` (tree, accepted path, timings);
``verify_context`` lets the capture stage hook the target during verification passes only.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from capture.eagle import acceptance, verify
from capture.eagle.acceptance import SamplingSettings
from capture.eagle.draft_head import DraftHead
from capture.eagle.tree import DraftCache, DraftTree, TreeSettings, build_tree


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepRecord:
    step: int
    prefix_len: int  # committed tokens in the target cache before this pass
    tree: DraftTree | None  # None for an autoregressive step
    path: list[int]  # accepted node ids, root first
    bonus: int
    draft_seconds: float
    verify_seconds: float

    @property
    def accepted_length(self) -> int:
        """Tokens this pass adds to the output: accepted drafts + the bonus token."""
        return len(self.path)


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    steps: list[StepRecord] = field(default_factory=list)
    stop_reason: str = ""
    seconds: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: mean tokens added per verification pass (accepted drafts + bonus)."""
        return sum(s.accepted_length for s in self.steps) / max(1, len(self.steps))


class EagleDecoder:
    """Speculative decoding of one sequence at a time (batch size 1, as EAGLE's reference)."""

    def __init__(self, target: nn.Module, head: DraftHead | None, *,
                 tree: TreeSettings = TreeSettings(), sampling: SamplingSettings = SamplingSettings(),
                 max_length: int | None = None,
                 verify_context: Callable[[int, DraftTree, int], contextlib.AbstractContextManager]
                 | None = None):
        self.target = target
        self.head = head
        self.tree_settings = tree
        self.sampling = sampling
        self.max_length = max_length or getattr(target.config, "max_position_embeddings", 4096)
        self.verify_context = verify_context
        if head is None:
            layers = [0]  # the AR baseline needs no features; tap something cheap
        elif head.config.eagle_version == 1:
            layers = "final"
        else:
            layers = head.config.feature_layers
        self.tap = verify.FeatureTap(target, layers)
        self.device = next(target.parameters()).device

    def _stop(self, out: list[int], eos: set[int], max_new: int) -> tuple[list[int], str]:
        for i, tok in enumerate(out):
            if tok in eos:
                return out[:i + 1], "eos"
        if len(out) >= max_new:
            return out[:max_new], "max_new_tokens"
        return out, ""

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], *, max_new_tokens: int = 256,
                 eos_token_ids: set[int] | None = None, seed: int = 0,
                 autoregressive: bool = False) -> Generation:
        eos = set(eos_token_ids or ())
        gen = torch.Generator(device=self.device).manual_seed(seed)
        start = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=self.device)
        logits, feats, cache = verify.prefill(self.target, self.tap, ids)
        root = acceptance.next_token(logits, self.sampling, gen)
        result = Generation(list(prompt_ids), [])
        out, reason = self._stop([root], eos, max_new_tokens)
        prefix = len(prompt_ids)
        draft_cache = DraftCache()
        new_feats, new_tokens = feats, torch.tensor(prompt_ids[1:] + [root], device=self.device)
        step = 0
        tree_size = 1 if autoregressive else self.tree_settings.total_tokens
        while not reason:
            if prefix + tree_size + 1 > self.max_length:
                reason = "context_length"
                break
            _sync(self.device)
            t0 = time.perf_counter()
            if autoregressive:
                tree = None
            else:
                tree = build_tree(self.head, draft_cache, new_feats, new_tokens, root,
                                  self.tree_settings)
            _sync(self.device)
            t1 = time.perf_counter()
            ctx = self.verify_context(step, tree, prefix) if (self.verify_context and tree) \
                else contextlib.nullcontext()
            with ctx:
                if autoregressive:
                    logits, feats = verify.forward_tokens(self.target, self.tap, cache,
                                                          torch.tensor([root], device=self.device),
                                                          prefix)
                    verdict = acceptance.Acceptance([0], acceptance.next_token(
                        logits[0], self.sampling, gen))
                else:
                    logits, feats = verify.verify_tree(self.target, self.tap, cache, tree, prefix)
                    verdict = acceptance.accept(tree, logits, self.sampling, gen)
            _sync(self.device)
            t2 = time.perf_counter()
            path = torch.tensor(verdict.path, device=self.device)
            if not autoregressive:
                verify.compact_cache(cache, prefix, path)
            accepted = [] if tree is None else tree.tokens[path[1:]].tolist()
            result.steps.append(StepRecord(step, prefix, tree, verdict.path, verdict.bonus,
                                           t1 - t0, t2 - t1))
            prefix += len(verdict.path)
            out, reason = self._stop(out + accepted + [verdict.bonus], eos, max_new_tokens)
            root = verdict.bonus
            new_feats = feats[path]
            new_tokens = torch.tensor(accepted + [root], device=self.device)
            step += 1
        result.output_ids = out
        result.stop_reason = reason
        result.seconds = time.perf_counter() - start
        return result
