"""A full-size OLMoE-1B-7B with random weights through the real loading path, on this CPU.

    python bench/full_size.py                    # folder made once (~14 GB bf16), then measured
    python bench/full_size.py --prompts 1 --max-new-tokens 4 --out full_size.json

1. Writes (once, under ``--cache``, never into the repository) a Hugging Face folder with the
   real ``allenai/OLMoE-1B-7B-0924`` config (:data:`moe.shapes.REAL_SHAPES`: 16 layers, hidden
   2048, 64 experts of 1024, top-8, vocab 50304) and random bf16 weights as sharded safetensors
   with an index, written tensor by tensor (weights N(0, initializer_range²), norms 1) so that
   making it never holds the model in memory; the tokenizer is the embedded tiny-olmoe's (its
   4,096 ids are valid ids of the 50,304-token vocabulary), and a random EAGLE-3 head in the
   official layout (``config.json`` + ``model.safetensors``, native key names) beside it.
2. Runs the commands a user runs, each in its own process under ``/usr/bin/time`` (peak RSS):
   ``capture --model <folder> --draft <head> --dtype bfloat16`` on ``--prompts`` MBPP prompts,
   ``replay`` (router and oracle, B = 8/16/32), ``report``, and every dashboard page through
   Streamlit's AppTest.
3. Quotes load time, peak RSS (goal ≤ 20 GiB), seconds per verification pass, bytes per tree
   at full depth against the one-layer projection of ``bench/capture_overhead.py`` (a random
   one-layer model with the same widths, captured with the same prompts; goal within 10 %), and
   replay tree-layers/s at full size.

``--small`` replaces the widths by tiny ones (the smoke test's path: same code, seconds).
A bench, not a test: the full run takes tens of minutes on 2 cores. One run, other jobs beside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPE = "olmoe"
SHARD_BYTES = 2 * 2**30
SMALL = dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
             num_hidden_layers=4, vocab_size=4096)
BUDGETS = "8,16,32"


def bin_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def make_folder(folder: Path, *, small: bool, seed: int = 0) -> dict:
    """The random-weight checkpoint and its draft head, written once; returns what was made."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_spec.eagle.draft_head import DraftConfig, Eagle3Draft, default_feature_layers
    from moe_spec.moe import families, shapes
    from moe_spec.moe.models import EMBEDDED_DIR

    done = folder / "_complete.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    model_dir, draft_dir = folder / "model", folder / "draft"
    model_dir.mkdir(parents=True)
    start = time.perf_counter()
    cfg = shapes.REAL_SHAPES[SHAPE].build_config(
        tie_word_embeddings=False, pad_token_id=1, eos_token_id=0, bos_token_id=None,
        **(SMALL if small else {}))
    cfg.dtype = "bfloat16"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    std = cfg.initializer_range

    def tensor(name: str, shape: torch.Size) -> torch.Tensor:
        if len(shape) == 1:  # RMS norms' weights (OLMoE has no biases)
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            shards.append(current)
            name = f"model-{len(shards):05d}.safetensors"
            save_file(current, model_dir / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in current})
            current, size = {}, 0

    total = 0
    for name, param in skeleton.state_dict().items():
        t = tensor(name, param.shape)
        nbytes = t.numel() * t.element_size()
        if size + nbytes > SHARD_BYTES:
            flush()
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    count = len(shards)
    for i in range(1, count + 1):  # the hub's names: model-0000i-of-0000n.safetensors
        old, new = f"model-{i:05d}.safetensors", f"model-{i:05d}-of-{count:05d}.safetensors"
        (model_dir / old).rename(model_dir / new)
        weight_map = {k: (new if v == old else v) for k, v in weight_map.items()}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(EMBEDDED_DIR / "tiny-olmoe").save_pretrained(model_dir)

    # a random EAGLE-3 head in the official layout (config.json + model.safetensors)
    f = families.facts(cfg)
    dcfg = DraftConfig(hidden_size=f.hidden_size, intermediate_size=4 * f.hidden_size,
                       num_attention_heads=f.heads, num_key_value_heads=f.kv_heads,
                       vocab_size=f.vocab, rope_theta=f.rope_theta or 10000.0,
                       feature_layers=default_feature_layers(f.num_layers),
                       target_model_type=f.model_type, target_num_layers=f.num_layers)
    torch.manual_seed(seed + 1)
    head = Eagle3Draft(dcfg, torch.nn.Embedding(1, 1))
    for m in head.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=std)
    head.to(torch.bfloat16).save_pretrained(draft_dir)
    made = dict(small=small, seconds=round(time.perf_counter() - start, 1), bytes=total,
                shards=count, config=dict(
                    num_hidden_layers=f.num_layers, hidden_size=f.hidden_size,
                    num_experts=f.num_experts, intermediate_size=f.dense_inter,
                    num_experts_per_tok=f.top_k, vocab_size=f.vocab))
    done.write_text(json.dumps(made, indent=1))
    return made


def timed_run(args: list[str], env: dict) -> dict:
    """Run a command under /usr/bin/time; its wall seconds, peak RSS (GiB) and output."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KIB=%M", *args], env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    found = re.findall(r"PEAK_RSS_KIB=(\d+)", done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:2])} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return dict(seconds=seconds, peak_rss_gib=int(found[-1]) / 2**20 if found else math.nan,
                stdout=done.stdout)


def one_layer_projection(folder: Path, traces: Path, common: list[str], env: dict,
                         small: bool) -> tuple[float, float]:
    """Bytes per tree of a one-layer random model with the same widths (capture with the
    same prompts), projected to the real depth as ``bench/capture_overhead.py`` does; and the
    measured per-layer bytes."""
    import pyarrow.parquet as pq

    from moe_spec.bench.capture_overhead import projected  # the one projection, not a copy
    from moe_spec.moe import families, shapes
    one = folder / "one-layer"
    head = one / "draft"
    if not (head / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from moe_spec.eagle.draft_head import new_eagle3
        from moe_spec.moe.models import EMBEDDED_DIR

        cfg = shapes.REAL_SHAPES[SHAPE].build_config(
            tie_word_embeddings=False, pad_token_id=1, eos_token_id=0, bos_token_id=None,
            **{**(SMALL if small else {}), "num_hidden_layers": 1})
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        target.save_pretrained(one)
        AutoTokenizer.from_pretrained(EMBEDDED_DIR / "tiny-olmoe").save_pretrained(one)
        new_eagle3(target, intermediate_size=4 * families.facts(cfg).hidden_size,
                   feature_layers=[0, 0, 0]).to(torch.bfloat16).save_pretrained(head)
    out = traces / "one-layer"
    timed_run([bin_path("capture"), "--model", str(one), "--draft", str(head), *common,
               "--out", str(out)], env)

    def per_tree(table):
        files = list((out / table).rglob("*.parquet"))
        return sum(f.stat().st_size for f in files)

    trees = sum(pq.read_metadata(f).num_rows for f in (out / "trees").rglob("*.parquet"))
    per_layer = {"routing": per_tree("routing") / trees, "bf16": per_tree("moe_io") / trees}
    shape = shapes.REAL_SHAPES[SHAPE]
    if small:
        shape = shapes.RealShape(shape.name, shape.checkpoint, shape.model_type,
                                 {**shape.config, **SMALL})
    fixed = sum(per_tree(t) for t in ("trees", "nodes", "sequences")) / trees
    default_policy = projected(shape, {**per_layer, "fp32": math.nan})[0][1]  # (auto, bf16)
    return default_policy + fixed, per_layer["routing"] + per_layer["bf16"]


def app_pages(traces: Path, env: dict) -> dict:
    """Every dashboard page rendered once with Streamlit's AppTest, in a fresh process: each
    page's seconds and the process's peak RSS."""
    code = f"""
import json, resource, sys, time
sys.argv = ["main.py", "--traces", {str(traces)!r}]
from streamlit.testing.v1 import AppTest
from moe_spec.app.screens import PAGES
at = AppTest.from_file({str(ROOT / 'app' / 'main.py')!r}, default_timeout=1200)
times = {{}}
t = time.perf_counter(); at.run(); times["overview"] = round(time.perf_counter() - t, 2)
assert not at.exception, [e.message for e in at.exception]
for name in PAGES:
    if name == "overview":
        continue
    t = time.perf_counter(); at.switch_page(f"screens/{{name}}.py").run()
    times[name] = round(time.perf_counter() - t, 2)
    assert not at.exception, (name, [e.message for e in at.exception])
print(json.dumps(dict(pages=times, peak_rss_gib=round(resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))))
"""
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"dashboard pages failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path,
                   default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                   / "moe-spec-workbench" / "full-size",
                   help="where the random checkpoint is made once (default ~/.cache/...)")
    p.add_argument("--small", action="store_true",
                   help="tiny widths instead of the real ones (the smoke test's path)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rankings", nargs="+", default=["router", "oracle"],
                   help="rankings replayed (the oracle computes every expert of every layer)")
    p.add_argument("--traces", type=Path, default=None, help="keep the traces here")
    p.add_argument("--out", type=Path, default=Path("full_size.json"))
    args = p.parse_args()
    folder = args.cache / ("olmoe-small" if args.small else "olmoe-1b-7b-random")
    made = make_folder(folder, small=args.small)
    print(f"checkpoint: {folder / 'model'} ({made['bytes'] / 2**30:.1f} GiB in {made['shards']} "
          f"shards; made in {made['seconds']} s)", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    traces = args.traces or Path(tempfile.mkdtemp(prefix="full-size-"))
    common = ["--bench", "mbpp", "--limit", str(args.prompts), "--max-new-tokens",
              str(args.max_new_tokens), "--dtype", "bfloat16", "--device", "cpu", "--threads",
              str(args.threads), "--no-progress"]
    report: dict = dict(checkpoint=made)
    try:
        cap = timed_run([bin_path("capture"), "--model", str(folder / "model"), "--draft",
                         str(folder / "draft"), *common, "--out", str(traces / "full"),
                         "--output", str(traces / "capture.json")], env)
        import pyarrow.parquet as pq
        summary = json.loads((traces / "capture.json").read_text())
        trees = pq.read_table(traces / "full" / "trees", columns=["verify_seconds",
                                                                  "draft_seconds"])
        nbytes = sum(f.stat().st_size for f in (traces / "full").rglob("*.parquet"))
        decode = float(sum(trees["verify_seconds"].to_pylist())
                       + sum(trees["draft_seconds"].to_pylist()))
        report["capture"] = dict(
            wall_seconds=round(cap["seconds"], 1), run_seconds=round(summary["seconds"], 1),
            peak_rss_gib=round(cap["peak_rss_gib"], 2),
            load_seconds=round(summary["load_seconds"], 1),
            trees=trees.num_rows, decode_seconds=round(decode, 1),
            seconds_per_verification_pass=round(
                float(sum(trees["verify_seconds"].to_pylist())) / max(1, trees.num_rows), 2),
            bytes_per_tree=round(nbytes / max(1, trees.num_rows)))
        projection, _ = one_layer_projection(folder, traces, common, env, args.small)
        report["capture"]["projected_bytes_per_tree"] = round(projection)
        report["capture"]["measured_over_projected"] = round(
            report["capture"]["bytes_per_tree"] / projection, 3)
        rep = timed_run([bin_path("replay"), "--traces", str(traces / "full"), "--ranking",
                         *args.rankings, "--budget", BUDGETS, "--threads", str(args.threads),
                         "--output", str(traces / "replay.json"), "--no-progress"], env)
        found = json.loads((traces / "replay.json").read_text())
        from moe_spec.moe import families
        layers = families.facts(made["config"]).num_layers  # the config it made
        tree_layers = report["capture"]["trees"] * layers
        report["replay"] = dict(wall_seconds=round(rep["seconds"], 1),
                                seconds=round(found["seconds"], 1),  # after loading
                                peak_rss_gib=round(rep["peak_rss_gib"], 2),
                                tree_layers=tree_layers,
                                tree_layers_per_s=round(tree_layers / found["seconds"], 1),
                                summary=found["summary"])
        rpt = timed_run([bin_path("report"), "--traces", str(traces / "full"), "--out",
                         str(traces / "report")], env)
        report["report"] = dict(seconds=round(rpt["seconds"], 1),
                                peak_rss_gib=round(rpt["peak_rss_gib"], 2))
        report["app"] = app_pages(traces / "full", env)
    finally:
        if args.traces is None:
            shutil.rmtree(traces, ignore_errors=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    c = report["capture"]
    print(f"capture: {c['trees']} trees, wall {c['wall_seconds']} s (load ≈ {c['load_seconds']} "
          f"s), peak RSS {c['peak_rss_gib']} GiB, {c['seconds_per_verification_pass']} s per "
          f"verification pass; {c['bytes_per_tree']:,} bytes per tree vs projected "
          f"{c['projected_bytes_per_tree']:,} ({c['measured_over_projected']}x)")
    r = report["replay"]
    print(f"replay ({', '.join(args.rankings)}; B = {BUDGETS}; both policies): {r['tree_layers']} "
          f"tree-layers in {r['seconds']} s after loading = {r['tree_layers_per_s']} "
          f"tree-layers/s (wall {r['wall_seconds']} s), peak RSS {r['peak_rss_gib']} GiB")
    print(f"report: {report['report']['seconds']} s; app pages: {report['app']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
