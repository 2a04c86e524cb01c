"""vLLM: ``--enable-return-routed-experts`` (``LLM(..., enable_return_routed_experts=True)``
offline). Logical expert ids (before EPLB's physical mapping).

Read as vLLM writes it (vllm-project/vllm: ``vllm/entrypoints/openai/completion/serving.py``
``OpenAIServingCompletion.request_output_to_completion_response``, the chat twin in
``chat_completion/serving.py``; the rows from ``vllm/v1/core/sched/scheduler.py``
``Scheduler.update_from_output``; JSONL, one record per line), either

* an OpenAI-compatible response (``response.model_dump()``): ``id``, ``created``, ``usage``
  and per choice ``routed_experts`` (``numpy2base64``: base64 of ``np.save`` output),
  ``prompt_token_ids`` and ``token_ids`` (with ``return_token_ids``), ``finish_reason``. A
  request with several prompts returns their choices in one response, ``usage.prompt_tokens``
  summed over the prompts: each choice's own ``prompt_token_ids`` give its prompt (so several
  choices need ``return_token_ids``); or
* a dump of an offline ``RequestOutput``: ``request_id``, ``prompt_token_ids``, ``outputs``
  (each ``token_ids``, ``routed_experts``, ``finish_reason``).

``routed_experts`` is ``[rows, num_hidden_layers, top_k]`` (dense layers' slots zero; an axis
of the MoE layers alone is read too), one row per forwarded position from the request's
``routed_experts_prompt_start`` s (a request field, default 0, never echoed: ``--prompt-start``)
to the last generated token, which is never forwarded: ``rows = prompt + completion − 1 − s``;
decode token j is row ``prompt − s + j``.

Write (``export-routing --format vllm``): one completions response per request with the fields
vLLM writes; ``routed_experts`` int32, the decode rows only (a capture records no prefill), i.e.
what a request with ``routed_experts_prompt_start`` = its prompt length would return (upstream
takes at most prompt − 1): import it with ``--prompt-start prompt``.
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
    finite,
    id_array,
    jsonl,
    layer_slots,
    npy_array,
    resolve_start,
    source_files,
    whole,
)

NAME = "vllm"
VERSION = "vllm-routed-experts"


def array(value, where: str, field_name: str) -> np.ndarray:
    """``routed_experts`` as an integer array: base64 ``.npy`` (the server; its header checked
    before anything is allocated), or nested lists of JSON integers."""
    if isinstance(value, str):
        raw = b64_bytes(value, where, field_name)
        if not raw.startswith(b"\x93NUMPY"):
            raise SourceError(f"{where}: {field_name} is base64 but not a .npy array (vLLM's "
                              "server encodes np.save output)")
        return npy_array(raw, where, field_name)
    if isinstance(value, list):
        arr = id_array(value, where, field_name)
        if arr.size == 0:
            return np.zeros((0, 0, 0), np.int64)
        if arr.ndim != 3:
            raise SourceError(f"{where}: {field_name} has shape {list(arr.shape)}, expected "
                              "[tokens, layers, top-k]: wrong shape")
        return arr
    raise SourceError(f"{where}: {field_name} is {type(value).__name__}: expected base64 "
                      ".npy or nested lists (start vLLM with --enable-return-routed-experts)")


def _moe(arr: np.ndarray, facts: ModelFacts, where: str) -> np.ndarray:
    if not arr.size:
        return np.zeros((arr.shape[0], len(facts.moe_layers), facts.top_k), np.int64)
    check_dense_fill(arr, facts, where)
    return arr[:, layer_slots(arr.shape[1], facts, where)]


def _ids(value, where: str, field_name: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise SourceError(f"{where}: {field_name} is {type(value).__name__}, not a list")
    for x in value:
        whole(x, where, field_name)
    return value


def _completions(record: object, where: str):
    """(prompt length, completion length, routed, id, choice, created, prompt ids) per
    completion of a record."""
    if not isinstance(record, dict):
        raise SourceError(f"{where}: a record is a {type(record).__name__}, not a JSON object")
    if "prompt_routed_experts" in record:
        raise SourceError(f"{where}: prompt_routed_experts is no field of upstream vLLM (an "
                          "earlier export-routing wrote it, or a fork); export again, or give "
                          "the rows as vLLM returns them")
    created = finite(record.get("created"), where, "created")
    if isinstance(record.get("choices"), list):  # an OpenAI-compatible response
        usage = record.get("usage") if isinstance(record.get("usage"), dict) else {}
        choices = record["choices"]
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise SourceError(f"{where}: choice {i} is not an object")
            prompt = _ids(choice.get("prompt_token_ids"), where, f"choice {i} prompt_token_ids")
            out = _ids(choice.get("token_ids"), where, f"choice {i} token_ids")
            if len(choices) > 1 and (prompt is None or out is None):
                raise SourceError(f"{where}: {len(choices)} choices share one usage count "
                                  "(usage.prompt_tokens sums a multi-prompt request's prompts);"
                                  " request return_token_ids so each choice carries its own "
                                  "prompt_token_ids and token_ids")
            p = len(prompt) if prompt is not None else \
                whole(usage.get("prompt_tokens"), where, "usage.prompt_tokens")
            c = len(out) if out is not None else \
                whole(usage.get("completion_tokens"), where, "usage.completion_tokens")
            index = whole(choice.get("index", i), where, f"choice {i} index")
            rid = str(record.get("id", where)) + (f"-{index}" if len(choices) > 1 else "")
            yield p, c, choice.get("routed_experts"), rid, choice, created, prompt
        return
    if isinstance(record.get("outputs"), list):  # an offline RequestOutput
        prompt = _ids(record.get("prompt_token_ids"), where, "prompt_token_ids")
        p = len(prompt) if prompt is not None else \
            whole(record.get("num_prompt_tokens"), where, "prompt_token_ids")
        outs = record["outputs"]
        for i, out in enumerate(outs):
            if not isinstance(out, dict) or not isinstance(out.get("token_ids"), list):
                raise SourceError(f"{where}: output {i} has no token_ids list")
            _ids(out["token_ids"], where, f"output {i} token_ids")
            rid = str(record.get("request_id", where)) + (f"-{out.get('index', i)}"
                                                          if len(outs) > 1 else "")
            yield p, len(out["token_ids"]), out.get("routed_experts"), rid, out, None, prompt
        return
    raise SourceError(f"{where}: neither choices (a server response) nor outputs (an offline "
                      "RequestOutput): not a vLLM record")


def read(source: Path, facts: ModelFacts, options: ReadOptions,
         progress: Callable[[int], None] | None = None, skipped: dict | None = None) \
        -> Iterator[Piece]:
    for path in source_files(source, "*.jsonl"):
        for number, record, _ in jsonl(path, progress):
            where = f"{path} line {number}"
            for p, c, routed, rid, choice, created, prompt_ids in _completions(record, where):
                if routed is None:
                    raise SourceError(f"{where}: no routed_experts (start vLLM with "
                                      "--enable-return-routed-experts)")
                arr = array(routed, where, "routed_experts")
                rows = len(arr)
                if p + c == 0 or c == 0:
                    raise SourceError(f"{where}: a completion of {c} tokens after a prompt of "
                                      f"{p}: no forwarded token")
                s = resolve_start(options.prompt_start, p, p + c - 1 - rows, where,
                                  "routed_experts_prompt_start")
                arr = _moe(arr, facts, where)
                token = np.arange(s - p, s - p + rows, dtype=np.int32)  # row r: j = s + r − p
                keep = token >= 0 if options.tokens == "decode" else slice(None)
                ids = checked_ids(arr[keep], facts, options, where)
                out = choice.get("token_ids")
                yield Piece(rid, ids, token[keep], timestamp=created,
                            prompt_token_ids=[int(x) for x in prompt_ids]
                            if prompt_ids is not None else None,
                            prompt_tokens=p,
                            output_token_ids=[int(x) for x in out] if isinstance(out, list)
                            else None,
                            finish_reason=None if choice.get("finish_reason") is None
                            else str(choice["finish_reason"]))


def npy_base64(arr: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, arr, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def write(requests, dest: Path, facts: ModelFacts) -> tuple[list[Path], int]:
    """One completions response per request into ``dest`` (a .jsonl file): fields vLLM's
    ``CompletionResponse`` has, those the run knows (no ``created``, no ``text``);
    ``routed_experts`` ``[decode rows, num_hidden_layers, k]`` int32 (dense layers' slots zero,
    as vLLM's buffer)."""
    count = 0
    with open(dest, "w", encoding="utf-8") as f:
        for req in requests:
            t = req.tokens
            p = req.prompt_len or 0
            c = len(t) + 1
            full = np.zeros((len(t), facts.num_layers, facts.top_k), np.int32)
            full[:, list(facts.moe_layers)] = t.ids
            out = req.output_token_ids
            choice = dict(index=0, finish_reason=req.stop_reason,
                          routed_experts=npy_base64(full))
            if out is not None and len(out) >= c:  # as with return_token_ids
                choice["token_ids"] = list(out[:c])
            record = dict(id=req.prompt_id, object="text_completion", model=facts.name,
                          choices=[choice], usage=dict(prompt_tokens=p, total_tokens=p + c,
                                                       completion_tokens=c))
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            count += 1
    return [dest], count
