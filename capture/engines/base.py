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
import io
import itertools
import json
import math
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
    """What the source cannot say about itself (each names the engine setting it stands for)."""

    tokens: str = "decode"  # decode: generated tokens only; all: prompt rows too (j < 0)
    drop_shared_slot: bool = False  # drop fused shared-expert slots (ids N … N+s−1)
    # vLLM routed_experts_prompt_start / SGLang routed_experts_start_len: request fields no
    # response echoes. An int (every request's), "prompt" (decode rows only: the start at
    # each request's prompt length) or "auto" (each response's start from its row count)
    prompt_start: int | str = 0
    microbatches: int = 1  # Megatron: forward passes (microbatches) per training iteration
    layer_base: int = 0  # Megatron: 0 = hook path (decoder.layers.<i>), 1 = record_indices
    merge_ranks: bool = False  # Megatron: merge the rank files of a folder into one stream


PROMPT_STARTS = ("prompt", "auto")


def parse_prompt_start(text: str) -> int | str:
    """``--prompt-start`` as given: a whole number, ``prompt`` or ``auto``."""
    if text in PROMPT_STARTS:
        return text
    if not re.fullmatch(r"[0-9]{1,9}", text or ""):
        raise ValueError(f"--prompt-start {text!r}: a whole number (0 … 999999999), 'prompt' "
                         "or 'auto'")
    return int(text)


def resolve_start(option: int | str, prompt: int, implied: int | None, where: str,
                  field_name: str) -> int:
    """The first position a response's rows cover: the option's, checked against the start its
    row count implies (``implied``: prompt + completion − 1 − rows; None where the row count is
    not known yet). One line, naming ``--prompt-start``, where they disagree."""
    if option == "auto":
        if implied is None or not 0 <= implied <= prompt:
            raise SourceError(f"{where}: the row count implies a start of {implied} (prompt "
                              f"{prompt} tokens): not a {field_name} between 0 and the prompt "
                              "(wrong shape)")
        return implied
    start = prompt if option == "prompt" else int(option)
    if start > prompt:
        raise SourceError(f"{where}: --prompt-start {start} is past the prompt ({prompt} "
                          "tokens)")
    if implied is not None and implied != start:
        hint = (f"; the rows would fit {field_name} = {implied} (a request field the response "
                f"does not echo): pass --prompt-start {implied if implied else 0}, 'prompt' or"
                " 'auto'" if 0 <= implied <= prompt else "")
        raise SourceError(f"{where}: the rows do not cover positions {start} … (prompt + "
                          f"completion − 1) for --prompt-start {option} (wrong shape){hint}")
    return start


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
    prompt_tokens: int | None = None  # the prompt's length, where the source counts it
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


MAX_COUNT = 2**31 - 1  # token counts, positions, steps: what the int32 columns hold


def whole(value, where: str, field_name: str, low: int = 0, high: int = MAX_COUNT) -> int:
    """A JSON integer within ``low … high`` (never a bool, string or float), or one line."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10**12 else \
            f"{'-' if value < 0 else ''}a {len(str(abs(value)))}-digit number"
        raise SourceError(f"{where}: {field_name} is {shown[:40]}, not a whole number within "
                          f"{low} … {high}")
    return value


def finite(value, where: str, field_name: str) -> float | None:
    """An optional JSON number (a timestamp, a latency) as a finite float; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError(f"{where}: {field_name} is {type(value).__name__}, not a number")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise SourceError(f"{where}: {field_name} is not a finite number")
    return out


def id_array(value, where: str, field_name: str) -> np.ndarray:
    """Nested JSON lists of expert ids as an int64 array: every leaf a JSON integer (never a
    bool, string, float or null: numpy would turn ``true`` into 1), lists of equal length, or
    one line. The leaves' types are checked level by level at C speed (``map(type, …)``)."""
    level, depth = value, 0
    while True:
        if not isinstance(level, list):
            raise SourceError(f"{where}: {field_name} is {type(level).__name__}, not a list of "
                              "ids")
        kinds = set(map(type, level))
        if kinds == {list}:
            if depth == 3:
                raise SourceError(f"{where}: {field_name} nests deeper than [tokens, layers, "
                                  "top-k]: wrong shape")
            level, depth = list(itertools.chain.from_iterable(level)), depth + 1
            continue
        break
    if kinds - {int}:
        bad = sorted(k.__name__ for k in kinds - {int})
        names = {"bool": "true/false", "str": "strings", "float": "non-integer numbers",
                 "NoneType": "null", "list": "lists beside ids (ragged)", "dict": "objects"}
        raise SourceError(f"{where}: {field_name} holds "
                          f"{', '.join(names.get(b, b) for b in bad)}, not integer expert ids")
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise SourceError(f"{where}: {field_name} holds an id out of range (null, "
                          "out-of-range or mixed values), not an expert") from None
    except ValueError:
        raise SourceError(f"{where}: {field_name} is a ragged nested list, not [tokens, "
                          "layers, top-k]: wrong shape") from None


def npy_array(raw: bytes, where: str, field_name: str, rows: int | None = None) -> np.ndarray:
    """A ``.npy`` file's bytes as an integer array viewing them (no copy): its header checked
    first (an integer dtype, a 3-d shape, ``rows`` rows where known, exactly the bytes the shape
    needs), so a header that declares more than the bytes hold allocates nothing."""
    f = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(f)
        reader = {(1, 0): np.lib.format.read_array_header_1_0,
                  (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if reader is None:
            raise ValueError(f"unknown .npy version {version}")
        shape, fortran, dtype = reader(f, max_header_size=4096)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise SourceError(f"{where}: {field_name} is a damaged .npy array "
                          f"({str(exc)[:120]})") from None
    if dtype.kind not in "iu" or dtype.hasobject:
        raise SourceError(f"{where}: {field_name} holds {dtype} values, not integer ids")
    if len(shape) != 3:
        raise SourceError(f"{where}: {field_name} has shape {list(shape)}, expected [tokens, "
                          "layers, top-k]: wrong shape")
    if rows is not None and shape[0] != rows:
        raise SourceError(f"{where}: {field_name} declares {shape[0]} rows, expected {rows}: "
                          "wrong shape")
    need = math.prod(shape) * dtype.itemsize
    have = len(raw) - f.tell()
    if need != have:
        raise SourceError(f"{where}: {field_name}'s header declares shape {list(shape)} "
                          f"({need:,} bytes) but {have:,} bytes follow: a damaged .npy array")
    arr = np.frombuffer(raw, dtype, offset=f.tell()).reshape(shape, order="F" if fortran
                                                                else "C")
    return arr


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
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
            if len(line) > MAX_LINE:
                raise SourceError(f"{path} line {number} is longer than {MAX_LINE >> 20} MiB: "
                                  "not one routing record")
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
            yield number, _parsed(line, path, number, f), taken


def _parsed(line: bytes, path: Path, number: int, f):
    """One line's JSON, or one line naming the line and the fault (``f``: the open file, to
    tell a last line cut short from a damaged one)."""
    try:
        return strict_json(line)
    except RecursionError:
        raise SourceError(f"{path} line {number} nests deeper than a routing record can (JSON "
                          "nesting too deep)") from None
    except NonFinite as exc:
        raise SourceError(f"{path} line {number} holds {exc}: not a finite number") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        cut = not line.endswith(b"\n") and f.peek(1) == b""
        if cut:
            raise SourceError(f"{path} line {number} is cut short (the file ends inside a "
                              "record: an interrupted write?); remove the partial line or "
                              "export again") from None
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise SourceError(f"{path} line {number} is not JSON ({why}); one JSON record per "
                          "line is expected") from None
    except ValueError as exc:  # an integer past the interpreter's digit limit
        raise SourceError(f"{path} line {number} holds a number too long to be a count or an "
                          f"id ({str(exc)[:60]})") from None


MAX_LINE = 1 << 30  # bytes of one JSONL record


class NonFinite(ValueError):
    """``Infinity``, ``NaN`` or a number beyond float range in a JSON record."""


def _constant(name: str):
    raise NonFinite(name)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFinite(text[:40])
    return value


def strict_json(line: bytes):
    """``json.loads`` without ``Infinity``/``NaN`` and with every float finite (``1e400``
    refused); nesting is bounded by the interpreter (RecursionError, caught by the caller)."""
    return json.loads(line, parse_constant=_constant, parse_float=_float)


CUT = "\u0000cut"  # what a cut-out field holds after :func:`jsonl` took its value out
CUT_JSON = json.dumps(CUT).encode()
