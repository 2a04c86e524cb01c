"""The trace schema: every table, column and partition of a capture, in one place.

Layout (hive partitioning, readable by DuckDB, pyarrow and polars with no project code)::

    <root>/<table>/model=<model>/bench=<bench>/run=<run>/part-<prompt>-<chunk>.parquet
    <root>/runs/model=<model>/bench=<bench>/run=<run>/_manifest.json  (+ part-0.parquet when complete)
    <root>/replay_open/model=…/bench=…/run=…/config=<unit>/block=<id>/part-<prompt>.parquet
    <root>/replay_open/model=…/bench=…/run=…/config=<unit>/_config.json   (and replay_closed alike)
    <root>/profile/model=<model>/device=<device type>/part-0.parquet   (profile-target's timings)
    <root>/batch_profile/model=…/bench=…/run=batch-<hash>/part-<measurement>.parquet
    (profile-batch, one file per measurement, never overwritten; batch_profile_passes alike)

Partition columns (``model``, ``bench``, ``run``) are not stored in the files; readers get them
from the paths. A prompt's files are written to ``.<name>.<random>.tmp`` and renamed;
``sequences`` is written last, so a prompt is complete exactly when its ``sequences`` part
exists. Files whose names start with ``_`` or ``.`` (the manifest, files being written) are
skipped by pyarrow's dataset discovery and never match ``*.parquet`` globs, so plain readers see
only finished parts.
Notation as in DESIGN.md: for tree node t and MoE layer ℓ, ``g_t`` router softmax (N),
``T_k(t)`` natural top-k, ``ḡ`` mixing weights, ``h_t`` MoE input, ``O*_t`` gold MoE output.
"""

from __future__ import annotations

import pyarrow as pa

from moe_spec.catalog import replay_metrics

SCHEMA_VERSION = 5  # 2: runs carry a role and a run_id; replay results are stored in blocks;
# 3: trees say which batched verification pass they were in (batch_pass, slot, batch_size, …);
# 4: the per-node vectors of routing and moe_io hold non-null values (see :func:`vector`);
# 5: a complete run's manifest lists its files (catalog.commit): readers read exactly those
READABLE_VERSIONS = (2, 3, 4, 5)  # version 2 traces read as batch size 1 (their batch columns null)
COMMITTED_VERSION = 5  # from this version on a complete run's manifest must hold its file list
# and commit digest: without them it is refused, never read as found (catalog.runs.legacy)
MANIFEST = "_manifest.json"  # per run, beside the runs table's part
RESULT_CONFIG = "_config.json"  # per replay unit (ranking × coverage × calibration)
ROLES = ("evaluation", "calibration")  # what a run is for; nothing pools them by accident

_KEY = [
    pa.field("prompt_index", pa.int32(), nullable=False),  # position in the benchmark
    pa.field("prompt_id", pa.string(), nullable=False),  # the benchmark's own stable id
]
_STEP = [pa.field("step", pa.int32(), nullable=False)]  # verification pass within the prompt


def vector(value_type: pa.DataType) -> pa.ListType:
    """A per-node vector (``g_t``, ``T_k(t)``, ``h_t``, …): a list whose values are never null.
    Declared so, Parquet stores no definition level per value: the router probabilities of a
    routing part decode ~25% faster (what bounds the routing summaries). Traces written before
    (schema 2–3, nullable values) read the same: readers compare value types, not nullability
    (:func:`same_type`)."""
    return pa.list_(pa.field("element", value_type, nullable=False))


def same_type(got: pa.DataType, want: pa.DataType) -> bool:
    """``got`` is ``want`` up to the nullability of a list's values (schema 3 vs 4)."""
    if pa.types.is_list(got) and pa.types.is_list(want):
        return same_type(got.value_type, want.value_type)
    return got == want


TABLES: dict[str, pa.Schema] = {
    # one row per prompt
    "sequences": pa.schema(_KEY + [
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("output_token_ids", pa.list_(pa.int32())),
        pa.field("steps", pa.int32()),
        pa.field("mean_accepted_length", pa.float64()),  # τ = mean(accepted drafts + 1)
        pa.field("wall_seconds", pa.float64()),
        pa.field("stop_reason", pa.string()),
        # the prompt's length where a source counts its tokens without giving them (an imported
        # SGLang or vLLM response: usage.prompt_tokens); null where prompt_token_ids say it
        pa.field("prompt_tokens", pa.int32()),
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
        pa.field("layer", pa.int16(), nullable=False),  # decoder layer index
        pa.field("node", pa.int16(), nullable=False),
        pa.field("router_probs", vector(pa.float32()), nullable=False),  # g_t, all N
        pa.field("topk_ids", vector(pa.int16()), nullable=False),  # T_k(t), by decreasing g
        pa.field("topk_weights", vector(pa.float32()), nullable=False),  # ḡ over T_k(t)
        pa.field("applied_ids", vector(pa.int16())),  # under a budget: experts used; else null
        pa.field("applied_weights", vector(pa.float32())),
    ]),
    # one row per (tree, MoE layer, node) the storage policy keeps (capture/storage.py);
    # vectors are stored in the policy's dtype: float32, float16, or bfloat16 as its uint16 bit
    # pattern (lossless; catalog.reader decodes all three to float32)
    "moe_io": pa.schema(_KEY + _STEP + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("node", pa.int16(), nullable=False),
        pa.field("hidden", vector(pa.float32()), nullable=False),  # h_t
        pa.field("output", vector(pa.float32())),  # O*_t as the model computed it; null when
        # the policy recomputes it at replay
        pa.field("output_norm", pa.float32()),  # ||O*_t|| (always: replay's check of the model)
        pa.field("expert_outputs", vector(pa.float32())),  # optional: E_i(h_t), i∈T_k(t), k×H
    ]),
}
# How a column is compressed: zstd (smallest), except columns read whole so often that decoding
# speed matters more than bytes. Every routing-summaries build decodes router_probs (N floats
# a node) in full: lz4 decodes it ~12% faster than zstd for ~7% more bytes (tiny-olmoe's traces).
FAST_DECODE_COLUMNS = frozenset({"router_probs"})
TRACE_TABLES = tuple(TABLES)  # written per prompt; "sequences" must stay the last one written

# A run's kind (manifest ``kind``; absent: a capture). A *routing-only* run holds routing
# imported from a serving engine (``import-routing``: vLLM, SGLang, Megatron-LM, llama.cpp): the
# top-k expert ids of every token and MoE layer, and nothing else (no router probabilities,
# trees or hidden states), so only the ids-only analyses read it and replay refuses it.
CAPTURE, ROUTING_ONLY = "capture", "routing-only"
KINDS = (CAPTURE, ROUTING_ONLY)
ROUTING_IDS = "routing_ids"
# one row per (request, token, MoE layer) of a routing-only run, rows in that order (a token's
# MoE layers consecutive, in the manifest's ``moe_layers`` order); parts of bounded size, each
# named by the first request it holds (a long request spans parts: its chunks)
ROUTING_IDS_SCHEMA = pa.schema(_KEY + [  # prompt_index: the request's place in the source
    # (0, 1, …), prompt_id: the engine's request id
    pa.field("token", pa.int32(), nullable=False),  # 0: the first generated token's forward
    # (its position is the prompt's length); −1, −2, …: prompt tokens (import-routing --tokens all)
    pa.field("layer", pa.int16(), nullable=False),  # decoder layer index (the config's layer map)
    pa.field("topk_ids", vector(pa.int16()), nullable=False),  # T_k(t), as the engine ordered it
    pa.field("step", pa.int32()),  # the engine's forward pass that routed the token (Megatron's
    # step, llama.cpp's ubatch), null where the source records none
    pa.field("timestamp", pa.float64()),  # seconds since the epoch where the source has a time
    # (vLLM's and SGLang's OpenAI-compatible responses: `created`, per request), else null
])
ROUTING_ONLY_TABLES = (ROUTING_IDS, "sequences")  # what a routing-only run commits (sequences:
# one row per request; prompt/output token ids where the source has them, the rest null)
ALL_TABLES: dict[str, pa.Schema] = {**TABLES, ROUTING_IDS: ROUTING_IDS_SCHEMA}


def run_tables(kind: str) -> tuple[str, ...]:
    """The trace tables a run of ``kind`` writes and commits."""
    return ROUTING_ONLY_TABLES if kind == ROUTING_ONLY else TRACE_TABLES

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

# Forward-pass timings of a target on one device type (``profile-target``, analysis/moesd.py),
# one row per (b, γ) point, each profile written whole (catalog.writer.write_profile):
# profile/model=…/device=<cpu|cuda|…>/part-0.parquet; a new profile replaces the old one
PROFILE_TABLE = "profile"
PROFILE = pa.schema([
    pa.field("batch", pa.int64()),  # b, sequences per pass
    pa.field("gamma", pa.int64()),  # γ, tokens per sequence after the cached prefix
    pa.field("seconds", pa.float64()),  # T(b, γ), median of the timed repeats
    pa.field("prefix", pa.int32()),  # cached tokens before the pass
    pa.field("num_experts", pa.int32()),  # N of the target
    pa.field("top_k", pa.int32()),  # k of the target
])

# profile-batch's measurements (profiling/profile_batch.py): one row per decoding (mode, b, budget,
# repeat) and one per verification pass. The folder is named by the settings' hash, each
# invocation is one measurement (its id and UTC time in the rows) in its own file, appended and
# never overwritten: batch_profile*/model=…/bench=…/run=batch-<hash>/part-<measurement>.parquet
# (files of round 4 and before: part-0.parquet, without the measurement columns)
_DECODING = [
    pa.field("mode", pa.string()),  # ar | eagle
    pa.field("batch_size", pa.int32()),  # b, sequences decoded together
    pa.field("budget", pa.int32()),  # expert budget over the batch's union; null: none
]
BATCH_PROFILE_TABLES: dict[str, pa.Schema] = {
    "batch_profile": pa.schema(_DECODING + [
        pa.field("tokens", pa.int64()),  # output tokens of every prompt
        pa.field("seconds", pa.float64()),  # wall time of the whole decoding (prefill included)
        pa.field("tokens_per_s", pa.float64()),
        pa.field("passes", pa.int32()),  # verification passes
        pa.field("tau", pa.float64()),  # mean tokens a sequence gains per pass
        pa.field("num_experts", pa.int32()),
        pa.field("top_k", pa.int32()),
        pa.field("device", pa.string()),
        pa.field("threads", pa.int32()),
        pa.field("ranking", pa.string()),  # of the budget; null without budgets
        pa.field("coverage", pa.string()),
        # added in round 4 (files before lack them; readers select by name): the decoding's
        # repeat (0 … --repeats − 1) and p50/p90/p99 of its per-pass latency (draft + verify
        # seconds; its first pass left out as warm-up, analysis.warmup)
        pa.field("repeat", pa.int32()),
        pa.field("latency_p50", pa.float64()),
        pa.field("latency_p90", pa.float64()),
        pa.field("latency_p99", pa.float64()),
        # added in round 5 (issue 59; older files lack them): the measurement (one invocation)
        # the row belongs to, when it started (UTC, ISO 8601), whether it finished every
        # decoding, and the decoding's equal-work figures (analysis.timing): wall seconds per
        # output token and the median pass seconds (draft + verify, warm-up pass left out)
        pa.field("measurement", pa.string()),
        pa.field("measured_at", pa.string()),
        pa.field("complete", pa.bool_()),
        pa.field("seconds_per_token", pa.float64()),
        pa.field("pass_seconds", pa.float64()),
    ]),
    "batch_profile_passes": pa.schema(_DECODING + [
        pa.field("repeat", pa.int32()),  # round 4 (older files lack it): the decoding's repeat
        pa.field("pass_index", pa.int32()),
        pa.field("batch", pa.int32()),  # sequences in this pass (≤ b as the queue drains)
        pa.field("gamma", pa.int32()),  # tokens verified per sequence (1 for ar, M for eagle)
        pa.field("verify_seconds", pa.float64()),  # the target forward, device-synchronised
        pa.field("draft_seconds", pa.float64()),
        pa.field("measurement", pa.string()),  # round 5 (older files lack it)
    ]),
}

# A run's or a decoding's first pass carries allocation and kernel-selection costs: timings
# leave it out (the rule, with its outlier bound, is stated in analysis.warmup; profile-batch's
# percentiles use the same count)
WARMUP_PASSES = 1

_REPLAY_KEY = _KEY + _STEP + [pa.field("ranking", pa.string()), pa.field("coverage", pa.string()),
                              pa.field("budget", pa.int16()),
                              pa.field("budget_mode", pa.string()),  # policy.index.budget_mode
                              pa.field("price", pa.float64())]  # adaptive: B̄'s λ; fixed: null

# Replay results, partitioned like the traces plus config=<hash> (replay/run.py); the metric
# columns are declared in catalog/replay_metrics.py
REPLAY_TABLES: dict[str, pa.Schema] = {
    # one row per (tree, layer, ranking, coverage, budget)
    replay_metrics.OPEN_TABLE: pa.schema(
        _REPLAY_KEY[:3] + [pa.field("layer", pa.int16())] + _REPLAY_KEY[3:]
        + replay_metrics.fields(replay_metrics.OPEN_TABLE)),
    # one row per (tree, ranking, coverage, budget)
    replay_metrics.CLOSED_TABLE: pa.schema(
        _REPLAY_KEY + replay_metrics.fields(replay_metrics.CLOSED_TABLE)),
    # one row per (batch, pass, layer, ranking, coverage, budget): prompt_index numbers the
    # batch, prompt_id joins its prompts' ids with "+", step is the pass (replay/virtual_batch.py)
    replay_metrics.BATCH_TABLE: pa.schema(
        _REPLAY_KEY[:3] + [pa.field("layer", pa.int16()),
                           pa.field("batch_size", pa.int16()),  # b asked (virtual or captured)
                           pa.field("trees", pa.int16())]  # trees verified in the pass (≤ b)
        + _REPLAY_KEY[3:] + replay_metrics.fields(replay_metrics.BATCH_TABLE)),
    # one row per (tree, ranking, coverage, budget) of closed loop over (virtual) batches: the
    # tree's own prompt and step, and the pass that verified it with the other trees of its
    # batch under one shortlist per layer (replay/closed_loop.py)
    replay_metrics.CLOSED_BATCH_TABLE: pa.schema(
        _REPLAY_KEY[:3] + [pa.field("batch_size", pa.int16()),  # b asked (virtual or captured)
                           pa.field("batch", pa.int32()),  # the (virtual) batch: its number
                           pa.field("batch_pass", pa.int32()),  # the pass (virtual: the step)
                           pa.field("trees", pa.int16())]  # trees verified in the pass (≤ b)
        + _REPLAY_KEY[3:] + replay_metrics.fields(replay_metrics.CLOSED_BATCH_TABLE)),
}

RUNS_SCHEMA = pa.schema([
    pa.field("role", pa.string()),  # evaluation | calibration
    pa.field("run_id", pa.string()),  # new for every capture started from scratch
    pa.field("model_location", pa.string()),
    pa.field("draft", pa.string()),
    pa.field("num_experts", pa.int16()),
    pa.field("top_k", pa.int16()),
    pa.field("renormalize", pa.bool_()),  # the rule's renormalize flag (all older runs have)
    pa.field("routing_rule", pa.string()),  # JSON of policy.routing.RoutingRule.to_dict(); null
    # in runs captured before it (RoutingRule.from_manifest reads them from top_k, renormalize)
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
    vec = vector(hidden_type(hidden_dtype))
    for name in ("hidden", "output", "expert_outputs"):
        i = schema.get_field_index(name)
        schema = schema.set(i, schema.field(i).with_type(vec))
    return schema

