"""llama.cpp: the ``moe-trace`` example (``MOE_TRACE_OUT=trace.csv llama-moe-trace -m MODEL.gguf
-p PROMPT``; it reads the ``ffn_moe_topk-<il>`` id tensors in the scheduler's eval callback),
one ``layer,expert`` CSV row per routed activation, for a prompt evaluation and a greedy
continuation of one sequence.

The format is this small and not precisely specified (the example is a proposal, ggml-org/
llama.cpp PR 28544: ``examples/moe-trace``, its eval callback), so the reader accepts the minimal
shape and reconstructs the rest from the row order the callback writes: per ubatch, per MoE
layer in increasing order, the ``[n_tokens, k]`` top-k ids token by token. ``layer`` is
llama.cpp's block index ``il`` (the decoder layer); an optional header line ``layer,expert`` is
skipped. Then every k consecutive rows of a layer are one token, a ubatch ends where the layer
sequence starts again, and every MoE layer routes the same tokens in a ubatch, except the last
decoder layer of a multi-token (prompt) ubatch: the graph gathers the output rows
(``inp_out_ids``) before that layer's MoE block, so it routes only the output token(s).

What is trusted: the callback copies a multi-token ubatch's id tensor from a strided view as if
contiguous, so the prompt ubatches' rows hold plausible ids that are not the top-k: they are
dropped (counted in the summary), with ``--tokens all`` too; a multi-token ubatch after decoding
began is refused. Decode starts at the first one-token ubatch (a prompt whose last ubatch holds
one token is off by that token; a model with one MoE layer cannot tell ubatches apart); each
decode ubatch is a recorded forward pass (``step``). A folder of CSV files is one request per
file (its name the request id, an ``NNNNNN-`` order prefix taken off).

Write (``export-routing --format llamacpp``): ``DEST`` (a folder), one ``<request>.csv`` per
request, header ``layer,expert``, each decode token as a one-token ubatch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from moe_spec.capture.engines.base import (
    ModelFacts,
    Piece,
    ReadOptions,
    SourceError,
    checked_ids,
    source_files,
)

NAME = "llamacpp"
VERSION = "llamacpp-moe-trace-csv"
BLOCK = 1 << 22  # bytes of CSV parsed at a time


def _columns(path: Path) -> tuple[list[str] | None, int]:
    """(column names to give the parser, rows to skip): a header line is skipped."""
    with open(path, "rb") as f:
        first = f.readline().strip().lower().replace(b" ", b"")
    return (["layer", "expert"], 1 if first == b"layer,expert" else 0)


PROMPT_DROPPED = "prompt ubatch rows dropped (moe-trace copies them from a strided view)"


class _Ubatches:
    """Rows → tokens → ubatches, streamed: complete ubatches come out, the rest waits."""

    def __init__(self, path: Path, facts: ModelFacts, options: ReadOptions, skipped: dict):
        self.path, self.facts, self.options, self.skipped = path, facts, options, skipped
        self.layer = np.zeros(0, np.int64)
        self.expert = np.zeros(0, np.int64)
        self.ubatch = 0
        self.decoding = False
        self.next_token = 0

    def feed(self, layer: np.ndarray, expert: np.ndarray, final: bool) -> Iterator[Piece]:
        self.layer = np.concatenate([self.layer, layer])
        self.expert = np.concatenate([self.expert, expert])
        if not len(self.layer):
            return
        k = self.facts.top_k
        cuts = np.flatnonzero(np.r_[True, self.layer[1:] != self.layer[:-1], True])
        run_layer = self.layer[cuts[:-1]]
        run_len = np.diff(cuts)
        # a ubatch starts where the layer does not increase
        new = np.r_[True, run_layer[1:] <= run_layer[:-1]]
        starts = np.flatnonzero(new)
        complete = len(starts) if final else len(starts) - 1  # the last ubatch may continue
        for u in range(complete):
            a = starts[u]
            b = starts[u + 1] if u + 1 < len(starts) else len(run_layer)
            yield from self._ubatch(run_layer[a:b], run_len[a:b], cuts[a], cuts[b], k)
        keep = cuts[starts[complete]] if complete < len(starts) else len(self.layer)
        self.layer, self.expert = self.layer[keep:], self.expert[keep:]

    def _ubatch(self, layers, lengths, lo, hi, k) -> Iterator[Piece]:
        facts = self.facts
        where = f"{self.path} (ubatch {self.ubatch})"
        if list(layers) != list(facts.moe_layers):
            raise SourceError(f"{where}: rows for layers {layers.tolist()}, but "
                              f"{facts.describe()} has MoE layers {list(facts.moe_layers)} (the "
                              "layer count disagrees with the config, or rows are missing)")
        if (lengths % k).any():
            raise SourceError(f"{where}: {lengths.tolist()} rows at its layers: not a whole "
                              f"number of tokens × k={k} at every layer (wrong shape)")
        n = int(lengths[0]) // k
        last_gathers = facts.moe_layers[-1] == facts.num_layers - 1 and len(lengths) > 1
        body = lengths[:-1] if last_gathers and n > 1 else lengths
        if len(set(body.tolist())) != 1 or (body is not lengths and
                                             not 0 < lengths[-1] <= lengths[0]):
            raise SourceError(f"{where}: {lengths.tolist()} rows at its layers: not the same "
                              f"tokens × k={k} at every layer (only the last decoder layer of a "
                              "prompt ubatch routes fewer: its output tokens) (wrong shape)")
        step = self.ubatch
        self.ubatch += 1
        if n > 1:  # a multi-token ubatch: strided copies, never trusted
            if self.decoding:
                raise SourceError(f"{where}: a ubatch of {n} tokens after decoding began: "
                                  "moe-trace copies a multi-token ubatch's ids from a strided "
                                  "view (not the top-k), and the reader follows one sequence")
            self.skipped[PROMPT_DROPPED] = self.skipped.get(PROMPT_DROPPED, 0) + n
            return
        if len(set(lengths.tolist())) != 1:
            raise SourceError(f"{where}: {lengths.tolist()} rows at its layers: a one-token "
                              "ubatch routes its token at every MoE layer (wrong shape)")
        self.decoding = True
        arr = self.expert[lo:hi].reshape(len(layers), n, k).transpose(1, 0, 2)
        ids = checked_ids(arr, facts, self.options, where)
        token = np.arange(self.next_token, self.next_token + n, dtype=np.int32)
        self.next_token += n
        yield Piece(request_id(self.path), ids, token, step=np.full(n, step, np.int64),
                    last=False)


def read(source: Path, facts: ModelFacts, options: ReadOptions,
         progress: Callable[[int], None] | None = None, skipped: dict | None = None) \
        -> Iterator[Piece]:
    skipped = skipped if skipped is not None else {}
    for path in source_files(source, "*.csv"):
        names, skip = _columns(path)
        state = _Ubatches(path, facts, options, skipped)
        convert = pacsv.ConvertOptions(column_types={"layer": pa.int64(), "expert": pa.int64()},
                                       null_values=[], strings_can_be_null=False)
        try:
            stream = pacsv.open_csv(path, read_options=pacsv.ReadOptions(
                column_names=names, skip_rows=skip, block_size=BLOCK),
                parse_options=pacsv.ParseOptions(), convert_options=convert)
            done = 0
            for batch in stream:
                if progress:  # approximate: rows are read a block at a time
                    progress(min(BLOCK, max(path.stat().st_size - done, 0)))
                    done += BLOCK
                yield from state.feed(batch.column(0).to_numpy(zero_copy_only=False),
                                      batch.column(1).to_numpy(zero_copy_only=False), False)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            first = (str(exc).strip().splitlines() or ["?"])[0]
            line = re.search(r"[Rr]ow #?(\d+)", first)
            raise SourceError(f"{path}: not `layer,expert` integer rows ({first[:160]}"
                              f"{'' if line else ''}); a cut-short or damaged line?") from None
        except pa.ArrowException as exc:
            raise SourceError(f"{path}: cannot read it as CSV ({str(exc)[:160]})") from None
        pieces = list(state.feed(np.zeros(0, np.int64), np.zeros(0, np.int64), True))
        if pieces:
            pieces[-1].last = True
        else:
            pieces = [Piece(request_id(path), np.zeros((0, len(facts.moe_layers), facts.top_k),
                                                np.int16), np.zeros(0, np.int32))]
        yield from pieces


def request_id(path: Path) -> str:
    """A file's request id: its name without ``.csv`` and without the ``NNNNNN-`` order prefix
    export-routing gives its files (so an export imports back under the same ids)."""
    return re.sub(r"^[0-9]{6}-", "", path.stem)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:120] or "request"


def write(requests, dest: Path, facts: ModelFacts) -> tuple[list[Path], int]:
    """One CSV per request into the folder ``dest``: each decode token a one-token ubatch."""
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    layers = np.asarray(facts.moe_layers, np.int64)
    for req in requests:
        path = dest / f"{req.index:06d}-{safe_name(req.prompt_id)}.csv"
        ids = req.tokens.ids.astype(np.int64)  # [T, L, k]
        t, L, k = ids.shape
        col_layer = np.repeat(np.tile(layers, t), k)
        col_expert = ids.reshape(-1)
        with open(path, "w", encoding="ascii") as f:
            f.write("layer,expert\n")
            if t:
                np.savetxt(f, np.stack([col_layer, col_expert], axis=1), fmt="%d",
                           delimiter=",")
        files.append(path)
    return files, len(files)
