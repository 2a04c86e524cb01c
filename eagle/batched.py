"""Batched EAGLE decoding: b sequences, each with its own dynamic draft tree, verified by one
target forward per pass, with continuous batching.

Each active sequence i has ``P_i`` committed tokens and a tree of ``M`` nodes (every tree has
``total_tokens`` nodes; an autoregressive pass has one). The target's KV cache is one padded
batch: layer tensors ``[b, heads, L, d]`` with ``L = max_i P_i``, sequence i's rows ``[0, P_i)``
valid and the rest padding. One verification pass runs

* ``input_ids [b, M]`` (the trees' tokens), ``position_ids = P_i + depth_i`` (RoPE sees every
  node at its own position, whatever the padding),
* a 4-D additive mask ``[b, 1, M, L + M]``: prefix columns ``c < P_i`` and the node's ancestors
  visible (gpt-oss's sliding layers also hide keys at positions ``≤ q − window``),

then each sequence accepts its own path (greedy or rejection sampling with its own generator,
drawn in the same order as at b = 1) and the cache is compacted per sequence: rows ``[0, P_i)``
and ``L + path_i`` kept, left-aligned, padded to the new maximum. A sequence that stops leaves
the batch at once and the next prompt of the queue is prefilled alone and joins (its cache rows
padded in), so the batch stays full while prompts remain.

Draft trees are built for the whole batch at once (:func:`eagle.tree.build_trees`: one draft
forward per tree level for all sequences, each draft cache padded and masked), and the target
forward is batched. At T = 0 every sequence's output is the
one it gets at b = 1 (``tests/test_batched.py``, every embedded family, b ∈ {2, 4, 8}).

The batched forward itself (:func:`verify_batch`: masks and positions from :func:`tree_masks`,
over a padded cache built by :func:`stack_caches`) is also what closed-loop replay over batches
re-verifies captured trees with (``replay.closed_loop``).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from moe_spec.eagle import acceptance, verify
from moe_spec.eagle.decoding import EagleDecoder, Generation, StepRecord, _sync
from moe_spec.eagle.tree import DraftCache, DraftInput, DraftTree, build_trees


@dataclass
class Sequence:
    """One prompt in the batch: what b = 1 decoding keeps in its loop, per sequence."""

    key: object
    slot: int
    prompt_ids: list[int]
    generator: torch.Generator
    result: Generation
    out: list[int]
    prefix: int
    root: int
    draft_cache: DraftCache = field(default_factory=DraftCache)
    new_feats: torch.Tensor | None = None
    new_tokens: torch.Tensor | None = None
    step: int = 0
    start: float = 0.0


@dataclass
class BatchPass:
    """One verification pass over the batch: what each sequence did, and what the pass cost."""

    index: int  # batch pass number, from 0
    slots: list[int]  # slot of each sequence in the pass (batch row order)
    keys: list[object]  # each sequence's prompt key
    records: list[StepRecord]  # each sequence's step (its own step counter)
    tokens_verified: int  # b · M
    draft_seconds: float  # all trees of the pass
    verify_seconds: float  # the one target forward
    finished: list[tuple[object, Generation]]  # sequences that stopped after this pass


@dataclass
class _Batch:
    """The decoding loop's state: prompts waiting, sequences in the batch (row order), free
    slots, and the padded batch cache."""

    queue: deque
    active: list[Sequence]
    free: list[int]
    cache: object = None

    def leave(self, rows: list[int], *, after_pass: bool) -> None:
        """The sequences at batch ``rows`` leave: slots freed, cache rows dropped, and after a
        pass the padding columns no remaining sequence needs."""
        keep = [i for i in range(len(self.active)) if i not in rows]
        self.free.extend(self.active[i].slot for i in rows)
        self.free.sort()
        self.active = [self.active[i] for i in keep]
        if not self.active:
            self.cache = None
            return
        BatchedDecoder._keep_rows(self.cache, keep)
        if after_pass:
            BatchedDecoder._trim(self.cache, [s.prefix for s in self.active])


class BatchedDecoder:
    """Continuous-batching EAGLE decoding over an :class:`EagleDecoder`'s target, head and
    settings. ``verify_context(pass_index, trees, prefixes)`` wraps each batched verification
    forward (capture's recorder hooks; the hooks see all ``b · M`` tree tokens, row-major)."""

    def __init__(self, decoder: EagleDecoder, batch_size: int,
                 verify_context: Callable[[int, list, list], contextlib.AbstractContextManager]
                 | None = None):
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be at least 1")
        self.decoder = decoder
        self.batch_size = batch_size
        self.verify_context = verify_context
        self.window = verify.sliding_window(decoder.target)

    # --- the padded batch cache -----------------------------------------------------------------
    @staticmethod
    def _join(cache, single) -> object:
        """The batch cache with a prefilled sequence's cache (batch 1) as its last row."""
        return single if cache is None else stack_caches([cache, single])

    @staticmethod
    def _keep_rows(cache, rows: list[int]) -> None:
        """Only batch rows ``rows`` stay (sequences that stopped leave)."""
        index = torch.tensor(rows, device=cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)

    @staticmethod
    def _compact(cache, width: int, prefixes: list[int], paths: list[torch.Tensor]) -> None:
        """Keep rows ``[0, P_i)`` and ``width + path_i`` of each sequence, left-aligned, padded
        to the longest (padding rows repeat row 0 and are always masked)."""
        device = cache.layers[0].keys.device
        kept = [torch.cat([torch.arange(p, device=device), width + path])
                for p, path in zip(prefixes, paths)]
        length = max(len(k) for k in kept)
        index = torch.stack([torch.cat([k, k.new_zeros(length - len(k))]) for k in kept])
        for layer in cache.layers:
            for name in ("keys", "values"):  # MLA: values and keys differ in head size
                x = getattr(layer, name)
                b, h, _, d = x.shape
                setattr(layer, name, x.gather(2, index[:, None, :, None].expand(b, h, length, d)))

    # --- the loop -------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, prompts: Iterable[tuple[object, list[int]]], *, max_new_tokens: int = 256,
            eos_token_ids: set[int] | None = None, seed: int | Callable[[object], int] = 0,
            autoregressive: bool = False) -> Iterator[BatchPass | tuple[object, Generation]]:
        """Decode every ``(key, prompt_ids)``; yields a :class:`BatchPass` after each
        verification pass and ``(key, Generation)`` for a prompt that stops before any pass
        (its first token already ends it). ``seed`` is one seed for all prompts or a function of
        the key (each prompt's generator is seeded as its b = 1 decoding would be)."""
        eos = set(eos_token_ids or ())
        batch = _Batch(deque(prompts), [], list(range(self.batch_size)))
        tree_size = 1 if autoregressive else self.decoder.tree_settings.total_tokens
        index = 0
        while batch.queue or batch.active:
            yield from self._fill(batch, eos, max_new_tokens, seed)
            if not batch.active:
                break
            full = [i for i, s in enumerate(batch.active)
                    if s.prefix + tree_size + 1 > self.decoder.max_length]
            if full:  # no room for another tree: these stop before the pass
                finished = [batch.active[i] for i in full]
                for s in finished:
                    self._finish(s, "context_length")
                batch.leave(full, after_pass=False)
                yield BatchPass(index, [], [], [], 0, 0.0, 0.0,
                                [(s.key, s.result) for s in finished])
                continue
            done, batch_pass = self._pass(batch, index, tree_size, autoregressive, eos,
                                          max_new_tokens)
            yield batch_pass
            index += 1
            if done:
                batch.leave(done, after_pass=True)

    def _fill(self, batch: _Batch, eos, max_new_tokens, seed
              ) -> Iterator[tuple[object, Generation]]:
        """Continuous batching: prefill queued prompts into every free slot; yields the prompts
        whose first token already stops them."""
        while batch.queue and batch.free:
            entries = [batch.queue.popleft()
                       for _ in range(min(len(batch.queue), len(batch.free)))]
            joined, stopped, rows = self._admit(entries, batch.free, eos, max_new_tokens, seed)
            yield from stopped
            if joined:
                batch.active.extend(joined)
                batch.cache = self._join(batch.cache, rows)

    def _pass(self, batch: _Batch, index: int, tree_size: int, autoregressive: bool, eos,
              max_new_tokens) -> tuple[list[int], BatchPass]:
        """One verification pass: every active sequence's tree drafted, verified in one batched
        target forward, its path accepted and committed. Returns the rows that stopped and the
        pass."""
        dec, active = self.decoder, batch.active
        _sync(dec.device)
        t0 = time.perf_counter()
        trees = [None] * len(active) if autoregressive else build_trees(
            dec.head, [DraftInput(s.draft_cache, s.new_feats, s.new_tokens, s.root)
                       for s in active], dec.tree_settings)
        _sync(dec.device)
        t1 = time.perf_counter()
        width = batch.cache.layers[0].keys.shape[-2]
        prefixes = [s.prefix for s in active]
        roots = torch.tensor([[s.root] for s in active], device=dec.device) \
            if autoregressive else None
        ctx = self.verify_context(index, trees, prefixes) if self.verify_context \
            else contextlib.nullcontext()
        with ctx, dec.tap.active():
            out = verify_batch(dec.target, batch.cache, trees, prefixes, self.window, roots)
            feats = dec.tap.features()
        batch.cache = out.cache
        verdicts = [acceptance.Acceptance([0], acceptance.next_token(
                        out.logits[i, 0], dec.sampling, s.generator)) if tree is None
                    else acceptance.accept(tree, out.logits[i], dec.sampling, s.generator)
                    for i, (s, tree) in enumerate(zip(active, trees))]
        _sync(dec.device)
        t2 = time.perf_counter()
        paths = [torch.tensor(v.path, device=dec.device) for v in verdicts]
        self._compact(batch.cache, width, prefixes, paths)
        records, done = [], []
        for i, (s, tree, v, path) in enumerate(zip(active, trees, verdicts, paths)):
            record = StepRecord(s.step, s.prefix, tree, v.path, v.bonus,
                                (t1 - t0) / len(active), t2 - t1)
            records.append(record)
            if self._commit(s, record, tree, path, feats[i], eos, max_new_tokens):
                done.append(i)
        return done, BatchPass(index, [s.slot for s in active], [s.key for s in active],
                               records, len(active) * tree_size, t1 - t0, t2 - t1,
                               [(active[i].key, active[i].result) for i in done])

    def _commit(self, s: Sequence, record: StepRecord, tree, path: torch.Tensor,
                feats: torch.Tensor, eos, max_new_tokens) -> bool:
        """Append a pass's accepted tokens and bonus token to sequence ``s`` (its next draft's
        inputs too); True when it stops."""
        dec = self.decoder
        accepted = [] if tree is None else tree.tokens[path[1:]].tolist()
        s.result.steps.append(record)
        s.prefix += len(record.path)
        s.out, reason = dec._stop(s.out + accepted + [record.bonus], eos, max_new_tokens)
        s.root = record.bonus
        s.new_feats = feats[path]
        s.new_tokens = torch.tensor(accepted + [s.root], device=dec.device)
        s.step += 1
        s.result.output_ids = s.out
        if reason:
            self._finish(s, reason)
        return bool(reason)

    @staticmethod
    def _trim(cache, prefixes: list[int]) -> None:
        """Drop padding columns no remaining sequence needs."""
        length = max(prefixes)
        for layer in cache.layers:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

    def _prefill(self, prompt_ids: list[list[int]]):
        """Prefill prompts in one forward: right-padded to the longest, each row causal over its
        own tokens with explicit positions (padding keys hidden; a sliding-window model's
        sliding layers also hide keys ``≤ query − window``). Returns each prompt's last logits
        ``[V]`` and features ``[P_i, F]``, and the batch cache (row i holds prompt i in columns
        ``[0, P_i)``). One prompt runs exactly as :func:`eagle.verify.prefill`."""
        dec = self.decoder
        if len(prompt_ids) == 1:
            logits, feats, cache = verify.prefill(
                dec.target, dec.tap, torch.tensor(prompt_ids, device=dec.device))
            return [logits], [feats], cache
        device = dec.device
        lengths = torch.tensor([len(p) for p in prompt_ids], device=device)
        width = int(lengths.max())
        ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompt_ids], device=device)
        pos = torch.arange(width, device=device)
        allowed = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lengths[:, None,
                                                                                        None])
        dtype = next(dec.target.parameters()).dtype
        mask = _additive(allowed, dtype) if self.window is None else {
            "full_attention": _additive(allowed, dtype),
            "sliding_attention": _additive(allowed & (pos[None, :] > pos[:, None] - self.window),
                                           dtype)}
        # the LM head only at the prompts' last positions (``keep``; row i's is ``column[i]``)
        keep, column = torch.unique(lengths - 1, return_inverse=True)
        with dec.tap.active():
            out = dec.target(input_ids=ids, position_ids=pos[None].expand(len(ids), -1),
                             attention_mask=mask, cache=verify.new_cache(dec.target),
                             use_cache=True, logits_to_keep=keep)
            feats = dec.tap.features()
        return (list(out.logits[torch.arange(len(ids), device=device), column]),
                [feats[i, :n] for i, n in enumerate(lengths.tolist())], out.cache)

    def _admit(self, entries, free, eos, max_new_tokens, seed):
        """Prefill ``entries`` (key, prompt_ids) together; returns the sequences that join, the
        (key, Generation) of those whose first token already stops them, and the joiners'
        cache rows (in joining order)."""
        dec = self.decoder
        start = time.perf_counter()
        logits, feats, cache = self._prefill([list(ids) for _, ids in entries])
        joined, stopped, rows = [], [], []
        for i, (key, prompt_ids) in enumerate(entries):
            s = seed(key) if callable(seed) else seed
            gen = torch.Generator(device=dec.device).manual_seed(s)
            root = acceptance.next_token(logits[i], dec.sampling, gen)
            result = Generation(list(prompt_ids), [])
            out, reason = dec._stop([root], eos, max_new_tokens)
            result.output_ids = out
            if reason:
                result.stop_reason = reason
                result.seconds = time.perf_counter() - start
                stopped.append((key, result))
                continue
            free.sort()
            joined.append(Sequence(key, free.pop(0), list(prompt_ids), gen, result, out,
                                   len(prompt_ids), root, new_feats=feats[i],
                                   new_tokens=torch.tensor(list(prompt_ids[1:]) + [root],
                                                           device=dec.device), start=start))
            rows.append(i)
        if rows and len(rows) < len(entries):
            self._keep_rows(cache, rows)
        return joined, stopped, cache if rows else None

    @staticmethod
    def _finish(s: Sequence, reason: str) -> None:
        s.result.output_ids = s.out
        s.result.stop_reason = reason
        s.result.seconds = time.perf_counter() - s.start


def verify_batch(target, cache, trees: list[DraftTree | None], prefixes: list[int],
                 window: int | None, tokens: torch.Tensor | None = None):
    """One target forward over b trees, sequence i after its ``P_i`` committed tokens in row i of
    the padded batch ``cache`` (:func:`stack_caches`): inputs ``[b, M]`` (the trees' tokens, or
    ``tokens`` for an autoregressive pass), mask and positions from :func:`tree_masks`. Returns
    the model's output (``logits [b, M, V]``; the cache grows by the M tree columns). MoE hooks
    see all ``b · M`` tokens, row-major, in one call per layer."""
    dtype = next(target.parameters()).dtype
    width = cache.layers[0].keys.shape[-2]
    device = cache.layers[0].keys.device
    mask, positions = tree_masks(trees, prefixes, width, dtype, window, device)
    if tokens is None:
        tokens = torch.stack([t.tokens for t in trees])
    return target(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache,
                  use_cache=True)


def stack_caches(caches: list) -> object:
    """A new cache whose batch rows are those of ``caches`` in order, each padded with zero
    columns to the longest (padding is always masked). The given caches are left as they are:
    the new one holds new tensors, or, for a single cache already as long, the same ones (a
    forward on it grows it by concatenation, never in place)."""
    length = max(c.layers[0].keys.shape[-2] for c in caches)
    out = copy.copy(caches[0])
    out.layers = [copy.copy(layer) for layer in caches[0].layers]
    for i, layer in enumerate(out.layers):
        for name in ("keys", "values"):  # MLA: values and keys differ in head size
            parts = [_pad(getattr(c.layers[i], name), length) for c in caches]
            setattr(layer, name, parts[0] if len(parts) == 1 else torch.cat(parts))
    return out


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x [..., L, d]`` with zero rows appended up to ``length``."""
    if x.shape[-2] >= length:
        return x
    pad = x.new_zeros(*x.shape[:-2], length - x.shape[-2], x.shape[-1])
    return torch.cat([x, pad], dim=-2)


def tree_masks(trees: list[DraftTree | None], prefixes: list[int], width: int,
               dtype: torch.dtype, window: int | None, device):
    """The batched verification forward's attention mask and positions, for b trees (None: an
    autoregressive pass, one token) over a padded cache of ``width`` columns: additive
    ``[b, 1, M, width + M]`` with sequence i's prefix columns ``c < P_i`` and each node's ancestors
    visible (with ``window``, a mapping {layer type: mask} whose sliding-window mask also hides
    keys at positions ``≤ query − window``), and positions ``P_i + depth`` ``[b, M]``. At b = 1
    with ``width = P`` it is :func:`eagle.verify.tree_attention_mask`'s mask."""
    m = 1 if trees[0] is None else trees[0].size
    b = len(trees)
    prefix = torch.tensor(prefixes, device=device)
    cols = torch.arange(width, device=device)
    allowed = torch.zeros(b, m, width + m, dtype=torch.bool, device=device)
    allowed[:, :, :width] = (cols[None, :] < prefix[:, None])[:, None, :]
    depth = torch.zeros(b, m, dtype=torch.long, device=device)
    for i, tree in enumerate(trees):
        if tree is None:
            allowed[i, :, width:] = True
        else:
            allowed[i, :, width:] = tree.ancestors
            depth[i] = tree.depth
    query = prefix[:, None] + depth  # [b, M] positions

    def additive(ok):
        return _additive(ok, dtype)

    if window is None:
        return additive(allowed), query
    key = torch.cat([cols[None].expand(b, -1), query], 1)  # [b, width + M]
    recent = key[:, None, :] > query[:, :, None] - window
    return {"full_attention": additive(allowed),
            "sliding_attention": additive(allowed & recent)}, query


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``[b, q, k]`` visibility as the additive ``[b, 1, q, k]`` attention mask."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[:, None]


def generate_batched(decoder: EagleDecoder, prompts: list[list[int]], batch_size: int,
                     **kwargs) -> list[Generation]:
    """Decode ``prompts`` with ``batch_size`` sequences at a time; Generations in prompt order."""
    results: dict[int, Generation] = {}
    for event in BatchedDecoder(decoder, batch_size).run(enumerate(prompts), **kwargs):
        if isinstance(event, BatchPass):
            results.update(event.finished)
        else:
            results[event[0]] = event[1]
    return [results[i] for i in range(len(prompts))]
