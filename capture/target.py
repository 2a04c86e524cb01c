"""The target of a capture: the model and its draft head, their MoE layers, the storage policy,
the budget (MoE-Spec online mode), the recorder and the decoder, loaded once per process; and
the decoding of prompts with it, their tables written as they finish (:mod:`capture.encoding`).

    target  = load model + draft head, find its MoE layers, resolve the storage policy
    budget  = (online mode only) ranking fitted on calibration runs, coverage, B
    per prompt:  for each verification pass (the recorder hooks routing and MoE tensors):
                     every chunk_steps passes: write routing / moe_io rows
                 write trees, nodes, then sequences (which marks the prompt complete)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import torch

from moe_spec.capture.background import BackgroundWriter
from moe_spec.capture.encoding import BatchColumns, PromptChunks
from moe_spec.capture.settings import CaptureError, CaptureSettings
from moe_spec.capture.storage import StorageError
from moe_spec.catalog import Catalog, CatalogError, reader, schema
from moe_spec.catalog.writer import RunWriter
from moe_spec.eagle import loading
from moe_spec.eagle.acceptance import SamplingSettings
from moe_spec.eagle.decoding import EagleDecoder, Generation
from moe_spec.eagle.settings import TreeSettings
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.moe.recorder import VerifyRecorder
from moe_spec.policy import coverage, rankings
from moe_spec.policy.budget import AdaptiveBudget, Budget
from moe_spec.policy.calibration import CalibrationStats, calibrate
from moe_spec.policy.index import ADAPTIVE
from moe_spec.policy.prices import PriceRequest, prices_for


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
        loaded, head = load_once(settings)
        adapter = MoEAdapter(loaded.model)
        try:
            storage = settings.storage().resolve(adapter.moe_layers, adapter.facts.hidden_size,
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
        return run_manifest(self.settings, self.loaded, self.head, self.adapter, self.storage,
                            run, role, prompts)

    def capture_prompt(self, index: int, prompt, writer: RunWriter,
                       background: BackgroundWriter,
                       on_complete: Callable[[], None] | None = None) -> Generation:
        """Decode one prompt; its tables are written on the background writer, ``sequences``
        last (then ``on_complete``: the run's progress)."""
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
        background.submit(chunks.finish, prompt, ids, gen, self.budget, on_complete)
        return gen

    def capture_batch(self, items: list[tuple[int, object]], writer: RunWriter,
                      background: BackgroundWriter,
                      on_complete: Callable[[], None] | None = None):
        """Decode ``items`` ((index, prompt) pairs) ``batch_size`` at a time with one batched
        verification pass per step (:class:`eagle.batched.BatchedDecoder`); each prompt's
        tables are written when it stops, exactly as :meth:`capture_prompt` writes them, its
        ``trees`` rows also naming the batched pass. Yields ``(index, Generation)`` as prompts
        finish. A budget caps the union over all the pass's tree tokens."""
        from moe_spec.eagle.batched import BatchedDecoder, BatchPass
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
            background.submit(chunks[index].finish, prompts[index], ids[index], gen,
                              self.budget, on_complete)
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


def make_budget(settings: CaptureSettings, adapter: MoEAdapter, out: Path, model: str,
                prompts: list) -> Budget | None:
    """MoE-Spec online mode: the ranking (fitted on calibration runs if it needs them), the
    coverage policy and B; None for plain EAGLE. ``--budget-mode adaptive``: B is a mean B̄,
    spent by the price rule calibrated on the calibration runs (:class:`AdaptiveBudget`)."""
    if settings.budget is None:
        return None
    cover = coverage.get(settings.coverage)
    n, k = adapter.num_experts, adapter.top_k
    low = cover.min_budget(k)
    if not low <= settings.budget <= n:
        raise CaptureError(f"--budget {settings.budget} is out of range for {model}: use "
                           f"{low}..{n} ({n} experts, top-{k}, {settings.coverage})")
    ranking = rankings.get(settings.ranking)()
    request = price_request(settings)
    stats = calibration_stats(settings, adapter, out, model, prompts, request) \
        if ranking.needs_calibration or request else None
    if request is None:
        return Budget(settings.budget, ranking.fit(stats), cover)
    return AdaptiveBudget(settings.budget, ranking.fit(stats), cover,
                          prices=prices_for(stats, settings.ranking, settings.coverage,
                                            request).for_layers(adapter.moe_layers))


def price_request(settings: CaptureSettings) -> PriceRequest | None:
    """What ``--budget-mode adaptive`` asks of the calibration step: B̄'s price λ."""
    if settings.budget_mode != ADAPTIVE:
        return None
    return PriceRequest(settings.gain_predictor or "mass", (settings.budget,),
                        (settings.coverage,), settings.pass_cap, pace=settings.pace)


def calibration_stats(settings: CaptureSettings, adapter: MoEAdapter, out: Path, model: str,
                      prompts: list, prices: PriceRequest | None = None) -> CalibrationStats:
    """Statistics from other captured runs of this model (never this capture's prompts), with
    adaptive budgets' prices where asked."""
    if not settings.calibration:
        raise CaptureError(f"--ranking {settings.ranking} needs --calibration RUN (a capture of "
                           f"other prompts under {out})")
    try:
        cal = Catalog(out).calibration_runs(list(settings.calibration), model,
                                            {(settings.bench, p.prompt_id) for p in prompts})
    except CatalogError as exc:
        raise CaptureError(str(exc)) from exc
    return calibrate(cal, lambda run: reader.tree_layers([run]), adapter, [settings.ranking],
                     prices=prices)


_LOADED: dict[tuple, tuple] = {}  # the last (model, head) this process loaded, by what loaded it


def load_once(settings: CaptureSettings) -> tuple:
    """The target and draft head, loaded once per process for the same model, draft, device and
    dtype (``capture --bench a,b`` captures both benchmarks with one load); another model
    replaces it."""
    key = (settings.model, settings.draft, settings.device, settings.dtype, settings.revision,
           settings.trust_remote_code)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = loading.load_with_draft(
            settings.model, settings.draft, device=settings.device, dtype=settings.dtype,
            revision=settings.revision, trust_remote_code=settings.trust_remote_code)
    return _LOADED[key]


def run_manifest(settings: CaptureSettings, loaded, head, adapter: MoEAdapter, storage: dict,
                 run: str, role: str, prompts: list) -> dict:
    """Every field of a capture's manifest (``runs/…/_manifest.json``): what was captured, with
    what, and how it is stored; :class:`catalog.writer.RunWriter` adds ``run_id``, ``status``
    and ``prompts_done``. The one place a capture's manifest is built."""
    return dict(model=loaded.name, model_location=loaded.source.location,
                draft=settings.draft or loading.default_draft(loaded.source),
                bench=settings.bench, run=run, role=role, settings=settings.identity(),
                settings_digest=settings.digest(),
                num_experts=adapter.num_experts, top_k=adapter.top_k,
                renormalize=adapter.renormalize, routing_rule=adapter.rule.to_dict(),
                num_layers=adapter.num_decoder_layers,
                moe_layers=[layer.index for layer in adapter], hidden_size=adapter.facts.hidden_size,
                feature_layers=head.config.feature_layers, dtype=str(loaded.dtype),
                device=str(loaded.device), versions=_versions(),
                schema_version=schema.SCHEMA_VERSION, prompts_total=len(prompts),
                prompt_ids=[p.prompt_id for p in prompts], storage=storage)


def _versions() -> dict:
    import duckdb
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "pyarrow": pa.__version__, "duckdb": duckdb.__version__}
