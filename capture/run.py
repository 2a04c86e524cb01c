"""One capture run: EAGLE decoding over a benchmark, every verification pass to Parquet.

    prompts  = load the benchmark's prompts
    target   = load model + draft head, find its MoE layers
    budget   = (online mode only) ranking fitted on calibration runs, coverage, B
    writer   = create or resume the run (manifest says running)
    for each prompt not yet complete:
        for each verification pass:  (the recorder hooks routing and MoE tensors)
            every chunk_steps passes: write routing / moe_io rows
        write trees, nodes, then sequences (which marks the prompt complete)
    mark the run complete, summarise what is on disk
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from capture.background import BackgroundWriter, WriterFailed
from capture.settings import CaptureError, CaptureSettings
from capture.storage import StorageError
from capture.writer import RunWriter
from catalog import Catalog, CatalogError, InvalidName, check_name, reader, schema
from eagle import loading
from eagle.acceptance import SamplingSettings
from eagle.decoding import EagleDecoder, Generation
from eagle.settings import TreeSettings
from moe import models
from moe.adapter import MoEAdapter
from moe.recorder import LayerRecord, VerifyRecorder
from policy import coverage, rankings
from policy.budget import Budget
from policy.calibration import (
    CalibrationStats,
    collect_runs,
    empty_calibration,
    evaluation_calibration,
    examples_for,
)
from tasks import benchmarks


# --- the tables of one prompt ------------------------------------------------------------------
def _lists(matrix: np.ndarray, dtype: pa.DataType) -> pa.ListArray:
    """Rows of a 2-D array as a list column (zero-copy offsets, one flat values buffer)."""
    rows, width = matrix.shape
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1), type=dtype))


def _np(t: torch.Tensor, dtype=np.float32) -> np.ndarray:
    """A tensor on the host as ``dtype`` (bf16 has no numpy type, so go through float32)."""
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).numpy().astype(dtype, copy=False)


def _vectors(t: torch.Tensor, dtype: str) -> pa.ListArray:
    """``[rows, width]`` tensor as a list column in the storage dtype (bfloat16 as its bits)."""
    x = _np(t.reshape(t.shape[0], -1))
    if dtype == "bfloat16":
        return _lists(reader.bfloat16_bits(x), pa.uint16())
    if dtype == "float16":
        return _lists(x.astype(np.float16), pa.float16())
    return _lists(x, pa.float32())


def layer_tables(prompt_index: int, prompt_id: str, step: int, records: list[LayerRecord],
                 storage: dict) -> tuple[pa.Table, pa.Table | None]:
    """``routing`` rows of one verification pass (all layers × nodes) and ``moe_io`` rows of
    the layers whose tensors were recorded (the storage policy's), or None."""
    m = records[0].probs.shape[0]

    def keys(recs):
        rows = m * len(recs)
        return {"prompt_index": pa.array(np.full(rows, prompt_index, np.int32)),
                "prompt_id": pa.array([prompt_id] * rows),
                "step": pa.array(np.full(rows, step, np.int32)),
                "layer": pa.array(np.repeat(np.array([r.layer for r in recs], np.int16), m)),
                "node": pa.array(np.tile(np.arange(m, dtype=np.int16), len(recs)))}

    cat = lambda recs, f, dtype=np.float32: np.concatenate([_np(f(r), dtype) for r in recs])  # noqa: E731
    budgeted = records[0].applied_ids is not None
    rows = m * len(records)
    routing = pa.Table.from_pydict({
        **keys(records),
        "router_probs": _lists(cat(records, lambda r: r.probs), pa.float32()),
        "topk_ids": _lists(cat(records, lambda r: r.topk_ids, np.int16), pa.int16()),
        "topk_weights": _lists(cat(records, lambda r: r.topk_weights), pa.float32()),
        "applied_ids": _lists(cat(records, lambda r: r.applied_ids, np.int16), pa.int16())
        if budgeted else pa.nulls(rows, pa.list_(pa.int16())),
        "applied_weights": _lists(cat(records, lambda r: r.applied_weights), pa.float32())
        if budgeted else pa.nulls(rows, pa.list_(pa.float32())),
    }, schema=schema.TABLES["routing"])
    kept = [r for r in records if r.hidden is not None]
    if not kept:
        return routing, None
    dtype = storage["dtype"]
    vec = pa.list_(schema.hidden_type(dtype))
    stack = lambda f: torch.cat([f(r) for r in kept])  # noqa: E731
    output = stack(lambda r: r.output)
    io = {**keys(kept),
          "hidden": _vectors(stack(lambda r: r.hidden), dtype),
          "output": _vectors(output, dtype) if storage["output"] == "store"
          else pa.nulls(m * len(kept), vec),
          "output_norm": pa.array(_np(output.float().norm(dim=-1))),
          "expert_outputs": _vectors(stack(lambda r: r.expert_outputs), dtype)
          if kept[0].expert_outputs is not None else pa.nulls(m * len(kept), vec)}
    return routing, pa.Table.from_pydict(io, schema=schema.storage_schema("moe_io", dtype))


def step_tables(prompt_index: int, prompt_id: str, gen: Generation, experts: dict,
                budget: Budget | None, batch: dict | None = None) -> tuple[pa.Table, pa.Table]:
    """``trees`` (one row per pass) and ``nodes`` (one row per tree node) of a prompt;
    ``experts[step]`` = (unique experts, experts loaded) per MoE layer; ``batch[step]`` = the
    batched pass's columns (:class:`BatchColumns`), absent at b = 1. A prompt that stopped
    before any pass (its first token was EOS) has none of either."""
    batch = batch or {}
    if not gen.steps:
        return schema.TABLES["trees"].empty_table(), schema.TABLES["nodes"].empty_table()
    trees = [dict(prompt_index=prompt_index, prompt_id=prompt_id, step=s.step,
                  prefix_len=s.prefix_len, nodes=s.tree.size, depth=int(s.tree.depth.max()),
                  accepted_length=s.accepted_length, draft_seconds=s.draft_seconds,
                  verify_seconds=s.verify_seconds, unique_experts=experts[s.step][0],
                  experts_loaded=experts[s.step][1], budget=budget.size if budget else None,
                  ranking=budget.ranking.name if budget else None,
                  coverage=budget.coverage.name if budget else None,
                  **batch.get(s.step, BatchColumns.single(s.tree.size, experts[s.step])).row())
             for s in gen.steps]
    cat = lambda f: torch.cat([f(s) for s in gen.steps]).cpu().numpy()  # noqa: E731
    sizes = [s.tree.size for s in gen.steps]
    accepted = np.zeros(sum(sizes), dtype=bool)
    offsets = np.cumsum([0, *sizes[:-1]])
    for off, s in zip(offsets, gen.steps):
        accepted[off + np.asarray(s.path)] = True
    rows = sum(sizes)
    nodes = {"prompt_index": np.full(rows, prompt_index, np.int32),
             "prompt_id": [prompt_id] * rows,
             "step": np.repeat([s.step for s in gen.steps], sizes).astype(np.int32),
             "node": np.concatenate([np.arange(n) for n in sizes]).astype(np.int16),
             "parent": cat(lambda s: s.tree.parents).astype(np.int16),
             "depth": cat(lambda s: s.tree.depth).astype(np.int16),
             "token_id": cat(lambda s: s.tree.tokens).astype(np.int32),
             "draft_logprob": cat(lambda s: s.tree.scores.float()).astype(np.float32),
             "accepted": accepted}
    return (pa.Table.from_pylist(trees, schema=schema.TABLES["trees"]),
            pa.Table.from_pydict(nodes, schema=schema.TABLES["nodes"]))


@dataclass
class BatchColumns:
    """The ``trees`` columns of the batched pass a tree was verified in."""

    batch_pass: int | None
    slot: int
    batch_size: int
    batch_tokens: int
    batch_unique_experts: list[int]  # per MoE layer, over every tree of the pass
    batch_experts_loaded: list[int]

    @classmethod
    def single(cls, nodes: int, experts: tuple[list[int], list[int]]) -> BatchColumns:
        """b = 1: the pass is the tree."""
        return cls(None, 0, 1, nodes, *experts)

    def row(self) -> dict:
        return dict(self.__dict__)


def sequence_table(index: int, prompt, ids: list[int], gen: Generation) -> pa.Table:
    return pa.Table.from_pylist([dict(
        prompt_index=index, prompt_id=prompt.prompt_id, prompt_token_ids=ids,
        output_token_ids=gen.output_ids, steps=len(gen.steps),
        mean_accepted_length=gen.mean_accepted_length, wall_seconds=gen.seconds,
        stop_reason=gen.stop_reason)], schema=schema.TABLES["sequences"])


class PromptChunks:
    """Routing and MoE tensors of one prompt, written every ``chunk_steps`` passes (bounded
    memory however long a generation runs); keeps per-pass expert counts for ``trees``. Runs on
    the background writer: device-to-host copies and Parquet encoding happen there."""

    def __init__(self, writer: RunWriter, index: int, prompt_id: str, storage: dict):
        self.writer, self.index, self.prompt_id = writer, index, prompt_id
        self.storage = storage
        self.chunk = 0
        self.experts: dict[int, tuple[list[int], list[int]]] = {}
        self.batch: dict[int, BatchColumns] = {}  # step → its batched pass (b > 1)

    def write(self, passes: list[tuple[int, list[LayerRecord]]]) -> None:
        if not passes:
            return
        routing, io = [], []
        for step, records in passes:
            self.experts[step] = ([r.unique_experts for r in records],
                                  [r.experts_loaded for r in records])
            r_t, io_t = layer_tables(self.index, self.prompt_id, step, records, self.storage)
            routing.append(r_t)
            if io_t is not None:
                io.append(io_t)
        self.writer.write_part("routing", self.index, self.chunk, pa.concat_tables(routing))
        # every chunk has a moe_io part (empty where the policy kept no pass), so a missing one
        # is always damage, never the policy
        io_table = pa.concat_tables(io) if io else \
            schema.storage_schema("moe_io", self.storage["dtype"]).empty_table()
        self.writer.write_part("moe_io", self.index, self.chunk, io_table)
        self.chunk += 1

    def finish(self, prompt, ids: list[int], gen: Generation, budget: Budget | None,
               manifest: dict | None, done: int) -> None:
        """``trees`` and ``nodes``, then ``sequences`` (the prompt is complete), then the
        manifest's progress. A prompt with no pass still gets (empty) ``routing`` and
        ``moe_io`` parts: a complete prompt has a part in every table that is always complete."""
        if self.chunk == 0:
            self.writer.write_part("routing", self.index, 0,
                                   schema.TABLES["routing"].empty_table())
            self.writer.write_part("moe_io", self.index, 0,
                                   schema.storage_schema("moe_io", self.storage["dtype"])
                                   .empty_table())
            self.chunk = 1
        trees, nodes = step_tables(self.index, self.prompt_id, gen, self.experts, budget,
                                   self.batch)
        self.writer.write_part("trees", self.index, 0, trees)
        self.writer.write_part("nodes", self.index, 0, nodes)
        self.writer.write_part("sequences", self.index, 0,
                               sequence_table(self.index, prompt, ids, gen))
        if manifest is not None:  # a Ray worker leaves the manifest to the driver
            self.writer.write_manifest({**manifest, "prompts_done": done})


# --- the steps of a run --------------------------------------------------------------------------
def load_prompts(settings: CaptureSettings, benchmarks_root) -> list:
    prompts = benchmarks.load(settings.bench, root=benchmarks_root, offset=settings.offset,
                              limit=settings.limit)
    if not prompts:
        raise CaptureError(f"no prompts in {settings.bench} at offset {settings.offset}")
    return prompts


def make_budget(settings: CaptureSettings, adapter: MoEAdapter, out: Path, model: str,
                prompts: list) -> Budget | None:
    """MoE-Spec online mode: the ranking (fitted on calibration runs if it needs them), the
    coverage policy and B; None for plain EAGLE."""
    if settings.budget is None:
        return None
    cover = coverage.get(settings.coverage)
    n, k = adapter.num_experts, adapter.top_k
    low = cover.min_budget(k)
    if not low <= settings.budget <= n:
        raise CaptureError(f"--budget {settings.budget} is out of range for {model}: use "
                           f"{low}..{n} ({n} experts, top-{k}, {settings.coverage})")
    ranking = rankings.get(settings.ranking)()
    stats = calibration_stats(settings, adapter, out, model, prompts) \
        if ranking.needs_calibration else None
    return Budget(settings.budget, ranking.fit(stats), cover)


def calibration_stats(settings: CaptureSettings, adapter: MoEAdapter, out: Path, model: str,
                      prompts: list) -> CalibrationStats:
    """Statistics from other captured runs of this model (never this capture's prompts)."""
    if not settings.calibration:
        raise CaptureError(f"--ranking {settings.ranking} needs --calibration RUN (a capture of "
                           f"other prompts under {out})")
    try:
        cal = Catalog(out).calibration_runs(list(settings.calibration), model,
                                            {(settings.bench, p.prompt_id) for p in prompts})
    except CatalogError as exc:
        raise CaptureError(str(exc)) from exc
    stats = collect_runs(cal, lambda run: reader.tree_layers([run]), adapter,
                         examples_for([settings.ranking]))
    problem = empty_calibration(stats, cal)
    if problem:
        raise CaptureError(problem)
    return stats


def run_manifest(settings: CaptureSettings, loaded, head, adapter: MoEAdapter, run: str,
                 role: str, prompts: list) -> dict:
    cfg = loaded.model.config
    return dict(model=loaded.name, model_location=loaded.source.location,
                draft=settings.draft or loading.default_draft(loaded.source),
                bench=settings.bench, run=run, role=role, settings=settings.identity(),
                num_experts=adapter.num_experts, top_k=adapter.top_k,
                renormalize=adapter.renormalize, num_layers=adapter.num_decoder_layers,
                moe_layers=[layer.index for layer in adapter], hidden_size=cfg.hidden_size,
                feature_layers=head.config.feature_layers, dtype=str(loaded.dtype),
                device=str(loaded.device), versions=_versions(),
                schema_version=schema.SCHEMA_VERSION, prompts_total=len(prompts),
                prompt_ids=[p.prompt_id for p in prompts])


def runs_row(manifest: dict) -> dict:
    """The one row of the ``runs`` table, from the manifest."""
    return dict(role=manifest["role"], run_id=manifest["run_id"],
                model_location=manifest["model_location"], draft=manifest["draft"],
                num_experts=manifest["num_experts"], top_k=manifest["top_k"],
                renormalize=manifest["renormalize"], num_layers=manifest["num_layers"],
                moe_layers=manifest["moe_layers"], hidden_size=manifest["hidden_size"],
                dtype=manifest["dtype"], device=manifest["device"],
                prompts=manifest["prompts_total"],
                settings=json.dumps(manifest["settings"], sort_keys=True),
                versions=json.dumps(manifest["versions"], sort_keys=True),
                schema_version=schema.SCHEMA_VERSION, status="complete")


@dataclass
class Target:
    """Everything one process needs to capture prompts: the model and its draft head, the MoE
    layers, the storage policy, the budget (online mode), the recorder and the decoder. A
    single-process capture builds one; every Ray worker builds its own."""

    settings: CaptureSettings
    loaded: object
    head: object
    adapter: MoEAdapter
    storage: dict
    budget: Budget | None
    recorder: VerifyRecorder
    decoder: EagleDecoder

    @classmethod
    def load(cls, settings: CaptureSettings, out: Path, prompts: list,
             record_tensors: bool = True) -> Target:
        loaded, head = loading.load_with_draft(settings.model, settings.draft,
                                               device=settings.device, dtype=settings.dtype)
        adapter = MoEAdapter(loaded.model)
        try:
            storage = settings.storage().resolve(adapter.moe_layers,
                                                 loaded.model.config.hidden_size,
                                                 settings.total_tokens)
        except StorageError as exc:
            raise CaptureError(str(exc)) from None
        budget = make_budget(settings, adapter, out, loaded.name, prompts)
        recorder = VerifyRecorder(adapter, store_expert_outputs=settings.store_expert_outputs,
                                  budget=budget, record_tensors=record_tensors,
                                  tensor_layers=storage["layers"])
        decoder = EagleDecoder(loaded.model, head, verify_context=recorder,
                               tree=TreeSettings(settings.total_tokens, settings.depth,
                                                 settings.tree_top_k),
                               sampling=SamplingSettings(settings.temperature, settings.top_p,
                                                         settings.top_k))
        return cls(settings, loaded, head, adapter, storage, budget, recorder, decoder)

    def manifest(self, run: str, role: str, prompts: list) -> dict:
        return {**run_manifest(self.settings, self.loaded, self.head, self.adapter, run, role,
                               prompts), "storage": self.storage}

    def capture_one(self, index: int, prompt, writer: RunWriter, background: BackgroundWriter,
                    manifest: dict | None, done: set[int]) -> tuple[int, Generation]:
        done.add(index)
        return index, self.capture_prompt(index, prompt, writer, background, manifest, len(done))

    def capture_prompt(self, index: int, prompt, writer: RunWriter,
                       background: BackgroundWriter, manifest: dict | None = None,
                       done: int = 0) -> Generation:
        """Decode one prompt; its tables are written on the background writer, ``sequences``
        last (then the manifest's progress, when ``manifest`` is given)."""
        settings, tokenizer, recorder = self.settings, self.loaded.tokenizer, self.recorder
        ids = prompt_ids(tokenizer, prompt.text, settings.chat_template)
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        chunks = PromptChunks(writer, index, prompt.prompt_id, self.storage)
        policy = settings.storage()
        recorder.new_prompt(keep_pass=lambda step: policy.keeps_pass(index, step))
        session = self.decoder.stream(ids, max_new_tokens=settings.max_new_tokens,
                                      eos_token_ids=eos, seed=settings.seed + index)
        for _ in session:
            if len(recorder.passes) >= settings.chunk_steps:
                background.submit(chunks.write, recorder.take())
        background.submit(chunks.write, recorder.take())
        gen = session.result
        background.submit(chunks.finish, prompt, ids, gen, self.budget, manifest, done)
        return gen


    def capture_batch(self, items: list[tuple[int, object]], writer: RunWriter,
                      background: BackgroundWriter, manifest: dict | None, done: set[int]):
        """Decode ``items`` ((index, prompt) pairs) ``batch_size`` at a time with one batched
        verification pass per step (:class:`eagle.batched.BatchedDecoder`); each prompt's
        tables are written when it stops, exactly as :meth:`capture_prompt` writes them, its
        ``trees`` rows also naming the batched pass. Yields ``(index, Generation)`` as prompts
        finish. A budget caps the union over all the pass's tree tokens."""
        from eagle.batched import BatchedDecoder, BatchPass
        settings, tokenizer, recorder = self.settings, self.loaded.tokenizer, self.recorder
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        policy = settings.storage()
        prompts = dict(items)
        ids = {i: prompt_ids(tokenizer, p.text, settings.chat_template) for i, p in items}
        chunks = {i: PromptChunks(writer, i, p.prompt_id, self.storage) for i, p in items}
        pending: dict[int, list] = {i: [] for i, _ in items}
        recorder.new_prompt(keep_pass=lambda step: True)  # per sequence below

        def finish(index: int, gen: Generation):
            background.submit(chunks[index].write, pending.pop(index))
            done.add(index)
            background.submit(chunks[index].finish, prompts[index], ids[index], gen,
                              self.budget, manifest, len(done))
            return index, gen

        batched = BatchedDecoder(self.decoder, settings.batch_size, verify_context=recorder)
        for event in batched.run([(i, ids[i]) for i, _ in items],
                                 max_new_tokens=settings.max_new_tokens, eos_token_ids=eos,
                                 seed=lambda i: settings.seed + i):
            if not isinstance(event, BatchPass):
                yield finish(*event)
                continue
            for _, records in recorder.take():  # this pass: b · M rows per layer
                m = records[0].probs.shape[0] // len(event.slots)
                union = ([r.unique_experts for r in records], [r.experts_loaded for r in records])
                for row, (index, step) in enumerate(zip(event.keys, event.records)):
                    keep = policy.keeps_pass(index, step.step)
                    part = [r.rows(row * m, (row + 1) * m, keep) for r in records]
                    pending[index].append((step.step, part))
                    chunks[index].batch[step.step] = BatchColumns(
                        event.index, event.slots[row], len(event.slots), event.tokens_verified,
                        *union)
                    if len(pending[index]) >= settings.chunk_steps:
                        background.submit(chunks[index].write, pending[index])
                        pending[index] = []
            for index, gen in event.finished:
                yield finish(index, gen)


def prompt_ids(tokenizer, text: str, chat_template: bool = False) -> list[int]:
    """A prompt's token ids; with ``chat_template`` the tokenizer's template wraps it as one user
    turn followed by the assistant's generation prompt."""
    if not chat_template:
        return tokenizer(text)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise CaptureError("--chat-template: this tokenizer has no chat template (a base model); "
                           "drop the option")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_run(run: str | None, role: str, settings: CaptureSettings) -> str:
    run = settings.default_run_name() if run is None else run
    try:
        check_name(run, "--run")
    except InvalidName as exc:
        raise CaptureError(str(exc)) from None
    if role not in schema.ROLES:
        raise CaptureError(f"--role {role!r} is not a role; use one of {', '.join(schema.ROLES)}")
    return run


def write_errors(out: Path):
    """One line for a failed write (the run keeps its complete prompts). Only an OSError is
    a problem of the disk; anything else the writer raised is named as it is."""
    def wrap(exc: BaseException) -> CaptureError:
        cause = (exc.__cause__ or exc) if isinstance(exc, WriterFailed) else exc
        if isinstance(cause, OSError):
            reason = cause.strerror or cause
            return CaptureError(f"cannot write to {out}: {reason}; the run keeps its complete "
                                "prompts: free space or choose another --out, then rerun to "
                                "resume")
        first = (str(cause).strip().splitlines() or [""])[0]
        return CaptureError(f"writing a prompt's tables under {out} failed: "
                            f"{type(cause).__name__}: {first or '(no message)'} (an error in "
                            "capture, not the disk); the run keeps its complete prompts, "
                            "rerun to resume")
    return wrap


def already_complete(settings: CaptureSettings, out: Path, run: str, role: str, prompts: list,
                     start: float) -> CaptureSummary | None:
    """The summary of a run that is complete with these settings, role and prompts (a rerun
    has nothing to do), read from disk without loading the model; else None."""
    from capture.writer import as_stored
    try:
        model = models.resolve(settings.model).name
    except models.ModelError:
        return None  # said in one line where the model loads
    writer = RunWriter(out, model, settings.bench, run)
    old = writer.read_manifest()
    if old is None or old.get("status") != "complete" or old.get("role") != role \
            or old.get("settings") != as_stored(settings.identity()) \
            or old.get("prompt_ids") != [p.prompt_id for p in prompts] \
            or len(writer.completed()) < len(prompts):
        return None
    return summarise(writer, model, settings.bench, run, len(prompts),
                     time.perf_counter() - start, 0.0)


def check_batching(settings: CaptureSettings, distributed) -> None:
    """What batched decoding does not do yet, refused in one line."""
    if settings.batch_size == 1:
        return
    if distributed:
        raise CaptureError("--batch-size with --workers/--ray-address is not supported yet; "
                           "batch within one process, or scale out with --batch-size 1")
    if settings.budget is not None and rankings.get(settings.ranking).stateful:
        raise CaptureError(f"--ranking {settings.ranking} keeps state per prompt, which a batch "
                           "of prompts does not have; use a stateless ranking with --batch-size")


def check_calibration_roles(settings: CaptureSettings, out: Path) -> None:
    """Refuse ``--calibration`` runs captured as evaluation runs (before the model loads);
    runs not found are reported where the statistics are collected."""
    if not settings.calibration:
        return
    try:
        model = models.resolve(settings.model).name
        found = Catalog(out).runs(model=model, names=list(settings.calibration))
    except (models.ModelError, CatalogError):
        return  # said in one line where the model loads / the statistics are collected
    problem = evaluation_calibration(found)
    if problem:
        raise CaptureError(problem)


def capture_run(settings: CaptureSettings, out: Path, run: str | None = None, *,
                role: str = "evaluation", benchmarks_root=None, progress: bool = True,
                record_tensors: bool = True, workers: int = 0,
                ray_address: str | None = None,
                allow_evaluation_calibration: bool = False) -> CaptureSummary:
    """Capture every prompt of the benchmark into ``out``/…/run=``run`` (resuming). With
    ``workers`` or ``ray_address`` the prompts are spread over Ray actors
    (:mod:`capture.distributed`). ``--calibration`` runs must have the calibration role
    unless ``allow_evaluation_calibration``."""
    start = time.perf_counter()
    run = check_run(run, role, settings)
    if not allow_evaluation_calibration:
        check_calibration_roles(settings, out)
    prompts = load_prompts(settings, benchmarks_root)
    check_batching(settings, workers or ray_address)
    done = already_complete(settings, out, run, role, prompts, start)
    if done is not None:  # nothing to capture: answered without loading the model
        return done
    if workers or ray_address:
        from capture.distributed import capture_distributed
        return capture_distributed(settings, out, run, role, prompts, workers=workers,
                                   ray_address=ray_address, benchmarks_root=benchmarks_root,
                                   progress=progress, start=start)
    target = Target.load(settings, out, prompts, record_tensors)
    prompt_ids(target.loaded.tokenizer, prompts[0].text, settings.chat_template)  # before writing
    load_seconds = time.perf_counter() - start
    writer = RunWriter(out, target.loaded.name, settings.bench, run)
    background = BackgroundWriter()
    try:
        manifest, done = writer.start(target.manifest(run, role, prompts))
        resumed = len(done)
        trees = accepted = 0
        bar = tqdm(list(enumerate(prompts)), desc=f"capture {target.loaded.name}/"
                   f"{settings.bench}", unit="prompt", disable=not progress)
        if settings.batch_size > 1:
            todo = [(settings.offset + i, p) for i, p in enumerate(prompts)
                    if settings.offset + i not in done]
            bar.update(len(prompts) - len(todo))
            finished = target.capture_batch(todo, writer, background, manifest, done)
        else:
            finished = (target.capture_one(settings.offset + i, p, writer, background, manifest,
                                           done) for i, p in bar if settings.offset + i not in done)
        for _, gen in finished:
            if settings.batch_size > 1:
                bar.update(1)
            trees += len(gen.steps)
            accepted += sum(s.accepted_length for s in gen.steps)
            bar.set_postfix(tau=f"{accepted / max(1, trees):.2f}")
        background.drain()
        if manifest.get("status") != "complete":  # a complete run captured again is left as it is
            writer.finish({**manifest, "prompts_done": len(prompts)}, runs_row(manifest))
    except (OSError, WriterFailed) as exc:
        raise write_errors(out)(exc) from exc
    finally:
        background.close()
        writer.close()
    return summarise(writer, target.loaded.name, settings.bench, run, resumed,
                     time.perf_counter() - start, load_seconds)


# --- what the run produced ---------------------------------------------------------------------
def _versions() -> dict:
    import duckdb
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "pyarrow": pa.__version__, "duckdb": duckdb.__version__}


@dataclass
class CaptureSummary:
    root: Path
    model: str
    bench: str
    run: str
    prompts: int
    prompts_resumed: int  # already complete before this invocation
    trees: int
    tau: float
    unique_experts: float  # mean over trees and layers
    experts_loaded: float
    bytes_written: int
    seconds: float  # wall time of this invocation
    load_seconds: float = 0.0  # of which: loading model and draft


def summarise(writer: RunWriter, model: str, bench: str, run: str, resumed: int,
              seconds: float, load_seconds: float) -> CaptureSummary:
    """Figures of the whole run, read back from what is on disk (resumed prompts included)."""
    import pyarrow.parquet as pq
    trees = pq.read_table(writer.table_dir("trees"),
                          columns=["accepted_length", "unique_experts", "experts_loaded"])
    seqs = pq.read_table(writer.table_dir("sequences"), columns=["prompt_index"])
    mean_of = lambda col: float(np.mean([np.mean(v) for v in trees[col].to_pylist()])) \
        if trees.num_rows else 0.0  # noqa: E731
    return CaptureSummary(writer.root, model, bench, run, seqs.num_rows, resumed, trees.num_rows,
                          float(np.mean(trees["accepted_length"].to_numpy())) if trees.num_rows
                          else 0.0, mean_of("unique_experts"), mean_of("experts_loaded"),
                          writer.bytes_written(), seconds, load_seconds)
