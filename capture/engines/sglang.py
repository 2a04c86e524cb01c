"""SGLang: ``--enable-return-routed-experts`` (server) with ``return_routed_experts: true`` (per
request).

Read: JSONL, one response per line (a list of responses per line is accepted: a batch request),
as ``/generate`` returns it (``meta_info``) or as the OpenAI-compatible endpoints return it
(``choices[i]`` holding ``meta_info`` or ``sgl_ext``, ``usage`` for the token counts):

* ``routed_experts``: base64 of int32 ids, flattened ``[rows, layers, top_k]``, covering the
  positions ``[routed_experts_start_len, prompt_tokens + completion_tokens − 1)`` (the last
  generated token is never forwarded), so ``rows = prompt + completion − 1 − start_len``; the
  layer axis has a slot per decoder layer (SGLang's buffer: dense layers' slots hold a fill
  value) or per MoE layer;
* ``prompt_tokens``, ``completion_tokens`` (required), ``routed_experts_start_len`` (default 0),
  ``id`` (the request id; else the line and choice), ``finish_reason``, ``e2e_latency``;
  ``output_ids`` where present.

Row r is position ``start_len + r``; decode token j = ``start_len + r − prompt_tokens`` (j < 0:
prompt rows, kept with ``--tokens all``).

Write (``export-routing --format sglang``): one ``/generate``-style response per request, the
ids in a slot per decoder layer (dense slots 0, as SGLang's zero-filled buffer), start_len = the
prompt's length (decode rows only: a capture records no prefill routing).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moe_spec.capture.engines.base import (
    CUT,
    ModelFacts,
    Piece,
    ReadOptions,
    SourceError,
    b64_bytes,
    check_dense_fill,
    checked_ids,
    jsonl,
    layer_slots,
    source_files,
    whole,
)

NAME = "sglang"
VERSION = "sglang-routed-experts-base64-int32"


def _choices(record: object, where: str) -> Iterator[tuple[dict, dict, str, dict]]:
    """(meta, counts, id, record) of every completion a response holds."""
    if not isinstance(record, dict):
        raise SourceError(f"{where}: a record is a {type(record).__name__}, not a JSON object")
    if isinstance(record.get("meta_info"), dict):
        meta = record["meta_info"]
        yield meta, meta, str(meta.get("id", where)), record
        return
    choices = record.get("choices")
    if not isinstance(choices, list) or not choices:
        raise SourceError(f"{where}: no meta_info and no choices: not an SGLang response with "
                          "routed experts (request it with return_routed_experts)")
    usage = record.get("usage") if isinstance(record.get("usage"), dict) else {}
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise SourceError(f"{where}: choice {i} is not an object")
        meta = choice.get("meta_info") if isinstance(choice.get("meta_info"), dict) else \
            choice.get("sgl_ext") if isinstance(choice.get("sgl_ext"), dict) else None
        if meta is None:
            raise SourceError(f"{where}: choice {i} has neither meta_info nor sgl_ext with "
                              "routed_experts")
        counts = {**usage, **{k: v for k, v in meta.items()
                              if k in ("prompt_tokens", "completion_tokens")}}
        if len(choices) > 1 and "completion_tokens" not in meta:
            raise SourceError(f"{where}: {len(choices)} choices share one usage count; each "
                              "choice's completion_tokens is needed")
        rid = str(record.get("id", where)) + (f"-{choice.get('index', i)}" if len(choices) > 1
                                              else "")
        yield meta, counts, rid, {**record, **choice}


def _finish(value) -> str | None:
    if isinstance(value, dict):
        return str(value.get("type")) if value.get("type") is not None else None
    return None if value is None else str(value)


def decode(meta: dict, counts: dict, rid: str, record: dict, facts: ModelFacts,
           options: ReadOptions, where: str) -> Piece:
    """One completion's routing as a :class:`Piece` (checked)."""
    if "routed_experts" not in meta:
        raise SourceError(f"{where}: no routed_experts (start the server with "
                          "--enable-return-routed-experts and send return_routed_experts: true)")
    p = whole(counts.get("prompt_tokens"), where, "prompt_tokens")
    c = whole(counts.get("completion_tokens"), where, "completion_tokens")
    start = whole(meta.get("routed_experts_start_len", 0) or 0, where,
                  "routed_experts_start_len")
    if start > p:
        raise SourceError(f"{where}: routed_experts_start_len {start} is past the prompt "
                          f"({p} tokens); SGLang takes 0 … prompt_tokens")
    raw = b64_bytes(meta["routed_experts"], where, "routed_experts")
    if len(raw) % 4:
        raise SourceError(f"{where}: routed_experts holds {len(raw)} bytes, not whole int32 ids")
    flat = np.frombuffer(raw, "<i4")
    rows = max(p + c - 1 - start, 0)
    if rows == 0:
        if flat.size:
            raise SourceError(f"{where}: routed_experts holds {flat.size} ids for 0 forwarded "
                              f"tokens (prompt {p}, completion {c}, start {start})")
        arr = np.zeros((0, len(facts.moe_layers), facts.top_k), np.int32)
    else:
        arr = _shaped(flat, rows, facts, where, p, c, start)
    token = np.arange(start, start + len(arr), dtype=np.int64) - p
    keep = token >= 0 if options.tokens == "decode" else np.ones(len(token), bool)
    ids = checked_ids(arr[keep], facts, options, where)
    output = record.get("output_ids")
    latency = meta.get("e2e_latency")
    return Piece(rid, ids, token[keep].astype(np.int32),
                 timestamp=float(record["created"]) if isinstance(record.get("created"),
                                                                   (int, float)) else None,
                 output_token_ids=[int(x) for x in output] if isinstance(output, list) else None,
                 finish_reason=_finish(meta.get("finish_reason")),
                 seconds=float(latency) if isinstance(latency, (int, float)) else None)


def _shaped(flat: np.ndarray, rows: int, facts: ModelFacts, where: str, p: int, c: int,
            start: int) -> np.ndarray:
    """The flat ids as ``[rows, MoE layers, width]`` (the layer axis per MoE or per decoder
    layer, the width k or k + fused shared experts)."""
    k, s = facts.top_k, facts.shared_experts
    if flat.size % rows:
        raise SourceError(f"{where}: routed_experts holds {flat.size} ids, not a whole number "
                          f"per forwarded token ({rows} = prompt {p} + completion {c} − 1 − "
                          f"start {start}): wrong shape")
    per = flat.size // rows
    shapes = [(lay, w) for w in (k, k + s) if w for lay in (len(facts.moe_layers),
                                                            facts.num_layers) if lay * w == per]
    if not shapes:
        raise SourceError(f"{where}: {per} ids per token, but {facts.describe()} routes "
                          f"{len(facts.moe_layers)} or {facts.num_layers} layer slots × top-{k}"
                          " (wrong shape, or the layer count disagrees with the config)")
    layers, width = shapes[0]
    arr = flat.reshape(rows, layers, width)
    check_dense_fill(arr, facts, where)
    return arr[:, layer_slots(layers, facts, where)]


def read(source: Path, facts: ModelFacts, options: ReadOptions,
         progress: Callable[[int], None] | None = None) -> Iterator[Piece]:
    for path in source_files(source, "*.jsonl"):
        for number, value, taken in jsonl(path, progress, cut_out=b"routed_experts"):
            for r, record in enumerate(value if isinstance(value, list) else [value]):
                where = f"{path} line {number}" + (f" (response {r})" if isinstance(value, list)
                                                   else "")
                for meta, counts, rid, full in _choices(record, where):
                    if meta.get("routed_experts") == CUT:  # the base64, never JSON-decoded
                        meta["routed_experts"] = taken
                    yield decode(meta, counts, rid, full, facts, options, where)


def write(requests, dest: Path, facts: ModelFacts) -> tuple[list[Path], int]:
    """One ``/generate``-style response per request into ``dest`` (a .jsonl file); returns the
    files and the requests written."""
    count = 0
    with open(dest, "w", encoding="utf-8") as f:
        for req in requests:
            t = req.tokens
            p = req.prompt_len or 0
            c = len(t) + 1
            full = np.zeros((len(t), facts.num_layers, facts.top_k), np.int32)
            full[:, list(facts.moe_layers)] = t.ids
            out = req.output_token_ids
            meta = dict(id=req.prompt_id, prompt_tokens=p, completion_tokens=c,
                        routed_experts_start_len=p, finish_reason=(
                            {"type": req.stop_reason} if req.stop_reason else None),
                        routed_experts=base64.b64encode(full.astype("<i4").tobytes())
                        .decode("ascii"))
            record = {"text": None, "meta_info": meta}
            if out is not None and len(out) >= c:
                record["output_ids"] = list(out[:c])
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            count += 1
    return [dest], count
