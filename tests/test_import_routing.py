"""Routing from serving engines (issue 43): ``import-routing`` and ``export-routing``.

* round trip: a capture of each embedded family → export in each format (vLLM, SGLang, Megatron,
  llama.cpp) → import → the same ids per (request, token, layer) and the same ids-only figures
  (heavy tails and coverage by counts, co-activation, growth, unions per batch, truncation);
* hostile sources (wrong shapes, sentinels, padding, cut-short lines, bad base64, ids ≥ N, a
  layer count that disagrees with the config, fused shared experts): one line, exit 2, nothing
  committed;
* a routing-only run is marked (manifest, ``runs`` view, report) and read by the ids-only
  analyses; replay refuses it in one line.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from moe_spec.analysis import ids
from moe_spec.capture import export_routing, import_routing
from moe_spec.capture.engines import FORMATS
from moe_spec.capture.engines.base import ReadOptions
from moe_spec.catalog import Catalog, schema, tokens
from moe_spec.moe import models

FAMILIES = models.EMBEDDED  # tiny-olmoe, tiny-qwen3-moe, tiny-mixtral, tiny-deepseek-v3, tiny-gpt-oss
B = 2  # virtual batch size of the round trips (3 prompts: a full batch and a partial one)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Each embedded family captured natively once (3 MBPP prompts, 12 new tokens)."""
    from moe_spec.capture.run import CaptureSettings, capture_run
    root = tmp_path_factory.mktemp("engines") / "traces"
    for family in FAMILIES:
        capture_run(CaptureSettings(model=family, limit=3, max_new_tokens=12), root, "cap",
                    progress=False)
    return root


@pytest.fixture(scope="module")
def facts():
    cache = {}

    def get(model: str):
        if model not in cache:
            cache[model] = import_routing.read_facts(model)
        return cache[model]
    return get


def the_run(root, name: str, model: str | None = None):
    found = Catalog(root).runs(names=[name], model=model, kinds=None)
    assert len(found) == 1, found
    return found[0]


def same_figures(a: ids.IdsFigures, b: ids.IdsFigures, keys: bool = True) -> None:
    """Every ids-only figure equal, exactly (integers and the floats derived from them)."""
    assert a.layers == b.layers and (a.num_experts, a.top_k) == (b.num_experts, b.top_k)
    for layer in a.layers:
        x, y = a.sums[layer], b.sums[layer]
        assert (x.passes, x.tokens) == (y.passes, y.tokens), layer
        for name in ("selections", "pairs", "adjacent", "held", "coverage_sum", "growth_sum",
                     "growth_count", "coact_all"):
            assert np.array_equal(getattr(x, name), getattr(y, name)), (layer, name)
    for column in ids.ROW_COLUMNS:
        if keys or column not in ("prompt_index", "step"):
            assert np.array_equal(a.rows[column], b.rows[column]), column
    for frame in (ids.truncation, ids.unions, ids.growth):
        assert frame(a).equals(frame(b)), frame.__name__


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("family", FAMILIES)
def test_capture_export_import_gives_the_same_ids_and_figures(captured, facts, tmp_path, family,
                                                              fmt):
    native = the_run(captured, "cap", family)
    dest = tmp_path / ("out" if FORMATS[fmt].dest_is_folder else "out.jsonl")
    exported = export_routing.export_routing(native, fmt, dest, batch_size=B)
    assert exported.tokens > 0
    name = f"imp-{fmt}"
    batching = "virtual" if fmt == "llamacpp" else "auto"  # llama.cpp: one sequence a file
    summary = import_routing.import_routing(
        FORMATS[fmt], dest, facts(family), captured, "mbpp", name, batching=batching,
        batch_size=B, progress=False, options=EXPORTED[fmt])
    run = the_run(captured, name, family)
    assert run.routing_only and run.source_format == fmt
    assert summary.tokens == exported.tokens and summary.token_layers == \
        exported.tokens * len(native.manifest["moe_layers"])
    if fmt != "megatron":  # requests and their tokens, one by one
        a, b = list(tokens.requests(native)), list(tokens.requests(run))
        assert len(a) == len(b) == 3
        for x, y in zip(a, b):
            assert np.array_equal(x.tokens.ids, y.tokens.ids)
            assert np.array_equal(x.tokens.token, y.tokens.token)
        same_figures(ids.figures(native, batch_size=B), ids.figures(run))
    else:  # no request ids: its steps are the virtual batches' passes, tokens in order
        same_figures(ids.figures(native, batch_size=B), ids.figures(run), keys=False)
        x = np.concatenate([t.ids for t in tokens.chunks(run)])
        passes = list(tokens.passes(native, batch_size=B))
        assert np.array_equal(x, np.concatenate([p.ids for p in passes]))
    if fmt == "llamacpp":  # its own ubatches: one token a pass, = virtual batches of one
        same_figures(ids.figures(native, batch_size=1), ids.figures(run, batching="recorded"),
                     keys=False)


# --- hostile sources ------------------------------------------------------------------------------
N, K, L = 64, 8, 8  # tiny-olmoe
# export-routing writes decode rows only (a capture records no prefill): the responses of requests
# whose prompt start (vLLM) / start length (SGLang) was the prompt's length
EXPORTED = {f: ReadOptions(prompt_start="prompt") if f in ("vllm", "sglang") else ReadOptions()
            for f in FORMATS}


def good_ids(tokens_: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(N)[:K] for _ in range(tokens_ * L)]
    return np.stack(rows).reshape(tokens_, L, K) if rows else np.zeros((0, L, K), np.int64)


def sglang_record(ids_: np.ndarray, prompt: int = 5, rid: str = "r0", start: int = 0,
                  completion: int | None = None, encoded: str | None = None,
                  dtype: str | None = None) -> dict:
    """What SGLang's /generate returns (``tokenizer_manager`` meta_info; the capturer's base64 of
    the ids' bytes) for a request of ``prompt`` tokens whose decode rows are ``ids_``: the rows
    cover positions [start, prompt + completion − 1), ``start`` the request's
    routed_experts_start_len (never echoed); prompt rows repeat the first decode row."""
    completion = len(ids_) + 1 if completion is None else completion
    ids_ = np.asarray(ids_)
    lead = np.repeat(ids_[:1], prompt, axis=0) if len(ids_) else \
        np.zeros((prompt, *ids_.shape[1:]), np.int64)
    rows = np.concatenate([lead, ids_])[start:]
    meta = {"id": rid, "finish_reason": {"type": "length", "length": completion},
            "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": 0,
            "e2e_latency": 0.5,
            "routed_experts": encoded if encoded is not None else
            base64.b64encode(rows.astype(np.dtype(dtype or "int32").newbyteorder("<"))
                             .tobytes()).decode()}
    if dtype:
        meta["routed_experts_dtype"] = dtype
    return {"text": "", "meta_info": meta}


def write_lines(path: Path, records: list, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def refused(capsys, tmp_path, fmt: str, source: Path, *words, model="tiny-olmoe", extra=()):
    out = tmp_path / "traces"
    code = import_routing.main([str(source), "--format", fmt, "--model", model, "--bench",
                                "b", "--run", "hostile", "--out", str(out), "--no-progress",
                                *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("import-routing: error: "), err
    for word in words:
        assert word in err, err
    assert not list(out.glob("*/model=*/bench=b/run=hostile")), "something was left behind"
    assert not Catalog(out).all_runs()
    return err


def test_good_sources_of_every_kind_import(tmp_path, facts):
    src = write_lines(tmp_path / "s.jsonl", [sglang_record(good_ids(4)),
                                             sglang_record(good_ids(0), rid="empty")])
    s = import_routing.import_routing(FORMATS["sglang"], src, facts("tiny-olmoe"), tmp_path / "t",
                                      "b", "r", progress=False)
    assert (s.requests, s.tokens) == (2, 4)
    run = the_run(tmp_path / "t", "r")
    got = list(tokens.requests(run))
    assert [r.prompt_id for r in got] == ["r0", "empty"]
    assert np.array_equal(got[0].tokens.ids, good_ids(4)) and len(got[1].tokens) == 0


@pytest.mark.parametrize("case", [
    "wrong shape", "sentinel", "padding", "cut short", "not json", "bad base64", "id >= N",
    "layers", "unknown start", "no routed_experts", "empty"])
def test_a_hostile_sglang_source_is_one_line_and_commits_nothing(case, tmp_path, capsys):
    ids_ = good_ids(3)
    path = tmp_path / "s.jsonl"
    good = sglang_record(ids_)
    if case == "wrong shape":
        bad = sglang_record(ids_[:, :, :5].copy(), completion=4)
        write_lines(path, [good, bad])
        refused(capsys, tmp_path, "sglang", path, "line 2", "wrong shape")
    elif case == "sentinel":
        ids_[1, 2, 3] = -1
        write_lines(path, [sglang_record(ids_)])
        refused(capsys, tmp_path, "sglang", path, "sentinel")
    elif case == "padding":  # SGLang fills unused slots with a default index
        ids_[2, 4] = 0
        write_lines(path, [sglang_record(ids_)])
        refused(capsys, tmp_path, "sglang", path, "repeats an expert", "default index")
    elif case == "cut short":
        line = json.dumps(good)
        write_lines(path, [good], tail=line[:len(line) // 2])
        refused(capsys, tmp_path, "sglang", path, "line 2", "cut short")
    elif case == "not json":
        write_lines(path, [good], tail="{oops}\n" + json.dumps(good) + "\n")
        refused(capsys, tmp_path, "sglang", path, "line 2", "not JSON")
    elif case == "bad base64":
        write_lines(path, [sglang_record(ids_, encoded="AAAA!!!!")])
        refused(capsys, tmp_path, "sglang", path, "not valid base64")
    elif case == "id >= N":
        ids_[0, 0, 0] = N + 7
        write_lines(path, [sglang_record(ids_)])
        refused(capsys, tmp_path, "sglang", path, f"≥ N={N}")
    elif case == "layers":  # a model with 6 MoE layers served this
        write_lines(path, [sglang_record(ids_[:, :6].copy())])
        refused(capsys, tmp_path, "sglang", path, "layer count disagrees")
    elif case == "unknown start":  # SGLang never echoes routed_experts_start_len
        write_lines(path, [sglang_record(ids_, start=3)])
        refused(capsys, tmp_path, "sglang", path, "routed_experts_start_len", "--prompt-start 3")
    elif case == "no routed_experts":
        del good["meta_info"]["routed_experts"]
        write_lines(path, [good])
        refused(capsys, tmp_path, "sglang", path, "--enable-return-routed-experts")
    else:
        path.write_text("\n\n")
        refused(capsys, tmp_path, "sglang", path, "no routing record")


def test_dense_layer_slots_are_dropped_and_fused_shared_experts_named(tmp_path, capsys, facts):
    """tiny-deepseek-v3: layer 0 dense (SGLang's buffer holds a slot per decoder layer, filled),
    one shared expert (fused: an extra slot holding id N)."""
    f = facts("tiny-deepseek-v3")
    n, k = f.num_experts, f.top_k
    rng = np.random.default_rng(1)
    moe = np.stack([rng.permutation(n)[:k] for _ in range(4 * 7)]).reshape(4, 7, k)
    full = np.zeros((4, 8, k), np.int64)
    full[:, 1:] = moe
    path = write_lines(tmp_path / "d.jsonl", [sglang_record(full)])
    s = import_routing.import_routing(FORMATS["sglang"], path, f, tmp_path / "t", "b", "dense",
                                      progress=False)
    assert s.tokens == 4
    got = next(tokens.requests(the_run(tmp_path / "t", "dense")))
    assert np.array_equal(got.tokens.ids, moe)
    fused = np.concatenate([full, np.full((4, 8, 1), n)], axis=2)
    fused[:, 0] = 0
    path = write_lines(tmp_path / "f.jsonl", [sglang_record(fused)])
    refused(capsys, tmp_path, "sglang", path, "fused shared experts", "--drop-shared-slot",
            model="tiny-deepseek-v3")
    s = import_routing.import_routing(FORMATS["sglang"], path, f, tmp_path / "t", "b", "fused",
                                      options=ReadOptions(drop_shared_slot=True), progress=False)
    got = next(tokens.requests(the_run(tmp_path / "t", "fused")))
    assert np.array_equal(got.tokens.ids, moe)
    varied = full.copy()
    varied[:, 0] = moe[:, 0]  # a "dense" slot holding routing: not this model's layer axis
    path = write_lines(tmp_path / "v.jsonl", [sglang_record(varied)])
    refused(capsys, tmp_path, "sglang", path, "dense layers", model="tiny-deepseek-v3")


def sglang_openai(ids_: np.ndarray, prompt: int = 5, n: int = 1, output_ids: bool = False,
                  chat: bool = True) -> dict:
    """What SGLang's OpenAI-compatible endpoints return since PR 17648
    (``serving_chat._build_chat_response`` / ``serving_completions._build_completion_response``):
    ``sglext.routed_experts`` at the response level, built from the first result only; ``usage``
    counts the prompt once and every choice's completion."""
    first = sglang_record(ids_, prompt=prompt)["meta_info"]
    lengths = [len(ids_) + 1] + [3] * (n - 1)
    choices = [{"index": i, "finish_reason": "length",
                **({"message": {"role": "assistant", "content": ""}} if chat else {"text": ""})}
               for i in range(n)]
    ext = {"routed_experts": first["routed_experts"]}
    if output_ids:  # return_output_ids_in_sglext
        ext["output_ids"] = [list(range(c)) for c in lengths]
    return {"id": "chatcmpl-1", "object": "chat.completion" if chat else "text_completion",
            "created": 1700000000, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": sum(lengths),
                      "total_tokens": prompt + sum(lengths)}, "sglext": ext}


def test_sglang_openai_endpoints_read_the_response_level_sglext(tmp_path, facts, capsys):
    """Path 3: /v1/chat/completions and /v1/completions with sglext at the response level; with
    n = 2 only choice 0's routing is returned (its length from sglext.output_ids): read, the
    other choice counted as skipped; without output_ids refused naming it."""
    f = facts("tiny-olmoe")
    ids_ = good_ids(4, 7)
    path = write_lines(tmp_path / "o.jsonl", [sglang_openai(ids_), sglang_openai(ids_,
                                                                                chat=False)])
    s = import_routing.import_routing(FORMATS["sglang"], path, f, tmp_path / "t", "b", "oai",
                                      progress=False)
    assert (s.requests, s.tokens) == (2, 8)
    for r in tokens.requests(the_run(tmp_path / "t", "oai")):
        assert np.array_equal(r.tokens.ids, ids_) and r.prompt_len == 5
    path = write_lines(tmp_path / "n.jsonl", [sglang_openai(ids_, n=2, output_ids=True)])
    s = import_routing.import_routing(FORMATS["sglang"], path, f, tmp_path / "t", "b", "n2",
                                      progress=False)
    assert s.tokens == 4 and list(s.skipped.values()) == [1]
    assert "choice 0's only" in next(iter(s.skipped))
    path = write_lines(tmp_path / "m.jsonl", [sglang_openai(ids_, n=2)])
    refused(capsys, tmp_path, "sglang", path, "sglext.output_ids", "choice 0")


def test_sglang_start_len_is_a_request_option_never_read_from_meta_info(tmp_path, facts,
                                                                        capsys):
    """Path 4: routed_experts_start_len = 3 (a request field): refused naming --prompt-start,
    read with it or auto; a routed_experts_start_len in meta_info (SGLang writes none) is never
    read; the SGLang export writes none."""
    f = facts("tiny-olmoe")
    ids_ = good_ids(4, 8)
    record = sglang_record(ids_, start=3)
    record["meta_info"]["routed_experts_start_len"] = 3  # ignored: not what SGLang writes
    path = write_lines(tmp_path / "s.jsonl", [record])
    refused(capsys, tmp_path, "sglang", path, "--prompt-start 3")
    for option in ("3", "auto"):
        import_routing.import_routing(
            FORMATS["sglang"], path, f, tmp_path / "t", "b", f"s{option}", progress=False,
            options=ReadOptions(prompt_start=int(option) if option.isdigit() else option))
        got = next(tokens.requests(the_run(tmp_path / "t", f"s{option}")))
        assert np.array_equal(got.tokens.ids, ids_)
    dest = tmp_path / "e.jsonl"
    export_routing.export_routing(the_run(tmp_path / "t", "s3"), "sglang", dest)
    meta = json.loads(dest.read_text())["meta_info"]
    assert set(meta) <= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                         "routed_experts", "cached_tokens", "e2e_latency"}
    assert meta["prompt_tokens"] == 5  # the prompt length kept


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_sglang_ids_in_the_dtype_meta_info_names(dtype, tmp_path, facts, capsys):
    """Path 5: meta_info.routed_experts_dtype (an open SGLang PR: uint8/uint16 ids)."""
    ids_ = good_ids(3, 9)
    path = write_lines(tmp_path / "d.jsonl", [sglang_record(ids_, dtype=dtype)])
    import_routing.import_routing(FORMATS["sglang"], path, facts("tiny-olmoe"), tmp_path / "t",
                                  "b", "d", progress=False)
    assert np.array_equal(next(tokens.requests(the_run(tmp_path / "t", "d"))).tokens.ids, ids_)
    bad = sglang_record(ids_, dtype=dtype)
    bad["meta_info"]["routed_experts_dtype"] = "float16"
    refused(capsys, tmp_path, "sglang", write_lines(tmp_path / "b.jsonl", [bad]), "float16")


def numpy2base64(arr: np.ndarray) -> str:
    """vLLM's ``vllm.utils.serial_utils.numpy2base64``: base64 of ``np.save`` output."""
    import io
    buffer = io.BytesIO()
    np.save(buffer, arr)
    return base64.b64encode(buffer.getvalue()).decode()


def vllm_record(ids_: np.ndarray, prompt: int = 3, nested: bool = False,
                completion: int | None = None, dtype=np.int32) -> dict:
    """What vLLM's ``request_output_to_completion_response`` writes for one prompt and n = 1
    (``ids_``: the rows from the request's prompt start on)."""
    completion = len(ids_) - prompt + 1 if completion is None else completion
    routed = ids_.tolist() if nested else numpy2base64(ids_.astype(dtype))
    return {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop",
                         "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": None,
                         "token_ids": None, "routed_experts": routed}],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                      "completion_tokens": completion, "prompt_tokens_details": None},
            "system_fingerprint": None, "kv_transfer_params": None}


def test_vllm_layouts_and_prompt_rows(tmp_path, facts, capsys):
    """The whole sequence (rows = prompt + completion − 1) keeps decode rows, prompt rows with
    --tokens all (token < 0); nested lists; a wrong row count; the non-upstream split layout
    (prompt_routed_experts) refused."""
    full = good_ids(7)  # 3 prompt rows + 4 decode rows
    path = write_lines(tmp_path / "v.jsonl", [vllm_record(full, nested=True)])
    f = facts("tiny-olmoe")
    s = import_routing.import_routing(FORMATS["vllm"], path, f, tmp_path / "t", "b", "dec",
                                      progress=False)
    assert (s.tokens, s.prompt_rows) == (4, 0)
    got = next(tokens.requests(the_run(tmp_path / "t", "dec")))
    assert np.array_equal(got.tokens.ids, full[3:]) and got.tokens.token.tolist() == [0, 1, 2, 3]
    assert got.prompt_len == 3  # usage.prompt_tokens kept without the prompt's ids
    s = import_routing.import_routing(FORMATS["vllm"], path, f, tmp_path / "t", "b", "all",
                                      options=ReadOptions(tokens="all"), progress=False)
    assert (s.tokens, s.prompt_rows) == (4, 3)
    run = the_run(tmp_path / "t", "all")
    every = next(tokens.requests(run, prompt_tokens=True)).tokens
    assert every.token.tolist() == [-3, -2, -1, 0, 1, 2, 3]
    assert ids.figures(run).tokens == 4  # the analyses read decode tokens only
    for dtype in (np.uint8, np.uint16):
        one = write_lines(tmp_path / f"{dtype.__name__}.jsonl", [vllm_record(full, dtype=dtype)])
        import_routing.import_routing(FORMATS["vllm"], one, f, tmp_path / "t", "b",
                                      dtype.__name__, progress=False)
        got = next(tokens.requests(the_run(tmp_path / "t", dtype.__name__)))
        assert np.array_equal(got.tokens.ids, full[3:])
    bad = write_lines(tmp_path / "w.jsonl", [vllm_record(full, completion=9)])
    refused(capsys, tmp_path, "vllm", bad, "wrong shape")
    ragged = vllm_record(full, nested=True)
    ragged["choices"][0]["routed_experts"][2][1] = [1, 2]
    refused(capsys, tmp_path, "vllm", write_lines(tmp_path / "r.jsonl", [ragged]), "ragged")
    split = {**vllm_record(full[3:], prompt=0), "prompt_routed_experts": None}
    refused(capsys, tmp_path, "vllm", write_lines(tmp_path / "s.jsonl", [split]),
            "prompt_routed_experts is no field of upstream vLLM")


def test_vllm_several_prompts_take_each_choices_own_prompt(tmp_path, facts, capsys):
    """Path 1: /v1/completions with two prompts (3 and 5 tokens, return_token_ids): one choice per
    prompt, usage.prompt_tokens the sum (8); each choice's prompt_token_ids give its rows."""
    f = facts("tiny-olmoe")
    prompts, outs = [[11, 12, 13], [21, 22, 23, 24, 25]], [[1, 2, 3, 4], [5, 6]]
    rows = [good_ids(len(p) + len(o) - 1, seed) for seed, (p, o) in enumerate(zip(prompts, outs))]
    choices = [{"index": i, "text": "", "logprobs": None, "finish_reason": "length",
                "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": p,
                "token_ids": o, "routed_experts": numpy2base64(r.astype(np.int32))}
               for i, (p, o, r) in enumerate(zip(prompts, outs, rows))]
    record = {"id": "cmpl-x", "object": "text_completion", "created": 1700000000, "model": "m",
              "choices": choices, "usage": {"prompt_tokens": 8, "completion_tokens": 6,
                                            "total_tokens": 14}}
    path = write_lines(tmp_path / "m.jsonl", [record])
    s = import_routing.import_routing(FORMATS["vllm"], path, f, tmp_path / "t", "b", "multi",
                                      progress=False)
    assert (s.requests, s.tokens) == (2, 3 + 1)
    got = list(tokens.requests(the_run(tmp_path / "t", "multi")))
    assert [r.prompt_id for r in got] == ["cmpl-x-0", "cmpl-x-1"]
    assert [r.prompt_len for r in got] == [3, 5]
    for r, full, p in zip(got, rows, prompts):
        assert np.array_equal(r.tokens.ids, full[len(p):])
    for c in choices:  # without return_token_ids: the summed usage cannot be split
        c["prompt_token_ids"] = c["token_ids"] = None
    refused(capsys, tmp_path, "vllm", write_lines(tmp_path / "n.jsonl", [record]),
            "return_token_ids")


def test_vllm_prompt_start_and_dense_layer_slots(tmp_path, facts, capsys):
    """Path 2: a request with routed_experts_prompt_start = 2 on tiny-deepseek-v3 (layer 0 dense):
    the rows start at position 2, the layer axis is num_hidden_layers with zeros in the dense
    layer's slot (vLLM's buffer). The response cannot tell the start: refused naming
    --prompt-start; read with it, or with auto."""
    f = facts("tiny-deepseek-v3")
    n, k, p, c, start = f.num_experts, f.top_k, 6, 5, 2
    rng = np.random.default_rng(5)
    moe = np.stack([rng.permutation(n)[:k] for _ in range((p + c - 1) * 7)]) \
        .reshape(p + c - 1, 7, k)
    full = np.zeros((p + c - 1, f.num_layers, k), np.int32)
    full[:, 1:] = moe
    record = vllm_record(full[start:], prompt=p, completion=c)
    path = write_lines(tmp_path / "p.jsonl", [record])
    refused(capsys, tmp_path, "vllm", path, "routed_experts_prompt_start", "--prompt-start 2",
            model="tiny-deepseek-v3")
    for option in ("2", "auto"):
        code = import_routing.main([str(path), "--format", "vllm", "--model",
                                    "tiny-deepseek-v3", "--bench", "b", "--run", f"s{option}",
                                    "--out", str(tmp_path / "t"), "--no-progress", "--tokens",
                                    "all", "--prompt-start", option])
        assert code == 0, capsys.readouterr().err
        got = next(tokens.requests(the_run(tmp_path / "t", f"s{option}"), prompt_tokens=True))
        assert got.tokens.token.tolist() == list(range(start - p, c - 1))
        assert np.array_equal(got.tokens.ids, moe[start:])
    refused(capsys, tmp_path, "vllm", path, "past the prompt", model="tiny-deepseek-v3",
            extra=("--prompt-start", "9"))


class RouterTracer:
    """Megatron-LM's RouterTracer serialisation, reproduced (router_trace.py): records buffered
    per router call and written at a step boundary with ``step`` stamped (training:
    ``advance_step(iteration)``), ``layer`` the module's ``decoder.layers.<i>`` (hooks) or the
    given ``layer_ids`` (``record_indices``), one JSON object per line."""

    def __init__(self, rank: int = 0):
        self.rank, self.records, self.lines = rank, [], []

    def hook(self, layer: int, top: np.ndarray) -> None:  # _record, training mode
        self.records.append(dict(step=0, stage="pre_dispatch", block="decoder", layer=layer,
                                 rank=self.rank, num_tokens=len(top), topk=top.shape[1],
                                 top_indices=top))

    def record_indices(self, indices: np.ndarray, layer_ids: list[int]) -> None:
        for i, layer in enumerate(layer_ids):
            self.hook(layer, indices[:, i])

    def advance_step(self, step: int) -> None:
        for rec in self.records:
            rec["step"] = step
            rec["top_indices"] = rec["top_indices"].tolist()
            self.lines.append(json.dumps(rec))
        self.records = []

    def write(self, folder: Path) -> Path:
        folder.mkdir(exist_ok=True)
        path = folder / f"router_trace_rank{self.rank}.jsonl"
        path.write_text("".join(line + "\n" for line in self.lines))
        return path


def megatron_lines(steps: list[np.ndarray], skip_layer: tuple | None = None) -> list[dict]:
    out = []
    for s, ids_ in enumerate(steps):
        for layer in range(L):
            if skip_layer == (s, layer):
                continue
            out.append(dict(step=s, stage="pre_dispatch", block="decoder", layer=layer, rank=0,
                            num_tokens=len(ids_), topk=K, top_indices=ids_[:, layer].tolist()))
    return out


def test_megatron_microbatches_and_recomputation_within_an_iteration(tmp_path, facts, capsys):
    """Path 6: training with 2 microbatches per iteration and activation recomputation: every
    router call of an iteration carries its step; the recomputed forward re-fires the hooks (in
    backward order) with the same ids. Refused naming --microbatches-per-step, read with it:
    each microbatch a pass, the re-fires dropped and counted."""
    f = facts("tiny-olmoe")
    tracer = RouterTracer()
    batches = {}
    for it in (5, 6):  # iteration numbers as the training loop gives them
        mbs = [good_ids(3, 10 * it + m) for m in range(2)]
        batches[it] = mbs
        for mb in mbs:  # forward of each microbatch
            for layer in range(L):
                tracer.hook(layer, mb[:, layer])
        for mb in reversed(mbs):  # backward: recomputation re-runs each layer's router
            for layer in reversed(range(L)):
                tracer.hook(layer, mb[:, layer])
        tracer.advance_step(it)
    tracer.write(tmp_path / "meg")
    refused(capsys, tmp_path, "megatron", tmp_path / "meg", "--microbatches-per-step 2")
    s = import_routing.import_routing(FORMATS["megatron"], tmp_path / "meg", f, tmp_path / "t",
                                      "b", "mb", options=ReadOptions(microbatches=2),
                                      progress=False)
    assert s.tokens == 12 and list(s.skipped.values()) == [2 * 2 * L]  # iterations × microbatches × layers
    got = next(tokens.requests(the_run(tmp_path / "t", "mb"))).tokens
    assert np.array_equal(got.ids, np.concatenate(batches[5] + batches[6]))
    assert got.step.tolist() == [10] * 3 + [11] * 3 + [12] * 3 + [13] * 3  # iteration × 2 + m
    figs = ids.figures(the_run(tmp_path / "t", "mb"))
    assert figs.batching == "recorded" and figs.passes == 4


def test_megatron_record_indices_layers_and_merged_rank_files(tmp_path, facts, capsys):
    """Path 7: inference with routing replay records through record_indices(layer_ids=
    [layer_number]), 1-based and offset by the pipeline stage (two stages of 4 layers: files
    numbered 1…4 and 5…8); sequence parallelism shards each step's tokens over 2 tensor-parallel
    ranks. --layer-base 1 and --merge-ranks read both; the same tokens on two ranks (no sequence
    parallelism) are refused."""
    f = facts("tiny-olmoe")
    steps = [good_ids(4, 20), good_ids(2, 21)]
    pp = tmp_path / "pp"
    for stage in range(2):
        tracer = RouterTracer(rank=stage)
        layers = list(range(4 * stage, 4 * stage + 4))
        for s_, full in enumerate(steps):
            tracer.record_indices(full[:, layers], [x + 1 for x in layers])
            tracer.advance_step(s_)
        tracer.write(pp)
    refused(capsys, tmp_path, "megatron", pp, "--layer-base 1", extra=("--merge-ranks",))
    s = import_routing.import_routing(FORMATS["megatron"], pp, f, tmp_path / "t", "b", "pp",
                                      options=ReadOptions(layer_base=1, merge_ranks=True),
                                      progress=False)
    got = next(tokens.requests(the_run(tmp_path / "t", "pp"))).tokens
    assert s.requests == 1 and np.array_equal(got.ids, np.concatenate(steps))
    sp = tmp_path / "sp"
    for rank in range(2):  # each rank's router sees its half of the tokens
        tracer = RouterTracer(rank=rank)
        for s_, full in enumerate(steps):
            half = full[rank * len(full) // 2:(rank + 1) * len(full) // 2]
            for layer in range(L):
                tracer.hook(layer, half[:, layer])
            tracer.advance_step(s_)
        tracer.write(sp)
    s = import_routing.import_routing(FORMATS["megatron"], sp, f, tmp_path / "t", "b", "sp",
                                      options=ReadOptions(merge_ranks=True), progress=False)
    got = next(tokens.requests(the_run(tmp_path / "t", "sp"))).tokens
    assert np.array_equal(got.ids, np.concatenate(steps)) and s.tokens == 6
    assert got.step.tolist() == [0] * 4 + [1] * 2
    (sp / "router_trace_rank1.jsonl").write_text((sp / "router_trace_rank0.jsonl").read_text()
                                                 .replace('"rank": 0', '"rank": 1'))
    refused(capsys, tmp_path, "megatron", sp, "without sequence parallelism",
            extra=("--merge-ranks",))
    refused(capsys, tmp_path, "sglang", sp / "router_trace_rank0.jsonl", "--merge-ranks applies "
            "to megatron", extra=("--merge-ranks",))


def moe_trace_rows(ubatch: np.ndarray, n_layer: int = L, seed: int = 0) -> list[str]:
    """What llama.cpp's moe-trace eval callback writes for one ubatch whose true top-k ids are
    ``ubatch`` ``[n, L, k]`` (every layer MoE): per layer in order, the ``ffn_moe_topk-<il>``
    tensor copied as if contiguous. It is a strided view of the argsort ``[n, N]`` (its first k
    columns), so for n > 1 the copy holds the first n·k values of the argsort: token 0's full
    ranking, not the top-k of each token; and the last layer (il = n_layer − 1) routes only the
    output token in a multi-token ubatch (``inp_out_ids`` gathered before its MoE block)."""
    rng = np.random.default_rng(seed)
    n = len(ubatch)
    out = []
    for layer in range(n_layer):
        top = ubatch[:, layer]  # [n, k]
        if n == 1:
            copied = top.reshape(-1)
        elif layer == n_layer - 1:  # only the output (last) token reaches this MoE block
            copied = top[-1]
        else:
            argsort = np.stack([np.r_[t, rng.permutation(np.setdiff1d(np.arange(N), t))]
                                for t in top])  # [n, N]: each token's ranking, top-k first
            copied = argsort.reshape(-1)[:n * K]  # the strided view read as contiguous
        out += [f"{layer},{e}" for e in copied]
    return out


def test_llamacpp_ubatches_are_rebuilt_from_rows(tmp_path, facts, capsys):
    """Path 8: a prompt ubatch of 4 tokens (its rows strided copies, its last layer the output
    token only), then 3 one-token decode ubatches: the decode tokens are read exactly, the prompt
    ubatch dropped (counted), with --tokens all too; a multi-token ubatch after decoding began,
    a lost row and a header-only file are refused."""
    prompt, decode = good_ids(4, 3), good_ids(3, 4)
    rows = ["layer,expert"] + moe_trace_rows(prompt)
    for t in range(len(decode)):
        rows += moe_trace_rows(decode[t:t + 1])
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(rows) + "\n")
    f = facts("tiny-olmoe")
    for mode in ("decode", "all"):
        s = import_routing.import_routing(FORMATS["llamacpp"], path, f, tmp_path / "t", "b",
                                          f"cpp-{mode}", options=ReadOptions(tokens=mode),
                                          progress=False)
        assert (s.tokens, s.prompt_rows) == (3, 0)
        assert s.skipped == {"prompt ubatch rows dropped (moe-trace copies them from a strided "
                             "view)": 4}
        got = next(tokens.requests(the_run(tmp_path / "t", f"cpp-{mode}"),
                                   prompt_tokens=True)).tokens
        assert got.token.tolist() == [0, 1, 2] and got.step.tolist() == [1, 2, 3]
        assert np.array_equal(got.ids, decode)
    late = rows + moe_trace_rows(good_ids(2, 9))
    path.write_text("\n".join(late) + "\n")
    refused(capsys, tmp_path, "llamacpp", path, "after decoding began", "strided")
    path.write_text("\n".join(rows[:-3]) + "\n")  # the last token's last layer lost 3 rows
    refused(capsys, tmp_path, "llamacpp", path, "wrong shape")
    path.write_text("\n".join(rows) + "\n7,\n")  # a cut-short last row
    refused(capsys, tmp_path, "llamacpp", path, "layer,expert")
    path.write_text("layer,expert\n")  # issue 60: only the header (an empty run: refused)
    refused(capsys, tmp_path, "llamacpp", path, "routes no token")


# --- a routing-only run among the others -------------------------------------------------------
@pytest.fixture(scope="module")
def imported(captured, facts, tmp_path_factory):
    """tiny-olmoe's capture exported to SGLang and imported (run ``imp``)."""
    native = the_run(captured, "cap", "tiny-olmoe")
    dest = tmp_path_factory.mktemp("sglang") / "s.jsonl"
    export_routing.export_routing(native, "sglang", dest)
    import_routing.import_routing(FORMATS["sglang"], dest, facts("tiny-olmoe"), captured,
                                  "mbpp", "imp", progress=False, options=EXPORTED["sglang"])
    return the_run(captured, "imp", "tiny-olmoe")


@pytest.mark.slow
def test_replay_refuses_a_routing_only_run_in_one_line(imported, captured, capsys):
    from moe_spec.replay import cli as replay_cli
    from moe_spec.replay.plan import ReplayError, ReplayOutcome, run_layers_noted
    code = replay_cli.main(["--traces", str(captured), "--model", "tiny-olmoe", "--run", "imp",
                            "--ranking", "router", "--budget", "16", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "routing-only (imported from sglang)" in err and "nothing to replay" in err
    with pytest.raises(ReplayError, match="no hidden states"):
        run_layers_noted(imported, [0], "open", ReplayOutcome())
    assert [r.name for r in Catalog(captured).runs(model="tiny-olmoe")] == ["cap"]


@pytest.mark.slow
def test_views_and_summaries_mark_and_read_a_routing_only_run(imported, captured):
    from moe_spec.analysis import summaries
    from moe_spec.analysis.sql import connect
    summaries.ensure(captured, workers=1)
    con = connect(captured, runs=("cap", "imp"))
    kinds = dict(con.execute("SELECT run, kind FROM runs WHERE model = 'tiny-olmoe'").fetchall())
    assert kinds == {"cap": "capture", "imp": "routing-only"}
    figs = ids.figures(imported)
    rows = con.execute("SELECT count(*) FROM routing_ids WHERE run = 'imp'").fetchone()[0]
    assert rows == figs.tokens * len(figs.layers)
    layer = figs.layers[0]
    stored = con.execute("SELECT tokens, tree_layers, selections, coact_all, coverage_sum "
                         f"FROM summary_layers WHERE run = 'imp' AND layer = {layer}").fetchone()
    s = figs.sums[layer]
    assert stored[:2] == (s.tokens, s.passes)
    assert stored[2] == s.selections.tolist() and stored[3] == s.coact_all.reshape(-1).tolist()
    assert np.allclose(stored[4], s.coverage_sum, rtol=0, atol=0)


def test_a_report_of_routing_only_runs_alone_marks_them(tmp_path, facts):
    """A traces folder holding imports only (no trees anywhere): one report, marked, with the
    routing figures by counts and the truncation coverage."""
    from moe_spec.analysis.report import write_report
    records = [sglang_record(good_ids(6, seed), rid=f"q{seed}") for seed in range(5)]
    src = write_lines(tmp_path / "s.jsonl", records)
    import_routing.import_routing(FORMATS["sglang"], src, facts("tiny-olmoe"), tmp_path / "t",
                                  "chat", "prod", batch_size=2, progress=False)
    written = write_report(tmp_path / "t", tmp_path / "reports")
    assert len(written) == 1
    page = written[0].read_text()
    assert "Routing-only: imported from SGLang" in page and "Truncation coverage" in page
    assert "routed-token counts" in page and "virtual batches of b = 2" in page


def test_an_import_never_replaces_a_run_and_resumes_nothing(tmp_path, facts, capsys):
    src = write_lines(tmp_path / "s.jsonl", [sglang_record(good_ids(2))])
    f = facts("tiny-olmoe")
    import_routing.import_routing(FORMATS["sglang"], src, f, tmp_path / "t", "b", "r",
                                  progress=False)
    code = import_routing.main([str(src), "--format", "sglang", "--model", "tiny-olmoe",
                                "--bench", "b", "--run", "r", "--out", str(tmp_path / "t"),
                                "--no-progress"])
    assert code == 2 and "never replaces" in capsys.readouterr().err
    run = the_run(tmp_path / "t", "r")
    part = run.files(schema.ROUTING_IDS)[0]
    part.write_bytes(part.read_bytes()[:-8] + b"\0" * 8)  # a damaged part is named
    from moe_spec.catalog import CatalogError
    with pytest.raises(CatalogError, match="routing_ids"):
        list(tokens.chunks(the_run(tmp_path / "t", "r")))


def test_export_refuses_an_existing_dest_without_force(tmp_path, facts, capsys):
    src = write_lines(tmp_path / "s.jsonl", [sglang_record(good_ids(2))])
    import_routing.import_routing(FORMATS["sglang"], src, facts("tiny-olmoe"), tmp_path / "t",
                                  "b", "r", progress=False)
    dest = tmp_path / "out.jsonl"
    dest.write_text('{"keep": "me"}\n')  # JSON lines: what --force may replace
    args = ["--format", "vllm", "--run", "r", "--traces", str(tmp_path / "t"), str(dest)]
    assert export_routing.main(args) == 2 and "--force" in capsys.readouterr().err
    assert dest.read_text() == '{"keep": "me"}\n'
    assert export_routing.main([*args, "--force"]) == 0
    assert json.loads(dest.read_text().splitlines()[0])["usage"]["completion_tokens"] == 3


def test_the_import_summary_is_written_as_json(tmp_path):
    src = write_lines(tmp_path / "s.jsonl", [sglang_record(good_ids(3))])
    out = tmp_path / "summary.json"
    assert import_routing.main([str(src), "--format", "sglang", "--model", "tiny-olmoe",
                                "--bench", "b", "--out", str(tmp_path / "t"), "--no-progress",
                                "--output", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tool"] == "import-routing" and got["run"] == "sglang-s"
    assert (got["requests"], got["tokens"], got["token_layers"]) == (1, 3, 3 * L)
    assert got["token_layers_per_s"] > 0 and got["peak_rss_mib"] > 0


def test_an_import_goes_to_an_object_store_and_reads_back(s3, tmp_path, facts):
    """A routing-only run on s3:// (moto): committed, read back, and removed whole when the
    source turns out bad half-way."""
    from conftest import S3_BUCKET
    root = f"s3://{S3_BUCKET}/imports"
    src = write_lines(tmp_path / "s.jsonl", [sglang_record(good_ids(3)),
                                             sglang_record(good_ids(2, 1), rid="r1")])
    import_routing.import_routing(FORMATS["sglang"], src, facts("tiny-olmoe"), root, "b", "r",
                                  part_rows=1000, progress=False)
    run = the_run(root, "r")
    got = [r.tokens.ids for r in tokens.requests(run)]
    assert np.array_equal(got[0], good_ids(3)) and np.array_equal(got[1], good_ids(2, 1))
    bad = write_lines(tmp_path / "b.jsonl", [sglang_record(good_ids(3)),
                                             sglang_record(good_ids(2), encoded="!")])
    with pytest.raises(Exception, match="base64"):
        import_routing.import_routing(FORMATS["sglang"], bad, facts("tiny-olmoe"), root, "b",
                                      "bad", part_rows=1000, progress=False)
    assert not s3.glob(f"{S3_BUCKET}/imports/*/model=*/bench=b/run=bad/*")


# --- issue 60: imported numbers are checked as numbers -------------------------------------------
def megatron_line(**change) -> str:
    record = dict(step=0, stage="pre_dispatch", block="decoder", layer=0, rank=0, num_tokens=1,
                  topk=K, top_indices=[list(range(K))])
    return json.dumps({**record, **change})


@pytest.mark.parametrize("case,line,words", [
    ("bool id", megatron_line(top_indices=[[True] + list(range(1, K))]), ["true/false"]),
    ("string id", megatron_line(top_indices=[["5"] + list(range(1, K))]), ["strings"]),
    ("float id", megatron_line(top_indices=[[1.5] + list(range(1, K))]), ["non-integer"]),
    ("null id", megatron_line(top_indices=[[None] + list(range(1, K))]), ["null"]),
    ("huge id", megatron_line(top_indices=[[10**30] + list(range(1, K))]), ["out of range"]),
    ("huge step", megatron_line(step=10**30), ["step", "31-digit"]),
    ("1e400", megatron_line().replace('"step": 0', '"step": 1e400'), ["not a finite number"]),
    ("Infinity", megatron_line().replace('"step": 0', '"step": Infinity'), ["Infinity"]),
    ("bool step", megatron_line(step=True), ["step is True"]),
    ("5000 digits", megatron_line().replace('"step": 0', '"step": ' + "9" * 5000),
     ["number too long"]),
    ("deep nesting", '{"top_indices": ' + "[" * 200_000 + "]" * 200_000 + "}",
     ["nesting too deep"]),
])
def test_hostile_numbers_are_one_line(case, line, words, tmp_path, capsys):
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "router_trace_rank0.jsonl"
    path.write_text(line + "\n")
    refused(capsys, tmp_path, "megatron", path, *words)


def test_hostile_response_numbers_and_sizes_are_one_line(tmp_path, capsys):
    ids_ = good_ids(2)
    nan = sglang_record(ids_)
    line = json.dumps(nan).replace('"e2e_latency": 0.5', '"e2e_latency": NaN')
    (tmp_path / "n.jsonl").write_text(line + "\n")  # never a NaN stored
    refused(capsys, tmp_path, "sglang", tmp_path / "n.jsonl", "NaN")
    big = sglang_record(ids_)
    big["meta_info"]["prompt_tokens"] = 10**30
    refused(capsys, tmp_path, "sglang", write_lines(tmp_path / "p.jsonl", [big]),
            "prompt_tokens", "31-digit")
    stamp = vllm_record(good_ids(5))
    stamp["created"] = True
    refused(capsys, tmp_path, "vllm", write_lines(tmp_path / "c.jsonl", [stamp]), "created")
    nested = vllm_record(good_ids(5), nested=True)
    nested["choices"][0]["routed_experts"][0][0][0] = True
    refused(capsys, tmp_path, "vllm", write_lines(tmp_path / "b.jsonl", [nested]), "true/false")
    # a .npy header declaring (1e11, 8, 8) over a few bytes: refused before any allocation
    import io
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i4", "fortran_order": False,
                                                  "shape": (10**11, 8, 8)})
    huge = vllm_record(good_ids(5))
    huge["choices"][0]["routed_experts"] = base64.b64encode(buffer.getvalue() + b"\0" * 64) \
        .decode()
    refused(capsys, tmp_path, "vllm", write_lines(tmp_path / "h.jsonl", [huge]),
            "header declares shape [100000000000, 8, 8]")


def test_a_config_with_absurd_sizes_is_refused(tmp_path, capsys):
    folder = tmp_path / "absurd"
    folder.mkdir()
    config = json.loads((models.resolve("tiny-olmoe").path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**7}))
    src = write_lines(tmp_path / "s.jsonl", [sglang_record(good_ids(2))])
    refused(capsys, tmp_path, "sglang", src, "num_hidden_layers = 10000000", model=str(folder))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_export_import_export_is_a_fixpoint_with_prompt_lengths(fmt, tmp_path, facts):
    """An imported run (SGLang responses with prompts of 5, 2 and 7 tokens) exported, imported
    and exported again: the two exports are identical, prompt lengths included."""
    f = facts("tiny-olmoe")
    records = [sglang_record(good_ids(t, seed), prompt=p, rid=f"q{seed}")
               for seed, (t, p) in enumerate([(4, 5), (0, 2), (6, 7)])]
    src = write_lines(tmp_path / "s.jsonl", records)
    import_routing.import_routing(FORMATS["sglang"], src, f, tmp_path / "t", "b", "run0",
                                  progress=False)
    folder = FORMATS[fmt].dest_is_folder
    dests = []
    for i in range(2):
        dest = tmp_path / (f"out{i}" if folder else f"out{i}.jsonl")
        export_routing.export_routing(the_run(tmp_path / "t", f"run{i}"), fmt, dest,
                                      batch_size=B)
        import_routing.import_routing(FORMATS[fmt], dest, f, tmp_path / "t", "b", f"run{i + 1}",
                                      options=EXPORTED[fmt], progress=False)
        dests.append(dest)
    if folder:
        # the engine's files; export-routing's own marker names the run it came from
        a, b = (sorted(p.relative_to(x) for p in x.rglob("*") if p.name != export_routing.MARKER)
                for x in dests)
        assert a == b and all((dests[0] / n).read_bytes() == (dests[1] / n).read_bytes()
                              for n in a)
    else:
        assert dests[0].read_bytes() == dests[1].read_bytes()
    if fmt in ("vllm", "sglang"):
        lines = [json.loads(x) for x in dests[0].read_text().splitlines()]
        counts = [x["usage"]["prompt_tokens"] if fmt == "vllm" else x["meta_info"]
                  ["prompt_tokens"] for x in lines]
        assert counts == [5, 2, 7]
        for r in (1, 2):
            assert [q.prompt_len for q in tokens.requests(the_run(tmp_path / "t", f"run{r}"))] \
                == [5, 2, 7]
    a = np.concatenate([t.ids for t in tokens.chunks(the_run(tmp_path / "t", "run0"))])
    b = np.concatenate([t.ids for t in tokens.chunks(the_run(tmp_path / "t", "run2"))])
    assert np.array_equal(a, b)


@pytest.mark.parametrize("fmt,extra,words", [
    ("sglang", ("--prompt-start", "-1"), ["--prompt-start '-1'"]),
    ("vllm", ("--prompt-start", "1e9"), ["'prompt' or 'auto'"]),
    ("megatron", ("--microbatches-per-step", "0"), ["within 1 … 4096"]),
    ("megatron", ("--prompt-start", "3"), ["--prompt-start applies to vllm, sglang"]),
    ("sglang", ("--layer-base", "1"), ["--layer-base applies to megatron"]),
    ("llamacpp", ("--microbatches-per-step", "2"), ["applies to megatron"]),
])
def test_reading_options_are_checked_before_reading(fmt, extra, words, tmp_path, capsys):
    src = write_lines(tmp_path / "s.jsonl", [sglang_record(good_ids(2))])
    refused(capsys, tmp_path, fmt, src, *words, extra=extra)
