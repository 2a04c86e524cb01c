"""vLLM: ``--enable-return-routed-experts`` (``LLM(..., enable_return_routed_experts=True)``
offline). Logical expert ids (before EPLB's physical mapping).

Read: JSONL, one record per line, either

* an OpenAI-compatible response as ``vllm serve`` returns it (``response.model_dump()``): ``id``,
  ``created``, ``usage.prompt_tokens`` / ``usage.completion_tokens``, and per choice
  ``routed_experts`` (base64 of a ``.npy`` array, as the server encodes it, or nested lists),
  ``token_ids`` (with ``return_token_ids``: the choice's own completion length),
  ``finish_reason``; or
* a dump of an offline ``RequestOutput``: ``request_id``, ``prompt_token_ids``, ``outputs``
  (each ``token_ids``, ``routed_experts``, ``finish_reason``).

``routed_experts`` is ``[rows, num_moe_layers, top_k]`` (a layer axis with a slot per decoder
layer is accepted too). Two layouts, as vLLM versions differ:

* **whole sequence** (vLLM ≥ 0.22): one row per forwarded position, ``rows = prompt + completion
  − 1`` (``+ completion`` accepted, its last row dropped: the last generated token is never
  forwarded); decode token j is row ``prompt + j``;
* **split** (vLLM 0.21: the record has ``prompt_routed_experts`` at the response level, or null):
  ``routed_experts`` holds the generated tokens only, ``rows = completion − 1`` (or
  ``completion``, last row dropped); prompt rows from ``prompt_routed_experts``.

Write (``export-routing --format vllm``): one completions response per request in the split
layout (``prompt_routed_experts: null``: a capture records no prefill routing), ``routed_experts``
as the server encodes it (base64 ``.npy``, int16).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moe_spec.capture.engines.base import (
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

NAME = "vllm"
VERSION = "vllm-routed-experts"


def array(value, where: str, field_name: str) -> np.ndarray:
    """``routed_experts`` as an integer array: base64 ``.npy`` (the server), or nested lists."""
    if isinstance(value, str):
        raw = b64_bytes(value, where, field_name)
        if not raw.startswith(b"\x93NUMPY"):
            raise SourceError(f"{where}: {field_name} is base64 but not a .npy array (vLLM's "
                              "server encodes np.save output)")
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise SourceError(f"{where}: {field_name} is a damaged .npy array ({exc})") from None
    elif isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError:
            raise SourceError(f"{where}: {field_name} is a ragged nested list, not [tokens, "
                              "layers, top-k]") from None
        if arr.size == 0:
            arr = arr.reshape(0, 0, 0)
    else:
        raise SourceError(f"{where}: {field_name} is {type(value).__name__}: expected base64 "
                          ".npy or nested lists (start vLLM with --enable-return-routed-experts)")
    if arr.size and arr.dtype.kind not in "iu":
        raise SourceError(f"{where}: {field_name} holds {arr.dtype} values, not integer ids")
    if arr.ndim != 3 and arr.size:
        raise SourceError(f"{where}: {field_name} has shape {list(arr.shape)}, expected [tokens, "
                          "layers, top-k]: wrong shape")
    return arr.reshape(arr.shape if arr.ndim == 3 else (0, 0, 0)).astype(np.int64, copy=False)


def _moe(arr: np.ndarray, facts: ModelFacts, where: str) -> np.ndarray:
    if not arr.size:
        return np.zeros((arr.shape[0], len(facts.moe_layers), facts.top_k), np.int64)
    check_dense_fill(arr, facts, where)
    return arr[:, layer_slots(arr.shape[1], facts, where)]


def _completions(record: object, where: str):
    """(prompt length, completion length, routed, prompt_routed or False, id, choice) per
    completion of a record."""
    if not isinstance(record, dict):
        raise SourceError(f"{where}: a record is a {type(record).__name__}, not a JSON object")
    split = record.get("prompt_routed_experts", False) if "prompt_routed_experts" in record \
        else False
    if isinstance(record.get("choices"), list):  # an OpenAI-compatible response
        usage = record.get("usage") if isinstance(record.get("usage"), dict) else {}
        p = whole(usage.get("prompt_tokens"), where, "usage.prompt_tokens")
        choices = record["choices"]
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise SourceError(f"{where}: choice {i} is not an object")
            if isinstance(choice.get("token_ids"), list):
                c = len(choice["token_ids"])
            elif len(choices) == 1:
                c = whole(usage.get("completion_tokens"), where, "usage.completion_tokens")
            else:
                raise SourceError(f"{where}: {len(choices)} choices share one usage count; "
                                  "request return_token_ids so each choice's length is known")
            rid = str(record.get("id", where)) + (f"-{choice.get('index', i)}"
                                                  if len(choices) > 1 else "")
            yield p, c, choice.get("routed_experts"), split, rid, choice, record.get("created")
        return
    if isinstance(record.get("outputs"), list):  # an offline RequestOutput
        prompt = record.get("prompt_token_ids")
        p = len(prompt) if isinstance(prompt, list) else \
            whole(record.get("num_prompt_tokens"), where, "prompt_token_ids")
        outs = record["outputs"]
        for i, out in enumerate(outs):
            if not isinstance(out, dict) or not isinstance(out.get("token_ids"), list):
                raise SourceError(f"{where}: output {i} has no token_ids list")
            rid = str(record.get("request_id", where)) + (f"-{out.get('index', i)}"
                                                          if len(outs) > 1 else "")
            yield (p, len(out["token_ids"]), out.get("routed_experts"), split, rid,
                   {**out, "prompt_token_ids": prompt}, None)
        return
    raise SourceError(f"{where}: neither choices (a server response) nor outputs (an offline "
                      "RequestOutput): not a vLLM record")


def read(source: Path, facts: ModelFacts, options: ReadOptions,
         progress: Callable[[int], None] | None = None) -> Iterator[Piece]:
    for path in source_files(source, "*.jsonl"):
        for number, record, _ in jsonl(path, progress):
            where = f"{path} line {number}"
            for p, c, routed, split, rid, choice, created in _completions(record, where):
                if routed is None:
                    raise SourceError(f"{where}: no routed_experts (start vLLM with "
                                      "--enable-return-routed-experts)")
                arr = _moe(array(routed, where, "routed_experts"), facts, where)
                rows = len(arr)
                if split is not False:  # generated tokens only
                    if rows not in (max(c - 1, 0), c):
                        raise SourceError(f"{where}: routed_experts has {rows} rows for {c} "
                                          f"generated tokens (expected {max(c - 1, 0)}): wrong "
                                          "shape")
                    decode = arr[:max(c - 1, 0)]
                    prompt = np.zeros((0, *arr.shape[1:]), np.int64)
                    if options.tokens == "all" and split is not None:
                        prompt = _moe(array(split, where, "prompt_routed_experts"), facts, where)
                        if len(prompt) != p:
                            raise SourceError(f"{where}: prompt_routed_experts has "
                                              f"{len(prompt)} rows for {p} prompt tokens")
                else:
                    if rows not in (p + c - 1, p + c) or p + c == 0:
                        raise SourceError(f"{where}: routed_experts has {rows} rows for a "
                                          f"sequence of {p} prompt + {c} generated tokens "
                                          f"(expected {p + c - 1}): wrong shape")
                    decode = arr[p:p + c - 1]
                    prompt = arr[:p] if options.tokens == "all" else arr[:0]
                both = np.concatenate([prompt, decode]) if len(prompt) else decode
                token = np.arange(-len(prompt), len(decode), dtype=np.int32)
                ids = checked_ids(both, facts, options, where)
                out = choice.get("token_ids")
                prompt_ids = choice.get("prompt_token_ids")
                yield Piece(rid, ids, token,
                            timestamp=float(created) if isinstance(created, (int, float))
                            else None,
                            prompt_token_ids=[int(x) for x in prompt_ids]
                            if isinstance(prompt_ids, list) else None,
                            output_token_ids=[int(x) for x in out] if isinstance(out, list)
                            else None,
                            finish_reason=None if choice.get("finish_reason") is None
                            else str(choice["finish_reason"]))


def npy_base64(arr: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, arr, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def write(requests, dest: Path, facts: ModelFacts) -> tuple[list[Path], int]:
    """One completions response per request into ``dest`` (a .jsonl file), split layout."""
    count = 0
    with open(dest, "w", encoding="utf-8") as f:
        for req in requests:
            t = req.tokens
            c = len(t) + 1
            out = req.output_token_ids
            choice = dict(index=0, text=None, finish_reason=req.stop_reason,
                          routed_experts=npy_base64(t.ids.astype(np.int16)))
            if out is not None and len(out) >= c:
                choice["token_ids"] = list(out[:c])
            record = dict(id=req.prompt_id, object="text_completion", created=None,
                          model=facts.name, choices=[choice], prompt_routed_experts=None,
                          usage=dict(prompt_tokens=req.prompt_len or 0, completion_tokens=c,
                                     total_tokens=(req.prompt_len or 0) + c))
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            count += 1
    return [dest], count
