"""The trace schema: every table, column and partition of a capture, in one place.

Layout (hive partitioning, readable by DuckDB, pyarrow and polars with no project code)::

    <root>/<table>/model=<model>/bench=<bench>/run=<run>/part-<prompt>-<chunk>.parquet
    <root>/runs/model=<model>/bench=<bench>/run=<run>/_manifest.json  (+ part-0.parquet when complete)
    <root>/replay_open/model=…/bench=…/run=…/config=<unit>/block=<id>/part-<prompt>.parquet
    <root>/replay_open/model=…/bench=…/run=…/config=<unit>/_config.json   (and replay_closed alike)

Partition columns (``model``, ``bench``, ``run``) are not stored in the files; readers get them
from the paths. A prompt's files are written to ``.<name>.tmp`` and renamed; ``sequences`` is
written last, so a prompt is complete exactly when its ``sequences`` part exists. Files whose
names start with ``_`` or ``.`` (the manifest, files being written) are skipped by pyarrow's
dataset discovery and never match ``*.parquet`` globs, so plain readers see only finished parts.
Notation as in DESIGN.md: for tree node t and MoE layer ℓ, ``g_t`` router softmax (N),
``T_k(t)`` natural top-k, ``ḡ`` mixing weights, ``h_t`` MoE input, ``O*_t`` gold MoE output.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 3  # 2: runs carry a role and a run_id; replay results are stored in blocks;
# 3: trees say which batched verification pass they were in (batch_pass, slot, batch_size, …)
READABLE_VERSIONS = (2, 3)  # version 2 traces read as batch size 1 (their batch columns null)
MANIFEST = "_manifest.json"  # per run, beside the runs table's part
RESULT_CONFIG = "_config.json"  # per replay unit (ranking × coverage × calibration)
ROLES = ("evaluation", "calibration")  # what a run is for; nothing pools them by accident

_KEY = [
    pa.field("prompt_index", pa.int32(), nullable=False),  # position in the benchmark
    pa.field("prompt_id", pa.string(), nullable=False),  # the benchmark's own stable id
]
_STEP = [pa.field("step", pa.int32(), nullable=False)]  # verification pass within the prompt

TABLES: dict[str, pa.Schema] = {
    # one row per prompt
    "sequences": pa.schema(_KEY + [
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("output_token_ids", pa.list_(pa.int32())),
        pa.field("steps", pa.int32()),
        pa.field("mean_accepted_length", pa.float64()),  # τ = mean(accepted drafts + 1)
        pa.field("wall_seconds", pa.float64()),
        pa.field("stop_reason", pa.string()),
    ]),
    # one row per verification pass
    "trees": pa.schema(_KEY + _STEP + [
        pa.field("prefix_len", pa.int32()),  # committed tokens before the pass
        pa.field("nodes", pa.int16()),  # M = root + drafts
        pa.field("depth", pa.int16()),  # deepest node
        pa.field("accepted_length", pa.int16()),  # accepted drafts + bonus
        pa.field("draft_seconds", pa.float64()),  # device-synchronised
        pa.field("verify_seconds", pa.float64()),
        pa.field("unique_experts", pa.list_(pa.int16())),  # |∪_t T_k(t)| per MoE layer
        pa.field("experts_loaded", pa.list_(pa.int16())),  # experts run per layer (≤ budget)
        pa.field("budget", pa.int16()),  # null: no budget (plain EAGLE)
        pa.field("ranking", pa.string()),
        pa.field("coverage", pa.string()),
        # the batched verification pass this tree was verified in (capture --batch-size b): the
        # union over a batch is a GROUP BY batch_pass; null batch_pass: b = 1 (one tree a pass)
        pa.field("batch_pass", pa.int32()),  # pass number within the run's batched decoding
        pa.field("slot", pa.int16()),  # the sequence's slot in the batch (0 at b = 1)
        pa.field("batch_size", pa.int16()),  # sequences verified in the pass
        pa.field("batch_tokens", pa.int32()),  # tree tokens verified in the pass (b · M)
        pa.field("batch_unique_experts", pa.list_(pa.int16())),  # |∪ over the batch| per layer
        pa.field("batch_experts_loaded", pa.list_(pa.int16())),  # experts the pass ran per layer
    ]),
    # one row per tree node
    "nodes": pa.schema(_KEY + _STEP + [
        pa.field("node", pa.int16()),  # 0 = root
        pa.field("parent", pa.int16()),  # -1 for the root
        pa.field("depth", pa.int16()),
        pa.field("token_id", pa.int32()),
        pa.field("draft_logprob", pa.float32()),  # cumulative draft log-prob (root 0)
        pa.field("accepted", pa.bool_()),  # on the accepted path (root always)
    ]),
    # one row per (tree, MoE layer, node)
    "routing": pa.schema(_KEY + _STEP + [
        pa.field("layer", pa.int16()),  # decoder layer index
        pa.field("node", pa.int16()),
        pa.field("router_probs", pa.list_(pa.float32())),  # g_t, all N
        pa.field("topk_ids", pa.list_(pa.int16())),  # T_k(t), by decreasing g
        pa.field("topk_weights", pa.list_(pa.float32())),  # ḡ over T_k(t)
        pa.field("applied_ids", pa.list_(pa.int16())),  # under a budget: experts used; else null
        pa.field("applied_weights", pa.list_(pa.float32())),
    ]),
    # one row per (tree, MoE layer, node) the storage policy keeps (capture/storage.py);
    # vectors are stored in the policy's dtype: float32, float16, or bfloat16 as its uint16 bit
    # pattern (lossless; catalog.reader decodes all three to float32)
    "moe_io": pa.schema(_KEY + _STEP + [
        pa.field("layer", pa.int16()),
        pa.field("node", pa.int16()),
        pa.field("hidden", pa.list_(pa.float32())),  # h_t
        pa.field("output", pa.list_(pa.float32())),  # O*_t as the model computed it; null when
        # the policy recomputes it at replay
        pa.field("output_norm", pa.float32()),  # ||O*_t|| (always: replay's check of the model)
        pa.field("expert_outputs", pa.list_(pa.float32())),  # optional: E_i(h_t), i∈T_k(t), k×H
    ]),
}
TRACE_TABLES = tuple(TABLES)  # written per prompt; "sequences" must stay the last one written

# Task quality of a run's outputs (analysis/quality.py, the `evaluate` command), one row per
# prompt, partitioned like the traces: quality/model=…/bench=…/run=…/part-0.parquet
QUALITY = pa.schema(_KEY + [
    pa.field("metric", pa.string()),  # accuracy | pass@1 | rougeL | output_words
    pa.field("score", pa.float64()),  # null where there is nothing to score against
    pa.field("answer", pa.string()),  # what was extracted, or why it failed
    pa.field("output_tokens", pa.int32()),
    pa.field("twin_run", pa.string()),  # the unbudgeted run with the same prompts, if any
    pa.field("exact_match", pa.bool_()),  # output identical to the twin's
    pa.field("first_divergence", pa.int32()),  # first differing output token; -1: identical
    pa.field("twin_score", pa.float64()),
])
COMPLETION_TABLE = "sequences"

_REPLAY_KEY = _KEY + _STEP + [pa.field("ranking", pa.string()), pa.field("coverage", pa.string()),
                              pa.field("budget", pa.int16())]

# Replay results, partitioned like the traces plus config=<hash> (replay/run.py).
REPLAY_TABLES: dict[str, pa.Schema] = {
    # one row per (tree, layer, ranking, coverage, budget)
    "replay_open": pa.schema(_REPLAY_KEY[:3] + [pa.field("layer", pa.int16())] + _REPLAY_KEY[3:] + [
        pa.field("rse", pa.float64()),  # Σ_t ||O*_t − Ô_t||² / Σ_t ||O*_t||²
        pa.field("token_error", pa.float64()),  # mean_t ||O*_t − Ô_t|| / ||O*_t||
        pa.field("mass_excluded", pa.float64()),  # Σ_{i∉S} s_i / Σ_i s_i
        pa.field("experts_loaded", pa.int16()),  # experts with non-zero weight somewhere
        pa.field("unique_experts", pa.int16()),  # |∪_t T_k(t)| without a budget
    ]),
    # one row per (tree, ranking, coverage, budget)
    "replay_closed": pa.schema(_REPLAY_KEY + [
        pa.field("accepted_length", pa.int16()),  # under the budget (drafts + bonus)
        pa.field("captured_accepted_length", pa.int16()),
        pa.field("path_unchanged", pa.bool_()),  # same accepted path and bonus token
        pa.field("top1_agreement", pa.float64()),  # share of nodes whose argmax is unchanged
        pa.field("mean_kl", pa.float64()),  # mean_t KL(p_t ‖ p_t^B) over nodes, nats
        pa.field("experts_loaded", pa.list_(pa.int16())),  # per MoE layer
    ]),
}

RUNS_SCHEMA = pa.schema([
    pa.field("role", pa.string()),  # evaluation | calibration
    pa.field("run_id", pa.string()),  # new for every capture started from scratch
    pa.field("model_location", pa.string()),
    pa.field("draft", pa.string()),
    pa.field("num_experts", pa.int16()),
    pa.field("top_k", pa.int16()),
    pa.field("renormalize", pa.bool_()),
    pa.field("num_layers", pa.int16()),
    pa.field("moe_layers", pa.list_(pa.int16())),
    pa.field("hidden_size", pa.int32()),
    pa.field("dtype", pa.string()),
    pa.field("device", pa.string()),
    pa.field("prompts", pa.int32()),
    pa.field("settings", pa.string()),  # JSON of the capture settings
    pa.field("versions", pa.string()),  # JSON of library versions
    pa.field("schema_version", pa.int16()),
    pa.field("status", pa.string()),
])


def hidden_type(dtype: str) -> pa.DataType:
    """Storage type of hidden-state vectors: float16 and bfloat16 (its bit pattern as uint16)
    halve the size, float32 is exact for float32 models."""
    return {"float16": pa.float16(), "bfloat16": pa.uint16(), "float32": pa.float32()}[dtype]


def storage_schema(table: str, hidden_dtype: str = "float32") -> pa.Schema:
    """The schema a file is written with (vectors of ``moe_io`` in the chosen dtype)."""
    schema = TABLES[table]
    if table != "moe_io":
        return schema
    vec = pa.list_(hidden_type(hidden_dtype))
    for name in ("hidden", "output", "expert_outputs"):
        i = schema.get_field_index(name)
        schema = schema.set(i, schema.field(i).with_type(vec))
    return schema

