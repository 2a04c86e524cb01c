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

from moe_spec.eagle import acceptance, verify
from moe_spec.eagle.acceptance import SamplingSettings
from moe_spec.eagle.draft_head import DraftHead
from moe_spec.eagle.tree import DraftCache, DraftTree, TreeSettings, build_tree
from moe_spec.moe import families


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
        self.max_length = max_length or families.facts(target.config).max_positions or 4096
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
        """``out`` cut where generation stops, and why ("" to go on): at the first EOS token
        within the first ``max_new`` tokens, else at ``max_new`` tokens (a pass can accept
        several tokens at once, so either can fall inside it)."""
        for i, tok in enumerate(out[:max_new]):
            if tok in eos:
                return out[:i + 1], "eos"
        if len(out) >= max_new:
            return out[:max_new], "max_new_tokens"
        return out, ""

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int = 256,
                 eos_token_ids: set[int] | None = None, seed: int = 0,
                 autoregressive: bool = False) -> Generation:
        """Decode one prompt to the end; see :meth:`stream` to act after every pass."""
        session = self.stream(prompt_ids, max_new_tokens=max_new_tokens,
                              eos_token_ids=eos_token_ids, seed=seed, autoregressive=autoregressive)
        for _ in session:
            pass
        return session.result

    def stream(self, prompt_ids: list[int], *, max_new_tokens: int = 256,
               eos_token_ids: set[int] | None = None, seed: int = 0,
               autoregressive: bool = False) -> DecodeSession:
        """An iterator over the verification passes of one prompt (a :class:`StepRecord` each);
        its ``result`` is the whole :class:`Generation` once the iterator is exhausted."""
        return DecodeSession(self, prompt_ids, max_new_tokens, set(eos_token_ids or ()), seed,
                             autoregressive)


class DecodeSession:
    """One prompt being decoded: iterate to run verification passes one at a time."""

    def __init__(self, decoder: EagleDecoder, prompt_ids: list[int], max_new_tokens: int,
                 eos: set[int], seed: int, autoregressive: bool):
        self.decoder = decoder
        self.result = Generation(list(prompt_ids), [])
        self._steps = self._run(prompt_ids, max_new_tokens, eos, seed, autoregressive)

    def __iter__(self):
        return self._steps

    @torch.no_grad()
    def _run(self, prompt_ids, max_new_tokens, eos, seed, autoregressive):
        dec = self.decoder
        gen = torch.Generator(device=dec.device).manual_seed(seed)
        start = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=dec.device)
        logits, feats, cache = verify.prefill(dec.target, dec.tap, ids)
        root = acceptance.next_token(logits, dec.sampling, gen)
        result = self.result
        out, reason = dec._stop([root], eos, max_new_tokens)
        prefix = len(prompt_ids)
        draft_cache = DraftCache()
        new_feats, new_tokens = feats, torch.tensor(prompt_ids[1:] + [root], device=dec.device)
        step = 0
        tree_size = 1 if autoregressive else dec.tree_settings.total_tokens
        while not reason:
            if prefix + tree_size + 1 > dec.max_length:
                reason = "context_length"
                break
            _sync(dec.device)
            t0 = time.perf_counter()
            if autoregressive:
                tree = None
            else:
                tree = build_tree(dec.head, draft_cache, new_feats, new_tokens, root,
                                  dec.tree_settings)
            _sync(dec.device)
            t1 = time.perf_counter()
            ctx = dec.verify_context(step, tree, prefix) if (dec.verify_context and tree) \
                else contextlib.nullcontext()
            with ctx:
                if autoregressive:
                    logits, feats = verify.forward_tokens(dec.target, dec.tap, cache,
                                                          torch.tensor([root], device=dec.device),
                                                          prefix)
                    verdict = acceptance.Acceptance([0], acceptance.next_token(
                        logits[0], dec.sampling, gen))
                else:
                    logits, feats = verify.verify_tree(dec.target, dec.tap, cache, tree, prefix)
                    verdict = acceptance.accept(tree, logits, dec.sampling, gen)
            _sync(dec.device)
            t2 = time.perf_counter()
            path = torch.tensor(verdict.path, device=dec.device)
            if not autoregressive:
                verify.compact_cache(cache, prefix, path)
            accepted = [] if tree is None else tree.tokens[path[1:]].tolist()
            record = StepRecord(step, prefix, tree, verdict.path, verdict.bonus, t1 - t0, t2 - t1)
            result.steps.append(record)
            prefix += len(verdict.path)
            out, reason = dec._stop(out + accepted + [verdict.bonus], eos, max_new_tokens)
            root = verdict.bonus
            new_feats = feats[path]
            new_tokens = torch.tensor(accepted + [root], device=dec.device)
            step += 1
            result.output_ids = out
            result.seconds = time.perf_counter() - start
            yield record
        result.output_ids = out
        result.stop_reason = reason
        result.seconds = time.perf_counter() - start
