"""Budgets across a batch, offline: trees grouped into (virtual) verification passes.

A batched verification pass runs b trees in one target forward, so an expert budget caps the
union of experts over all ``b·M`` tree tokens of a layer: one shortlist for the batch. MoE tokens
are independent apart from that shared shortlist (every token's routing and expert outputs depend
on its own input only), so a pass is replayed as one *merged* tree-layer holding its trees' tokens
— the same rankings, coverage policies and metrics, with ``M`` replaced by ``Σ M_i``:

    RSE(pass, layer) = Σ_{t ∈ pass} ||O*_t − Ô_t||² / Σ_{t ∈ pass} ||O*_t||²

Which trees share a pass:

* **virtual batches** (runs captured at b = 1): the run's prompts are shuffled with ``seed`` and
  cut into groups of b (the last group may be smaller); a group's pass at decoding step s holds
  the step-s trees of the group's prompts that reached step s — as in a real batch whose
  sequences started together (one that stopped leaves it).
* **real batches** (runs captured with ``capture --batch-size``): the trees each pass verified
  (``trees.batch_pass``).

Both give the same shortlists and errors when they group the same trees (tested against a real
batched capture of the same prompts). Open loop scores a source's units chunk by chunk
(:meth:`BatchSource.chunks`: merged tree-layers); closed loop re-verifies a unit's prompts
together, pass by pass (:meth:`BatchSource.members`, :meth:`BatchSource.pass_of`;
:mod:`replay.closed_loop`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from moe_spec.catalog.reader import PromptTreeLayers


def groups(prompt_indices: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Prompts shuffled with ``seed`` (numpy's PCG64), cut into groups of ``batch_size`` in that
    order; each group lists its prompts in increasing index (the order their tokens are merged)."""
    if batch_size < 1:
        raise ValueError(f"batch size {batch_size} must be at least 1")
    order = np.random.default_rng(seed).permutation(np.asarray(sorted(prompt_indices)))
    return [sorted(int(p) for p in order[i:i + batch_size])
            for i in range(0, len(order), batch_size)]


def merge(datas: list[PromptTreeLayers], pass_of: Callable[[int, int], int], *, index: int,
          name: str) -> PromptTreeLayers:
    """One :class:`PromptTreeLayers` whose tree-layer ``(pass, layer)`` holds the rows of every
    tree-layer ``(prompt, step, layer)`` with ``pass_of(prompt, step) == pass``, prompts in the
    order of ``datas``; ``step`` of the result is the pass number. Tree-layers without stored MoE
    inputs merge only with others without (a storage policy stores a layer for every tree or for
    none)."""
    pieces: dict[tuple[int, int], list[tuple[PromptTreeLayers, int]]] = {}
    for data in datas:
        for r in range(len(data)):
            key = (pass_of(data.prompt_index, int(data.step[r])), int(data.layer[r]))
            pieces.setdefault(key, []).append((data, r))
    keys = sorted(pieces)
    if not keys:
        return _empty(datas, index, name)

    def cat(attr: str):
        arrays = [getattr(d, attr) for d in datas]
        if any(a is None for a in arrays):
            return None
        return np.concatenate([getattr(d, attr)[d.rows(r)] for key in keys
                               for d, r in pieces[key]])

    sizes = [sum(d.rows(r).stop - d.rows(r).start for d, r in pieces[key]) for key in keys]
    trees = np.array([sum(1 if d.trees is None else int(d.trees[r]) for d, r in pieces[key])
                      for key in keys], dtype=np.int64)
    return PromptTreeLayers(
        prompt_index=index, prompt_id=name,
        step=np.array([k[0] for k in keys], dtype=np.int64),
        layer=np.array([k[1] for k in keys], dtype=np.int64),
        bounds=np.r_[0, np.cumsum(sizes)].astype(np.int64),
        probs=cat("probs"), topk_ids=cat("topk_ids"), topk_weights=cat("topk_weights"),
        hidden=cat("hidden"), output=cat("output"), output_norm=cat("output_norm"), trees=trees)


def _empty(datas: list[PromptTreeLayers], index: int, name: str) -> PromptTreeLayers:
    like = datas[0]
    return PromptTreeLayers(index, name, np.zeros(0, np.int64), np.zeros(0, np.int64),
                            np.zeros(1, np.int64), like.probs[:0], like.topk_ids[:0],
                            like.topk_weights[:0], None if like.hidden is None else
                            like.hidden[:0], None if like.output is None else like.output[:0],
                            None if like.output_norm is None else like.output_norm[:0],
                            np.zeros(0, np.int64))


class PromptSource:
    """What the open-loop engine scores, unit by unit: each prompt of a run, chunk by chunk."""

    def __init__(self, run):
        self.run = run

    def keys(self) -> list[int]:
        return self.run.prompt_indices()

    def chunks(self, key: int):
        from moe_spec.catalog.reader import prompt_chunks
        return prompt_chunks(self.run, key)

    def members(self, key: int) -> list[int]:
        """The prompts of unit ``key`` (closed loop replays them together): the prompt alone."""
        return [key]

    def pass_of(self) -> Callable[[int, int], int]:
        """Each tree is a pass of its own: its step."""
        return virtual_passes()


class BatchSource:
    """Each (virtual) batch of a run as one unit: its passes merged into tree-layers of all
    their trees' tokens. ``key`` numbers the batch; a batch's prompts are read whole (every
    chunk), so memory holds b prompts' tensors at a time."""

    def __init__(self, run, batch_size: int, seed: int):
        self.run, self.batch_size, self.seed = run, batch_size, seed
        captured = int(run.manifest.get("settings", {}).get("batch_size", 1) or 1)
        if captured > 1 and captured != batch_size:
            raise ValueError(f"run {run.name} was captured with --batch-size {captured}; replay "
                             f"it with --batch-size {captured} (its real passes) or 1")
        self.real = captured > 1
        prompts = run.prompt_indices()
        self.groups = [sorted(prompts)] if self.real else groups(prompts, batch_size, seed)
        self._passes = None

    def keys(self) -> list[int]:
        return list(range(len(self.groups)))

    def members(self, key: int) -> list[int]:
        return self.groups[key]

    def name(self, key: int, ids: dict[int, str]) -> str:
        """The batch's prompt ids joined by ``+`` (a prompt that stopped before its first pass
        has no rows to name it: its id comes from the manifest)."""
        listed = self.run.manifest.get("prompt_ids", [])
        offset = int(self.run.settings.get("offset", 0) or 0)
        return "+".join(ids.get(p) or (listed[p - offset] if 0 <= p - offset < len(listed)
                                       else str(p)) for p in self.groups[key])

    def pass_of(self) -> Callable[[int, int], int]:
        if not self.real:
            return virtual_passes()
        if self._passes is None:
            from moe_spec.catalog.location import read_table  # a local folder or an object store
            t = read_table(self.run.files("trees"), columns=["prompt_index", "step",
                                                             "batch_pass"])
            self._passes = {(int(p), int(s)): int(b) for p, s, b in zip(
                *(t[c].to_pylist() for c in ("prompt_index", "step", "batch_pass")))}
        return real_passes(self._passes)

    def chunks(self, key: int):
        from moe_spec.catalog.reader import prompt_chunks
        datas = [d for p in self.groups[key] for d in prompt_chunks(self.run, p)]
        if not datas:
            return
        ids = {d.prompt_index: d.prompt_id for d in datas}
        yield merge(datas, self.pass_of(), index=key, name=self.name(key, ids))


def virtual_passes() -> Callable[[int, int], int]:
    """A virtual group's pass of (prompt, step): the step itself."""
    return lambda prompt, step: step


def real_passes(batch_pass: dict[tuple[int, int], int]) -> Callable[[int, int], int]:
    """A batched capture's pass of (prompt, step), from its trees table."""
    return lambda prompt, step: batch_pass[(prompt, step)]
