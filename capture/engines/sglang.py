"""SGLang: ``--enable-return-routed-experts`` (server) with ``return_routed_experts: true`` (per
request).

Read as SGLang writes it (sgl-project/sglang; JSONL, one response per line, a list of responses
per line accepted: a batch request):

* ``/generate`` (``python/sglang/srt/managers/tokenizer_manager.py``, ``meta_info``):
  ``routed_experts`` (``routed_experts_capturer.py``: base64 of the ids' bytes, flattened
  ``[rows, layers, top_k]``), ``prompt_tokens``, ``completion_tokens``, ``id``,
  ``finish_reason``, ``e2e_latency``; ``output_ids`` where present;
* the OpenAI-compatible endpoints (``entrypoints/openai/serving_chat.py``
  ``_build_chat_response``, ``serving_completions.py`` ``_build_completion_response``, since
  PR 17648): a response-level ``sglext`` holding ``routed_experts`` built from the first result
  only, ``usage`` for the counts; with n > 1 the other choices' routing is not returned (counted
  as skipped), choice 0's length from ``sglext.output_ids``; older versions' per-choice
  ``meta_info`` / ``sgl_ext`` are read too;
* the ids are int32, or what ``meta_info.routed_experts_dtype`` says (``uint8``, ``uint16``:
  an open SGLang PR).

The rows cover positions ``[s, prompt + completion − 1)`` (the last generated token is never
forwarded), s being the request's ``routed_experts_start_len`` (default 0), a request field the
response never echoes: ``--prompt-start`` gives it (``auto``: from each response's length, refused
where two layer layouts would fit). Row r is position ``s + r``: decode token j = ``s + r −
prompt`` (j < 0: prompt rows, kept with ``--tokens all``). The layer axis has a slot per decoder
layer (SGLang's buffer: dense layers' slots hold a fill value) or per MoE layer.

Write (``export-routing --format sglang``): one ``/generate`` response per request with fields
SGLang writes, the ids int32 in a slot per decoder layer (dense slots 0), the decode rows only (a
capture records no prefill routing; the request would have sent ``routed_experts_start_len`` =
its prompt length): import it with ``--prompt-start prompt``.
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
    finite,
    jsonl,
    layer_slots,
    resolve_start,
    source_files,
    whole,
)

NAME = "sglang"
VERSION = "sglang-routed-experts-base64-int32"


def _choices(record: object, where: str, skipped: dict) \
        -> Iterator[tuple[dict, dict, str, dict]]:
    """(holder of routed_experts, counts, id, fields) of every completion a response routes."""
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
    ext = record.get("sglext")
    if isinstance(ext, dict) and "routed_experts" in ext:  # response level: choice 0's routing
        first = choices[0] if isinstance(choices[0], dict) else {}
        counts = dict(usage)
        if isinstance(ext.get("input_ids"), list):
            counts["prompt_tokens"] = len(ext["input_ids"])
        outs = ext.get("output_ids")
        if len(choices) > 1:
            if not (isinstance(outs, list) and outs and isinstance(outs[0], list)):
                raise SourceError(f"{where}: {len(choices)} choices and one usage count: "
                                  "sglext's routing is choice 0's, whose length only "
                                  "sglext.output_ids gives (request return_output_ids_in_sglext"
                                  ", or n = 1)")
            skipped["choices without routing (SGLang's sglext holds choice 0's only)"] = \
                skipped.get("choices without routing (SGLang's sglext holds choice 0's only)",
                            0) + len(choices) - 1
        if isinstance(outs, list) and outs and isinstance(outs[0], list):
            counts["completion_tokens"] = len(outs[0])
            first = {**first, "output_ids": outs[0]}
        yield ext, counts, str(record.get("id", where)), {**record, **first}
        return
    for i, choice in enumerate(choices):  # before PR 17648: per choice
        if not isinstance(choice, dict):
            raise SourceError(f"{where}: choice {i} is not an object")
        meta = choice.get("meta_info") if isinstance(choice.get("meta_info"), dict) else \
            choice.get("sgl_ext") if isinstance(choice.get("sgl_ext"), dict) else None
        if meta is None:
            raise SourceError(f"{where}: no routed_experts in sglext (the response level, "
                              f"SGLang ≥ PR 17648) nor in choice {i}'s meta_info / sgl_ext "
                              "(request return_routed_experts)")
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


DTYPES = {None: "<i4", "int32": "<i4", "uint8": "u1", "uint16": "<u2"}


def decode(meta: dict, counts: dict, rid: str, record: dict, facts: ModelFacts,
           options: ReadOptions, where: str) -> Piece:
    """One completion's routing as a :class:`Piece` (checked)."""
    if meta.get("routed_experts") is None:
        raise SourceError(f"{where}: no routed_experts (start the server with "
                          "--enable-return-routed-experts and send return_routed_experts: true)")
    p = whole(counts.get("prompt_tokens"), where, "prompt_tokens")
    c = whole(counts.get("completion_tokens"), where, "completion_tokens", low=1)
    dtype = meta.get("routed_experts_dtype")
    if not (dtype is None or isinstance(dtype, str)) or dtype not in DTYPES:
        raise SourceError(f"{where}: routed_experts_dtype {str(dtype)[:40]!r}: SGLang writes "
                          "int32, uint8 or uint16")
    raw = b64_bytes(meta["routed_experts"], where, "routed_experts")
    size = np.dtype(DTYPES[dtype]).itemsize
    if len(raw) % size:
        raise SourceError(f"{where}: routed_experts holds {len(raw)} bytes, not whole "
                          f"{dtype or 'int32'} ids")
    flat = np.frombuffer(raw, DTYPES[dtype])
    arr, start = _shaped(flat, facts, options, where, p, c)
    token = np.arange(start, start + len(arr), dtype=np.int64) - p
    keep = token >= 0 if options.tokens == "decode" else np.ones(len(token), bool)
    ids = checked_ids(arr[keep], facts, options, where)
    output = record.get("output_ids")
    if output is not None:
        if not isinstance(output, list):
            raise SourceError(f"{where}: output_ids is not a list")
        for x in output:
            whole(x, where, "output_ids")
    return Piece(rid, ids, token[keep].astype(np.int32),
                 timestamp=finite(record.get("created"), where, "created"),
                 prompt_tokens=p, output_token_ids=output,
                 finish_reason=_finish(meta.get("finish_reason")),
                 seconds=finite(meta.get("e2e_latency"), where, "e2e_latency"))


def _shaped(flat: np.ndarray, facts: ModelFacts, options: ReadOptions, where: str, p: int,
            c: int) -> tuple[np.ndarray, int]:
    """The flat ids as ``[rows, MoE layers, width]`` (the layer axis per MoE or per decoder
    layer, the width k or k + fused shared experts) and the first position they cover."""
    k, s = facts.top_k, facts.shared_experts
    layouts = sorted({(lay, w) for w in (k, k + s) if w
                      for lay in (len(facts.moe_layers), facts.num_layers)})
    fits = []  # (rows, layers, width) whose start lies within the prompt
    for lay, w in layouts:
        if flat.size % (lay * w) == 0:
            rows = flat.size // (lay * w)
            if 0 <= p + c - 1 - rows <= p:
                fits.append((rows, lay, w))
    if options.prompt_start == "auto":
        if len({r for r, _, _ in fits}) > 1:
            raise SourceError(f"{where}: {flat.size} ids fit {len(fits)} layer layouts with "
                              "different starts: the response cannot tell its "
                              "routed_experts_start_len; pass --prompt-start N")
        implied = p + c - 1 - fits[0][0] if fits else None
    else:
        want = p if options.prompt_start == "prompt" else int(options.prompt_start)
        match = [f for f in fits if p + c - 1 - f[0] == want]
        if not match:
            other = sorted({p + c - 1 - r for r, _, _ in fits})
            raise SourceError(
                f"{where}: routed_experts holds {flat.size} ids: not (prompt {p} + completion "
                f"{c} − 1 − start {want}) tokens × {len(facts.moe_layers)} or "
                f"{facts.num_layers} layer slots × top-{k} of {facts.describe()}: wrong shape, "
                "or the layer count disagrees with the config" + (
                    f" (they would fit a start of {other[0]}: if the request set "
                    f"routed_experts_start_len, which the response does not echo, pass "
                    f"--prompt-start {other[0]})" if other else ""))
        fits = match
        implied = want
    if not fits:
        raise SourceError(f"{where}: routed_experts holds {flat.size} ids: not a whole number "
                          f"of forwarded tokens (prompt {p} + completion {c} − 1 − start) × "
                          f"{len(facts.moe_layers)} or {facts.num_layers} layer slots × "
                          f"top-{k} of {facts.describe()}: wrong shape")
    start = resolve_start(options.prompt_start, p, implied, where, "routed_experts_start_len")
    rows, layers, width = fits[0]
    arr = flat.reshape(rows, layers, width)
    if rows:
        check_dense_fill(arr, facts, where)
    return arr[:, layer_slots(layers, facts, where)], start


def read(source: Path, facts: ModelFacts, options: ReadOptions,
         progress: Callable[[int], None] | None = None, skipped: dict | None = None) \
        -> Iterator[Piece]:
    skipped = skipped if skipped is not None else {}
    for path in source_files(source, "*.jsonl"):
        for number, value, taken in jsonl(path, progress, cut_out=b"routed_experts"):
            for r, record in enumerate(value if isinstance(value, list) else [value]):
                where = f"{path} line {number}" + (f" (response {r})" if isinstance(value, list)
                                                   else "")
                for meta, counts, rid, full in _choices(record, where, skipped):
                    if meta.get("routed_experts") == CUT:  # the base64, never JSON-decoded
                        meta["routed_experts"] = taken
                    yield decode(meta, counts, rid, full, facts, options, where)


def write(requests, dest: Path, facts: ModelFacts) -> tuple[list[Path], int]:
    """One ``/generate`` response per request into ``dest`` (a .jsonl file), decode rows only
    (no ``routed_experts_start_len``: SGLang never writes it); returns the files and the
    requests written."""
    count = 0
    with open(dest, "w", encoding="utf-8") as f:
        for req in requests:
            t = req.tokens
            p = req.prompt_len or 0
            c = len(t) + 1
            full = np.zeros((len(t), facts.num_layers, facts.top_k), np.int32)
            full[:, list(facts.moe_layers)] = t.ids
            out = req.output_token_ids
            meta = dict(id=req.prompt_id, finish_reason=(
                {"type": req.stop_reason} if req.stop_reason else None), prompt_tokens=p,
                        completion_tokens=c,
                        routed_experts=base64.b64encode(full.astype("<i4").tobytes())
                        .decode("ascii"))
            record = {"meta_info": meta}
            if out is not None and len(out) >= c:
                record["output_ids"] = list(out[:c])
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            count += 1
    return [dest], count
