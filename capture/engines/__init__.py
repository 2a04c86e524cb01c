"""Serving engines' routing formats: one module per format, one registry.

    FORMATS["sglang"].read(source, facts, options)   -> iterator of Piece (checked ids)
    FORMATS["sglang"].write(requests, dest, facts)   -> (files written, records)

``import-routing`` (:mod:`capture.import_routing`) streams a source through ``read`` into a
routing-only run; ``export-routing`` (:mod:`capture.export_routing`) writes any run's decode
tokens (:mod:`catalog.tokens`) through ``write``, so an importer can be checked against an
engine, and a capture round-trips through every format. Megatron's writer takes batch passes
(its steps), the others whole requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_spec.capture.engines import llamacpp, megatron, sglang, vllm
from moe_spec.capture.engines.base import ModelFacts, Piece, ReadOptions, SourceError  # noqa: F401


@dataclass(frozen=True)
class Format:
    name: str
    engine: str
    flag: str  # what makes the engine produce it
    source: str  # what SOURCE / DEST is
    version: str  # recorded in the run's manifest (source.version)
    recorded_passes: bool  # the source says which tokens one forward pass routed
    read: Callable
    write: Callable
    writes_passes: bool = False  # write() takes batch passes, not requests
    dest_is_folder: bool = False
    options: tuple[str, ...] = ()  # the ReadOptions fields (besides tokens) this format reads


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("vllm", "vLLM", "--enable-return-routed-experts", "a .jsonl of responses (or a folder "
           "of them)", vllm.VERSION, False, vllm.read, vllm.write,
           options=("prompt_start", "drop_shared_slot")),
    Format("sglang", "SGLang", "--enable-return-routed-experts + return_routed_experts per "
           "request", "a .jsonl of responses (or a folder of them)", sglang.VERSION, False,
           sglang.read, sglang.write, options=("prompt_start", "drop_shared_slot")),
    Format("megatron", "Megatron-LM", "--moe-routing-trace-path DIR (RouterTracer)",
           "router_trace_rank<r>.jsonl, or the folder of them", megatron.VERSION, True,
           megatron.read, megatron.write, writes_passes=True, dest_is_folder=True,
           options=("microbatches", "layer_base", "merge_ranks", "drop_shared_slot")),
    Format("llamacpp", "llama.cpp", "the moe-trace example (MOE_TRACE_OUT=trace.csv)",
           "a layer,expert .csv (or a folder: one request per file)", llamacpp.VERSION, True,
           llamacpp.read, llamacpp.write, dest_is_folder=True,
           options=("drop_shared_slot",)),
)}
