"""What every serving-engine format shares: the model's facts the ids are checked against, the
pieces a reader yields, the checks every id goes through, and a streaming JSONL reader.

A reader turns a source into :class:`Piece` s: a run of consecutive tokens of one request (or of
one stream, for formats that record no requests), their top-k ids at every MoE layer of the
model (``[T, L, k]``, the config's MoE layers in order), their decode positions (``token``: 0 =
the first generated token's forward, negative = prompt tokens) and, where the source has them,
the forward pass (``step``), a timestamp and the request's token ids. Every id is checked before
it is yielded (:func:`checked_ids`): one line names the record and the fault, and the import
commits nothing.
"""

from __future__ import annotations

import binascii
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moe_spec.errors import UserError


class SourceError(UserError, ValueError):
    """A source that cannot be imported as routing of this model; the message is one line
    naming the record (file and line) and the fault."""


@dataclass(frozen=True)
class ModelFacts:
    """What the ids are checked against, from the model's ``config.json``."""

    name: str  # as given (alias, hub id or folder)
    location: str
    model_type: str
    num_experts: int  # N routed experts
    top_k: int  # k
    num_layers: int  # decoder layers
    moe_layers: tuple[int, ...]  # decoder layers with a sparse MoE block, in order
    shared_experts: int  # always-on shared experts (DeepSeek-V3: 1), never in the ids
    hidden_size: int | None = None

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in set(self.moe_layers))

    def describe(self) -> str:
        return (f"{self.name}: N={self.num_experts}, k={self.top_k}, {len(self.moe_layers)} MoE "
                f"layers of {self.num_layers}" + (f", {self.shared_experts} shared expert(s)"
                                                  if self.shared_experts else ""))


@dataclass(frozen=True)
class ReadOptions:
    tokens: str = "decode"  # decode: generated tokens only; all: prompt rows too (j < 0)
    drop_shared_slot: bool = False  # drop fused shared-expert slots (ids N … N+s−1)


@dataclass
class Piece:
    """Consecutive tokens of one request (``request``: its id; ``last``: no more tokens of it
    follow). ``ids`` ``[T, L, k]`` int16, checked; ``token`` ``[T]`` int32."""

    request: str
    ids: np.ndarray
    token: np.ndarray
    step: np.ndarray | None = None  # [T] the forward pass, where recorded
    timestamp: float | None = None
    last: bool = True
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    finish_reason: str | None = None
    seconds: float | None = None  # the request's wall time, where recorded
    meta: dict = field(default_factory=dict)


def layer_slots(width: int, facts: ModelFacts, where: str) -> np.ndarray:
    """Which slots of a source's layer axis hold the MoE layers, in order: every slot when the
    axis has one per MoE layer (vLLM's ``num_moe_layers``), the MoE layers' own indices when it
    has one per decoder layer (SGLang's buffer: dense layers' slots hold a fill value)."""
    n_moe, n_all = len(facts.moe_layers), facts.num_layers
    if width == n_moe:
        return np.arange(n_moe)
    if width == n_all:
        return np.asarray(facts.moe_layers, np.int64)
    raise SourceError(f"{where}: {width} layer slots per token, but {facts.describe()} (the "
                      f"layer count disagrees with the config: is --model the model that served "
                      "these requests?)")


def check_dense_fill(arr: np.ndarray, facts: ModelFacts, where: str) -> None:
    """Slots of dense layers (a per-decoder-layer axis) hold one fill value, never routing."""
    if arr.shape[1] != facts.num_layers or not facts.dense_layers or not arr.size:
        return
    dense = arr[:, list(facts.dense_layers)]
    if (dense != dense.reshape(-1)[0]).any():
        raise SourceError(f"{where}: the slots of dense layers {list(facts.dense_layers)} hold "
                          "varying ids, not a fill value: the source's layer axis is not this "
                          f"model's decoder layers ({facts.describe()})")


def checked_ids(arr: np.ndarray, facts: ModelFacts, options: ReadOptions, where: str) \
        -> np.ndarray:
    """``arr`` ``[T, L, w]`` (L: the MoE layers already) as ``[T, L, k]`` int16, or one line:
    a top-k of the wrong width, an id ≥ N (or in the fused shared-expert slot N … N+s−1, unless
    ``drop_shared_slot``), a negative (sentinel) id, an id repeated within one top-k (a slot
    padded with a default index: a real top-k holds k distinct experts)."""
    n, k, s = facts.num_experts, facts.top_k, facts.shared_experts
    if arr.ndim != 3:
        raise SourceError(f"{where}: routing of shape {list(arr.shape)}, expected [tokens, "
                          "layers, top-k]")
    width = arr.shape[2]
    if not arr.size:
        return np.zeros((arr.shape[0], arr.shape[1], k), np.int16)
    lo, hi = int(arr.min()), int(arr.max())
    fused = width > k and s and width == k + s and lo >= 0 and n <= hi < n + s
    if fused and not options.drop_shared_slot:
        raise SourceError(f"{where}: {width} ids per token where the model routes top-{k}, ids "
                          f"{n}…{n + s - 1} holding the extra slot: fused shared experts (SGLang "
                          "--enable-shared-experts-fusion); pass --drop-shared-slot to drop them "
                          "(shared experts are never part of an expert budget)")
    if fused:
        extra = arr >= n
        if not (extra.sum(axis=2) == s).all():
            raise SourceError(f"{where}: some tokens hold not exactly {s} fused shared-expert "
                              f"id(s) ≥ {n}; cannot drop the shared slot")
        arr = arr[~extra].reshape(arr.shape[0], arr.shape[1], k)
        width, hi = k, int(arr.max())
    if width != k:
        raise SourceError(f"{where}: {width} ids per token and layer, but {facts.describe()} "
                          f"routes top-{k}")
    if lo < 0:
        raise SourceError(f"{where}: id {lo} in a top-k: a sentinel or padding value (an unused "
                          "slot), not an expert; the source is not routing of every token")
    if hi >= n:
        bad = np.argwhere(arr >= n)[0]
        raise SourceError(f"{where}: id {hi} ≥ N={n} (token {bad[0]}, layer slot {bad[1]}): not "
                          f"an expert of {facts.name}" + (" (physical ids of redundant experts "
                          "under EPLB? import logical ids)" if hi < 2 * n else ""))
    if k > 1:
        ordered = np.sort(arr, axis=2)
        same = (np.diff(ordered, axis=2) == 0).any(axis=2)
        if same.any():
            t, layer = np.argwhere(same)[0]
            raise SourceError(f"{where}: token {t} repeats an expert in its top-{k} at layer "
                              f"slot {layer} ({arr[t, layer].tolist()}): padding or a default "
                              "index fills unused slots (a real top-k holds k distinct experts)")
    return arr.astype(np.int16, copy=False)


def b64_bytes(text, where: str, field_name: str) -> bytes:
    """Strict base64 (C, no regex pass): a character outside the alphabet or bad padding is one
    line."""
    if not isinstance(text, (str, bytes)):
        raise SourceError(f"{where}: {field_name} is {type(text).__name__}, not a base64 string")
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise SourceError(f"{where}: {field_name} is not valid base64 ({exc})") from None


def whole(value, where: str, field_name: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise SourceError(f"{where}: {field_name} is {value!r}, not a whole number ≥ {low}")
    return value


# --- streaming JSONL ----------------------------------------------------------------------------
def source_files(source: Path, pattern: str) -> list[Path]:
    """``source`` itself, or the files of a folder matching ``pattern`` (sorted)."""
    if source.is_dir():
        found = sorted(p for p in source.glob(pattern) if p.is_file())
        if not found:
            raise SourceError(f"{source} holds no {pattern} file")
        return found
    return [source]


def jsonl(path: Path, progress: Callable[[int], None] | None = None,
          cut_out: bytes | None = None) -> Iterator[tuple[int, object, bytes | None]]:
    """(line number, parsed value, the cut-out string) of every non-blank line, read one line at
    a time; a line that is not JSON is one line naming it (the last one, without a newline: cut
    short). ``cut_out``: a field whose (long, escape-free) string value is taken out of the raw
    line before it is parsed and returned as bytes (SGLang's base64 ids: the JSON parser never
    copies them), the field left holding :data:`CUT`; a line holding the field twice, or the
    value with escapes, is parsed whole."""
    pattern = re.compile(rb'"' + re.escape(cut_out) + rb'"\s*:\s*"') if cut_out else None
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if progress:
                progress(len(line))
            if not line.strip():
                continue
            taken = None
            if pattern is not None:
                m = pattern.search(line)
                if m is not None:
                    end = line.find(b'"', m.end())
                    value = line[m.end():end]
                    if end > 0 and b"\\" not in value and \
                            pattern.search(line, end) is None:
                        taken = value
                        line = line[:m.end() - 1] + CUT_JSON + line[end + 1:]
            try:
                yield number, json.loads(line), taken
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                cut = not line.endswith(b"\n") and f.peek(1) == b""
                if cut:
                    raise SourceError(f"{path} line {number} is cut short (the file ends inside "
                                      "a record: an interrupted write?); remove the partial "
                                      "line or export again") from None
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                raise SourceError(f"{path} line {number} is not JSON ({why}); one JSON record "
                                  "per line is expected") from None


CUT = "\u0000cut"  # what a cut-out field holds after :func:`jsonl` took its value out
CUT_JSON = json.dumps(CUT).encode()
