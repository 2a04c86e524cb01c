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
        batch_size=B, progress=False)
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


def good_ids(tokens_: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(N)[:K] for _ in range(tokens_ * L)]
    return np.stack(rows).reshape(tokens_, L, K) if rows else np.zeros((0, L, K), np.int64)


def sglang_record(ids_: np.ndarray, prompt: int = 5, rid: str = "r0", start: int | None = None,
                  completion: int | None = None, encoded: str | None = None) -> dict:
    start = prompt if start is None else start
    completion = len(ids_) + 1 if completion is None else completion
    return {"text": "", "meta_info": {
        "id": rid, "prompt_tokens": prompt, "completion_tokens": completion,
        "routed_experts_start_len": start,
        "routed_experts": encoded if encoded is not None else
        base64.b64encode(np.asarray(ids_, "<i4").tobytes()).decode()}}


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
    "layers", "start past prompt", "no routed_experts", "empty"])
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
    elif case == "start past prompt":
        write_lines(path, [sglang_record(ids_, start=9)])
        refused(capsys, tmp_path, "sglang", path, "routed_experts_start_len")
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


def vllm_record(ids_: np.ndarray, prompt: int = 3, split: bool = False, nested: bool = False,
                completion: int | None = None) -> dict:
    from moe_spec.capture.engines.vllm import npy_base64
    completion = len(ids_) - (0 if split else prompt) + 1 if completion is None else completion
    routed = ids_.tolist() if nested else npy_base64(ids_.astype(np.int16))
    record = {"id": "cmpl-1", "created": 1700000000,
              "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
              "choices": [{"index": 0, "routed_experts": routed, "finish_reason": "stop"}]}
    if split:
        record["prompt_routed_experts"] = None
    return record


def test_vllm_layouts_and_prompt_rows(tmp_path, facts, capsys):
    """The whole-sequence layout (rows = prompt + completion − 1) keeps decode rows, prompt rows
    with --tokens all (token < 0); the split layout; nested lists; a wrong row count."""
    full = good_ids(7)  # 3 prompt rows + 4 decode rows
    path = write_lines(tmp_path / "v.jsonl", [vllm_record(full, nested=True)])
    f = facts("tiny-olmoe")
    s = import_routing.import_routing(FORMATS["vllm"], path, f, tmp_path / "t", "b", "dec",
                                      progress=False)
    assert (s.tokens, s.prompt_rows) == (4, 0)
    got = next(tokens.requests(the_run(tmp_path / "t", "dec")))
    assert np.array_equal(got.tokens.ids, full[3:]) and got.tokens.token.tolist() == [0, 1, 2, 3]
    s = import_routing.import_routing(FORMATS["vllm"], path, f, tmp_path / "t", "b", "all",
                                      options=ReadOptions(tokens="all"), progress=False)
    assert (s.tokens, s.prompt_rows) == (4, 3)
    run = the_run(tmp_path / "t", "all")
    every = next(tokens.requests(run, prompt_tokens=True)).tokens
    assert every.token.tolist() == [-3, -2, -1, 0, 1, 2, 3]
    assert ids.figures(run).tokens == 4  # the analyses read decode tokens only
    split = write_lines(tmp_path / "s.jsonl", [vllm_record(full[3:], split=True)])
    import_routing.import_routing(FORMATS["vllm"], split, f, tmp_path / "t", "b", "split",
                                  progress=False)
    got = next(tokens.requests(the_run(tmp_path / "t", "split")))
    assert np.array_equal(got.tokens.ids, full[3:])
    bad = write_lines(tmp_path / "w.jsonl", [vllm_record(full, completion=9)])
    refused(capsys, tmp_path, "vllm", bad, "wrong shape")
    ragged = vllm_record(full, nested=True)
    ragged["choices"][0]["routed_experts"][2][1] = [1, 2]
    refused(capsys, tmp_path, "vllm", write_lines(tmp_path / "r.jsonl", [ragged]), "ragged")


def megatron_lines(steps: list[np.ndarray], skip_layer: tuple | None = None) -> list[dict]:
    out = []
    for s, ids_ in enumerate(steps):
        for layer in range(L):
            if skip_layer == (s, layer):
                continue
            out.append(dict(step=s, stage="pre_dispatch", block="decoder", layer=layer, rank=0,
                            num_tokens=len(ids_), topk=K, top_indices=ids_[:, layer].tolist()))
    return out


def test_megatron_steps_are_batch_passes_and_bad_steps_are_named(tmp_path, facts, capsys):
    steps = [good_ids(3, 1), good_ids(2, 2)]
    lines = megatron_lines(steps)
    lines.insert(3, dict(step=0, block="mtp", layer=0, num_tokens=1, top_indices=[[0] * K]))
    (tmp_path / "meg").mkdir()
    path = write_lines(tmp_path / "meg" / "router_trace_rank0.jsonl", lines)
    s = import_routing.import_routing(FORMATS["megatron"], tmp_path / "meg", facts("tiny-olmoe"),
                                      tmp_path / "t", "b", "meg", progress=False)
    assert (s.requests, s.tokens, s.skipped) == (1, 5, {"mtp records": 1})
    figs = ids.figures(the_run(tmp_path / "t", "meg"))
    assert figs.batching == "recorded" and figs.passes == 2
    assert figs.rows["nodes"][::L].tolist() == [3, 2]
    write_lines(path, megatron_lines(steps, skip_layer=(1, 5)))
    refused(capsys, tmp_path, "megatron", path, "step 1", "layer count disagrees")
    lines = megatron_lines(steps)
    lines[2]["num_tokens"] = 4
    write_lines(path, lines)
    refused(capsys, tmp_path, "megatron", path, "wrong shape")


def test_llamacpp_ubatches_are_rebuilt_from_rows(tmp_path, facts, capsys):
    """A prompt ubatch of 3 tokens, then 2 one-token decode ubatches: layer,expert rows."""
    prompt, decode = good_ids(3, 3), good_ids(2, 4)
    rows = ["layer,expert"]
    for ub in (prompt, decode[:1], decode[1:]):
        for layer in range(L):
            rows += [f"{layer},{e}" for e in ub[:, layer].reshape(-1)]
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(rows) + "\n")
    f = facts("tiny-olmoe")
    s = import_routing.import_routing(FORMATS["llamacpp"], path, f, tmp_path / "t", "b", "cpp",
                                      options=ReadOptions(tokens="all"), progress=False)
    assert (s.tokens, s.prompt_rows) == (2, 3)
    got = next(tokens.requests(the_run(tmp_path / "t", "cpp"), prompt_tokens=True)).tokens
    assert got.token.tolist() == [-3, -2, -1, 0, 1]
    assert np.array_equal(got.ids, np.concatenate([prompt, decode]))
    assert got.step.tolist() == [0, 0, 0, 1, 2]
    path.write_text("\n".join(rows[:-3]) + "\n")  # the last token's last layer lost 3 rows
    refused(capsys, tmp_path, "llamacpp", path, "wrong shape")
    path.write_text("\n".join(rows) + "\n7,\n")  # a cut-short last row
    refused(capsys, tmp_path, "llamacpp", path, "layer,expert")


# --- a routing-only run among the others -------------------------------------------------------
@pytest.fixture(scope="module")
def imported(captured, facts, tmp_path_factory):
    """tiny-olmoe's capture exported to SGLang and imported (run ``imp``)."""
    native = the_run(captured, "cap", "tiny-olmoe")
    dest = tmp_path_factory.mktemp("sglang") / "s.jsonl"
    export_routing.export_routing(native, "sglang", dest)
    import_routing.import_routing(FORMATS["sglang"], dest, facts("tiny-olmoe"), captured,
                                  "mbpp", "imp", progress=False)
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
