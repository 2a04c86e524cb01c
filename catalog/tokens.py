"""Decode tokens: the top-k expert ids of every token a run's target routed while generating, per
(request, token, MoE layer), read the same way from a capture and from a routing-only run.

Token ``j`` of a request is the forward pass of its ``j``-th generated token (``j = 0``: the first
token, sampled from the prompt's prefill; its position in the sequence is the prompt's length),
which is what a serving engine's routed-experts rows for the generated part hold: an engine
returns one row per *forwarded* token, so a request with C generated tokens has C − 1 decode
rows (the last token is never forwarded).

* **A capture** (EAGLE trees): token ``j`` is the tree node on the accepted path at position
  ``prefix_len + depth = len(prompt) + j`` of its verification pass; its routing is that node's
  row of ``routing`` (the same ids a one-token decode would route, up to the kernel's numerics).
  Tokens ``j < C − 1`` are kept (C = the output's length: drafts accepted past ``max_new_tokens``
  or an end token were forwarded, but are not part of the output, as in an engine). A batched
  capture records its passes (``trees.batch_pass``): each token's ``step``.
* **A routing-only run** (``import-routing``): its ``routing_ids`` rows, tokens ``j ≥ 0`` (the
  prompt's rows, ``j < 0``, only with ``prompt_tokens=True``), ``step`` where the source recorded
  its forward passes.

:func:`chunks` yields :class:`Tokens` in (request, token) order, a request at a time for a
capture and a committed part at a time for an import (a long request spans chunks), so memory is
bounded by one part. Pyarrow and numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa

from moe_spec.catalog import location, reader, schema
from moe_spec.catalog.runs import CatalogError, Run


@dataclass
class Tokens:
    """Consecutive decode tokens of one or more requests, in (request, token) order."""

    prompt_index: np.ndarray  # [T] int64: the request (its index in the run)
    token: np.ndarray  # [T] int64: j, 0 = the first generated token's forward
    ids: np.ndarray  # [T, L, k] int16: top-k ids at each MoE layer (the run's moe_layers order)
    step: np.ndarray | None  # [T] int64: the recorded forward pass, or None (none recorded)
    prompt_ids: dict[int, str]  # request index -> the request's id

    def __len__(self) -> int:
        return len(self.token)


def layers_of(run: Run) -> list[int]:
    return [int(x) for x in run.manifest["moe_layers"]]


def chunks(run: Run, *, prompt_tokens: bool = False) -> Iterator[Tokens]:
    """Every decode token of ``run`` (and, for an import with ``prompt_tokens``, its prompt
    rows too), in (request, token) order."""
    if run.routing_only:
        yield from _imported(run, prompt_tokens)
    else:
        for index in run.prompt_indices():
            found = captured_prompt(run, index)
            if found is not None:
                yield found


@dataclass
class Request:
    """One request of a run, whole: its decode tokens (possibly none) and what the run knows of
    it (prompt length, output token ids, why it stopped)."""

    index: int
    prompt_id: str
    tokens: Tokens  # this request's tokens only (maybe empty)
    prompt_len: int | None  # None where the source gave no prompt
    output_token_ids: list[int] | None
    stop_reason: str | None


def _empty(run: Run, index: int, prompt_id: str) -> Tokens:
    shape = (0, len(layers_of(run)), int(run.manifest["top_k"]))
    return Tokens(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(shape, np.int16),
                  None, {index: prompt_id})


def requests(run: Run, *, prompt_tokens: bool = False) -> Iterator[Request]:
    """Every request of ``run`` in order, requests without a decode token included (a virtual
    batch of b consecutive requests counts them), one whole request at a time."""
    pending: list[Tokens] = []

    def take(index: int, prompt_id: str) -> Tokens:
        mine = [t for t in pending if len(t) and t.prompt_index[0] == index]
        if not mine:
            return _empty(run, index, prompt_id)
        if len(mine) == 1:
            return mine[0]
        steps = [t.step for t in mine]
        return Tokens(np.concatenate([t.prompt_index for t in mine]),
                      np.concatenate([t.token for t in mine]),
                      np.concatenate([t.ids for t in mine]),
                      None if any(s is None for s in steps) else np.concatenate(steps),
                      {index: prompt_id})

    tokens = _split_by_request(chunks(run, prompt_tokens=prompt_tokens))
    for seq in sequences(run):
        index = seq["prompt_index"]
        pending = [t for t in pending if len(t) and t.prompt_index[0] >= index]
        while not pending or pending[-1].prompt_index[0] <= index:
            nxt = next(tokens, None)
            if nxt is None:
                break
            pending.append(nxt)
        prompt = seq["prompt_token_ids"]
        yield Request(index, seq["prompt_id"], take(index, seq["prompt_id"]),
                      len(prompt) if prompt is not None else seq.get("prompt_tokens"),
                      seq["output_token_ids"], seq["stop_reason"])


def _split_by_request(source: Iterator[Tokens]) -> Iterator[Tokens]:
    """Chunks cut at request boundaries: each yielded piece holds one request's tokens."""
    for t in source:
        if not len(t):
            continue
        cuts = np.flatnonzero(np.r_[True, t.prompt_index[1:] != t.prompt_index[:-1],
                                    True])
        for a, b in zip(cuts[:-1], cuts[1:]):
            index = int(t.prompt_index[a])
            yield Tokens(t.prompt_index[a:b], t.token[a:b], t.ids[a:b],
                         None if t.step is None else t.step[a:b],
                         {index: t.prompt_ids.get(index, str(index))})


def sequences(run: Run) -> Iterator[dict]:
    """The ``sequences`` rows of ``run`` in request order (one part at a time)."""
    columns = ["prompt_index", "prompt_id", "prompt_token_ids", "output_token_ids", "steps",
               "stop_reason"]
    parts = run.files("sequences") if run.routing_only else None
    if parts is None:
        for index in run.prompt_indices():
            t = reader.read_parts(run, "sequences", index, columns)
            yield from t.to_pylist()
        return
    for path in parts:
        try:  # a routing-only run's parts are small: read whole, the prompt count where stored
            t = location.read_table(path, page_checksum_verification=True)
            t = t.select([c for c in columns + ["prompt_tokens"] if c in t.column_names])
        except (pa.ArrowException, OSError) as exc:
            raise CatalogError(f"{path}: corrupt or unreadable sequences part "
                               f"({reader.reason(exc, path)}); import the routing again") from exc
        yield from t.to_pylist()


# --- a routing-only run ------------------------------------------------------------------------
ID_COLUMNS = ["prompt_index", "prompt_id", "token", "layer", "topk_ids", "step"]


def _imported(run: Run, prompt_tokens: bool) -> Iterator[Tokens]:
    layers = np.asarray(layers_of(run), np.int64)
    k = int(run.manifest["top_k"])
    for path in run.files(schema.ROUTING_IDS):
        yield read_ids_part(path, layers, k, prompt_tokens)


def read_ids_part(path, layers: np.ndarray, k: int, prompt_tokens: bool = False) -> Tokens:
    """One committed ``routing_ids`` part as :class:`Tokens` (checked: every token's rows are
    its MoE layers in order, k ids each)."""
    try:
        t = location.read_table(path, columns=ID_COLUMNS, page_checksum_verification=True)
        reader.expected_types(t, schema.ROUTING_IDS)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CatalogError(f"{path}: corrupt or unreadable routing_ids part "
                           f"({reader.reason(exc, path)}); import the routing again") from exc
    rows, width = t.num_rows, len(layers)
    fix = "the part is damaged; import the routing again"
    ids_col = t["topk_ids"].combine_chunks()
    if ids_col.null_count or (rows and len(ids_col.flatten()) != rows * k) or rows % width:
        raise CatalogError(f"{path}: routing_ids rows are not {width} MoE layers × k={k} ids "
                           f"per token; {fix}")
    layer = t["layer"].to_numpy().astype(np.int64)
    if rows and not np.array_equal(layer.reshape(-1, width), np.broadcast_to(
            layers, (rows // width, width))):
        raise CatalogError(f"{path}: a token's routing_ids rows are not the run's MoE layers "
                           f"{layers.tolist()} in order; {fix}")
    first = slice(0, rows, width)
    prompt = t["prompt_index"].to_numpy()[first].astype(np.int64)
    token = t["token"].to_numpy()[first].astype(np.int64)
    ids = ids_col.flatten().to_numpy().astype(np.int16).reshape(-1, width, k)
    step_col = t["step"].combine_chunks()
    step = None if step_col.null_count == rows else \
        step_col.fill_null(-1).to_numpy().astype(np.int64)[first]
    names = t["prompt_id"].to_numpy(zero_copy_only=False)[first]
    starts = np.flatnonzero(np.r_[True, prompt[1:] != prompt[:-1]]) if len(prompt) else []
    prompt_ids = {int(prompt[i]): str(names[i]) for i in starts}
    if not prompt_tokens:
        keep = token >= 0
        if not keep.all():
            prompt, token, ids = prompt[keep], token[keep], ids[keep]
            step = step[keep] if step is not None else None
    return Tokens(prompt, token, ids, step, prompt_ids)


# --- a capture ---------------------------------------------------------------------------------
def captured_prompt(run: Run, index: int) -> Tokens | None:
    """The decode tokens of prompt ``index`` of a capture: the accepted path of every pass, in
    output order (None for a prompt without a decode token)."""
    seq = reader.read_parts(run, "sequences", index,
                            ["prompt_id", "prompt_token_ids", "output_token_ids"])
    if not seq.num_rows:
        return None
    prompt_id = seq["prompt_id"][0].as_py()
    p = len(seq["prompt_token_ids"][0].as_py() or [])
    c = len(seq["output_token_ids"][0].as_py() or [])
    wanted = c - 1  # forwarded tokens that are part of the output
    if wanted <= 0:
        return None
    trees = reader.read_parts(run, "trees", index, ["step", "prefix_len", "batch_pass"]
                              if "batch_pass" in _columns(run, "trees", index) else
                              ["step", "prefix_len"])
    nodes = reader.read_parts(run, "nodes", index, ["step", "node", "depth", "accepted"])
    routing = reader.read_parts(run, "routing", index, ["step", "layer", "node", "topk_ids"])
    fix = f"the trace of run {run.name} is damaged; recapture the run"
    steps = trees["step"].to_numpy().astype(np.int64)
    prefix = dict(zip(steps.tolist(), trees["prefix_len"].to_numpy().astype(np.int64).tolist()))
    passes = None
    if "batch_pass" in trees.column_names and trees["batch_pass"].null_count < trees.num_rows:
        passes = dict(zip(steps.tolist(),
                          trees["batch_pass"].fill_null(-1).to_numpy().astype(np.int64).tolist()))
    acc = nodes["accepted"].to_numpy(zero_copy_only=False).astype(bool)
    n_step = nodes["step"].to_numpy().astype(np.int64)[acc]
    n_node = nodes["node"].to_numpy().astype(np.int64)[acc]
    n_depth = nodes["depth"].to_numpy().astype(np.int64)[acc]
    try:
        j = np.array([prefix[s] for s in n_step.tolist()], np.int64) + n_depth - p
    except KeyError:
        raise CatalogError(f"prompt {index} of run {run.name} has accepted nodes of a pass its "
                           f"trees table lacks; {fix}") from None
    keep = j < wanted
    j, n_step, n_node = j[keep], n_step[keep], n_node[keep]
    order = np.argsort(j, kind="stable")
    j, n_step, n_node = j[order], n_step[order], n_node[order]
    if not np.array_equal(j, np.arange(wanted)):
        raise CatalogError(f"prompt {index} of run {run.name}: the accepted paths do not cover "
                           f"its {wanted} decode tokens once each; {fix}")
    layers = np.asarray(layers_of(run), np.int64)
    k = int(run.manifest["top_k"])
    r_step = routing["step"].to_numpy().astype(np.int64)
    r_layer = routing["layer"].to_numpy().astype(np.int64)
    r_node = routing["node"].to_numpy().astype(np.int64)
    r_ids = reader.matrix(routing["topk_ids"], np.int16) if routing.num_rows else \
        np.zeros((0, k), np.int16)
    if r_ids.shape[1:] != (k,) and routing.num_rows:
        raise CatalogError(f"prompt {index} of run {run.name}: routing rows hold "
                           f"{r_ids.shape[1]} ids, the run's top-k is {k}; {fix}")
    lpos = np.full(int(layers.max()) + 1 if len(layers) else 1, -1, np.int64)
    lpos[layers] = np.arange(len(layers))
    m = int(max(r_node.max(initial=0), n_node.max(initial=0))) + 1
    s_hi = int(max(r_step.max(initial=0), n_step.max(initial=0))) + 1
    slot = np.full(s_hi * m, -1, np.int64)  # (step, node) -> decode token
    slot[n_step * m + n_node] = np.arange(wanted)
    in_range = (r_layer >= 0) & (r_layer < len(lpos))
    tok = np.where(in_range, slot[r_step * m + r_node], -1)
    li = np.where(in_range, lpos[np.clip(r_layer, 0, len(lpos) - 1)], -1)
    use = (tok >= 0) & (li >= 0)
    ids = np.full((wanted, len(layers), k), -1, np.int16)
    ids[tok[use], li[use]] = r_ids[use]
    if (ids < 0).any():
        raise CatalogError(f"prompt {index} of run {run.name}: an accepted node lacks its "
                           f"routing row at some MoE layer; {fix}")
    step = np.array([passes[s] for s in n_step.tolist()], np.int64) if passes else None
    return Tokens(np.full(wanted, index, np.int64), j, ids, step, {index: prompt_id})


def _columns(run: Run, table: str, index: int) -> list[str]:
    parts = run.parts(table, index)
    return list(location.read_schema(parts[0]).names) if parts else []


# --- batch passes --------------------------------------------------------------------------------
DEFAULT_BATCH = 8  # b of virtual batches where a run sets none (import-routing --batch-size)
BATCHINGS = ("auto", "recorded", "virtual")


@dataclass
class Passes:
    """Forward passes, each the tokens verified together: pass ``p`` holds rows
    ``bounds[p]:bounds[p + 1]`` of ``ids`` (its tokens in order)."""

    group: np.ndarray  # [P] virtual: the batch (b consecutive requests); recorded: the request
    step: np.ndarray  # [P] virtual: the decode position j; recorded: the source's step
    bounds: np.ndarray  # [P + 1]
    ids: np.ndarray  # [rows, L, k] int16

    def __len__(self) -> int:
        return len(self.step)


def records_passes(run: Run) -> bool:
    """Whether ``run`` recorded which tokens were verified together: a batched capture
    (``trees.batch_pass``), or an import whose source records forward passes (Megatron's steps,
    llama.cpp's ubatches)."""
    if run.routing_only:
        return bool(run.settings.get("recorded_passes", run.settings.get("batching") ==
                                     "recorded"))
    return int(run.settings.get("batch_size") or 1) > 1


def resolve_batching(run: Run, batching: str = "auto", batch_size: int | None = None) \
        -> tuple[str, int | None]:
    """(``recorded`` or ``virtual``, b of virtual batches): ``auto`` takes the recorded passes
    where the run has them; b defaults to the run's ``virtual_batch_size`` (imports), else
    :data:`DEFAULT_BATCH`."""
    if batching not in BATCHINGS:
        raise ValueError(f"batching {batching!r} is not one of {', '.join(BATCHINGS)}")
    if batching == "recorded" and not records_passes(run):
        raise CatalogError(f"run {run.name} records no batch passes (a capture at batch size 1, "
                           "or a source without steps); use virtual batches")
    default = run.settings.get("batching") if run.routing_only else None  # the import's choice
    auto = default if default in ("recorded", "virtual") else \
        ("recorded" if records_passes(run) else "virtual")
    kind = auto if batching == "auto" else batching
    if kind == "recorded":
        return kind, None
    b = batch_size or int(run.settings.get("virtual_batch_size") or DEFAULT_BATCH)
    if b < 1:
        raise ValueError(f"batch size {b} must be at least 1")
    return kind, b


def passes(run: Run, *, batching: str = "auto", batch_size: int | None = None) \
        -> Iterator[Passes]:
    """The run's decode tokens as forward passes, in order, a block of whole passes at a time.

    * **virtual** (b): requests in order, cut into batches of b consecutive requests (those that
      arrived together); pass (batch, j) holds token j of each of the batch's requests that
      reached it, in request order (as a real batch whose sequences started together; a request
      that stopped leaves it);
    * **recorded**: the source's passes: an import's (request, step), its tokens in source order;
      a batched capture's ``batch_pass``, its tokens by request then position."""
    kind, b = resolve_batching(run, batching, batch_size)
    if kind == "virtual":
        yield from _virtual(run, b)
    elif run.routing_only:
        yield from _recorded_stream(run)
    else:
        yield from _recorded_capture(run)


def _virtual(run: Run, b: int) -> Iterator[Passes]:
    batch: list[Tokens] = []
    number = 0
    for req in requests(run):
        batch.append(req.tokens)
        if len(batch) == b:
            found = _virtual_batch(batch, number)
            if found is not None:
                yield found
            batch, number = [], number + 1
    if batch:
        found = _virtual_batch(batch, number)
        if found is not None:
            yield found


def _virtual_batch(batch: list[Tokens], number: int) -> Passes | None:
    sizes = [len(t) for t in batch]
    if not sum(sizes):
        return None
    token = np.concatenate([t.token for t in batch])
    slot = np.repeat(np.arange(len(batch)), sizes)
    ids = np.concatenate([t.ids for t in batch])
    order = np.lexsort((slot, token))  # by decode position, then request
    token, ids = token[order], ids[order]
    steps, counts = np.unique(token, return_counts=True)
    return Passes(np.full(len(steps), number, np.int64), steps.astype(np.int64),
                  np.r_[0, np.cumsum(counts)].astype(np.int64), ids)


def _recorded_stream(run: Run) -> Iterator[Passes]:
    """An import's passes: consecutive tokens with the same (request, step); a pass cut by a
    part's end continues in the next part."""
    carry: Tokens | None = None
    for t in chunks(run):
        if not len(t):
            continue
        if t.step is None or (t.step < 0).any():
            raise CatalogError(f"run {run.name} says its passes were recorded, but a part has "
                               "tokens without a step; import the routing again")
        if carry is not None:
            t = Tokens(np.concatenate([carry.prompt_index, t.prompt_index]),
                       np.concatenate([carry.token, t.token]), np.concatenate([carry.ids, t.ids]),
                       np.concatenate([carry.step, t.step]), t.prompt_ids)
        key_p, key_s = t.prompt_index, t.step
        starts = np.flatnonzero(np.r_[True, (key_p[1:] != key_p[:-1]) | (key_s[1:] != key_s[:-1])])
        last = starts[-1]
        carry = Tokens(t.prompt_index[last:], t.token[last:], t.ids[last:], t.step[last:], {})
        if last:
            yield Passes(key_p[starts[:-1]].astype(np.int64), key_s[starts[:-1]].astype(np.int64),
                         starts.astype(np.int64), t.ids[:last])
    if carry is not None and len(carry):
        yield Passes(carry.prompt_index[:1].astype(np.int64), carry.step[:1].astype(np.int64),
                     np.array([0, len(carry)], np.int64), carry.ids)


def _recorded_capture(run: Run) -> Iterator[Passes]:
    """A batched capture's passes (``trees.batch_pass``): every decode token at once (a pass
    holds tokens of several requests)."""
    found = [t for t in chunks(run) if len(t)]
    if not found:
        return
    step = np.concatenate([t.step if t.step is not None else np.full(len(t), -1)
                           for t in found])
    if (step < 0).any():
        raise CatalogError(f"run {run.name} was captured with a batch size but some trees name "
                           "no batch_pass; recapture the run")
    prompt = np.concatenate([t.prompt_index for t in found])
    token = np.concatenate([t.token for t in found])
    ids = np.concatenate([t.ids for t in found])
    order = np.lexsort((token, prompt, step))
    step, ids = step[order], ids[order]
    keys, counts = np.unique(step, return_counts=True)
    yield Passes(np.zeros(len(keys), np.int64), keys.astype(np.int64),
                 np.r_[0, np.cumsum(counts)].astype(np.int64), ids)
