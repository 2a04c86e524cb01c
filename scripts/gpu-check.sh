#!/usr/bin/env bash
# On a machine with CUDA: capture and replay at real width in bf16, print the capture overhead
# (traced / untraced decoding) and bytes per tree. Skips cleanly (exit 0) without a GPU.
# 1. Random-weight models with the real widths of OLMoE-1B-7B and Qwen3-30B-A3B (two decoder
#    layers, built on the fly, never committed); SHAPES=olmoe overrides the list.
# 2. Full size through the real loading path: the hub's OLMoE-1B-7B and its EAGLE-3 head, when
#    both are in the local Hugging Face cache (nothing is downloaded: HF_HUB_OFFLINE=1), run
#    through the user's commands (capture, replay, report) with load time and peak memory;
#    otherwise it says what it skipped and how to fetch them. FULL_SIZE=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
export HF_HUB_OFFLINE=1
py=.venv/bin/python
if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False)"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for shape in ${SHAPES:-olmoe qwen3-moe}; do
  $py - "$shape" "$work" <<'PY'
import sys, time
from pathlib import Path
import torch
from moe_spec.capture.run import CaptureSettings, capture_run
from moe_spec.eagle import loading
from moe_spec.eagle.decoding import EagleDecoder
from moe_spec.training.real_width import real_width_pair
from moe_spec.moe import models
from moe_spec.replay import cli as replay_cli
from moe_spec.tasks import benchmarks

shape, work = sys.argv[1], Path(sys.argv[2])
models.quiet_transformers()
model, draft = real_width_pair(shape, work / shape, layers=2)
prompts = benchmarks.load("mbpp", limit=4)
loaded, head = loading.load_with_draft(str(model), str(draft), device="cuda", dtype="bfloat16")
dec = EagleDecoder(loaded.model, head)
tok = loaded.tokenizer
dec.generate(tok(prompts[0].text)["input_ids"], max_new_tokens=8)  # warm-up
torch.cuda.synchronize()
t0 = time.perf_counter()
for i, p in enumerate(prompts):
    dec.generate(tok(p.text)["input_ids"], max_new_tokens=64, eos_token_ids={tok.eos_token_id}, seed=i)
torch.cuda.synchronize()
plain = time.perf_counter() - t0
del dec, loaded, head
s = capture_run(CaptureSettings(model=str(model), draft=str(draft), limit=4, max_new_tokens=64,
                                device="cuda", dtype="bfloat16"), work / f"{shape}-traces", "gpu",
                progress=False)
traced = s.seconds - s.load_seconds
print(f"{shape} (2 layers, bf16, cuda): {s.trees} trees, traced/untraced {traced / plain:.3f}x, "
      f"{s.bytes_written / s.trees / 2**20:.2f} MiB per tree (2 of the real model's layers)")
t0 = time.perf_counter()
assert replay_cli.main(["--traces", str(work / f"{shape}-traces"), "--ranking", "router", "oracle",
                        "--budget", "sweep", "--device", "cuda", "--no-progress"]) == 0
print(f"{shape}: replay sweep on cuda {time.perf_counter() - t0:.1f} s")
PY
done

# --- 2. full size: the real checkpoint through the commands a user runs -------------------------
full_model=allenai/OLMoE-1B-7B-0924
full_draft=$($py -c "from moe.models import resolve; print(resolve('olmoe').alias.draft)")
if [ "${FULL_SIZE:-1}" = 0 ]; then
  echo "gpu-check: full-size skipped: FULL_SIZE=0"
elif ! $py - "$full_model" "$full_draft" <<'PY'
import sys
from huggingface_hub import try_to_load_from_cache
sys.exit(0 if all(isinstance(try_to_load_from_cache(r, "config.json"), str)
                  for r in sys.argv[1:]) else 1)
PY
then
  echo "gpu-check: full-size skipped: $full_model or its EAGLE-3 head $full_draft is not in the" \
       "local Hugging Face cache (hf download $full_model; hf download $full_draft; then rerun)"
else
  full=$work/full-size
  mem=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | head -1 || true)
  /usr/bin/time -f "gpu-check: full-size capture: %e s wall, peak RSS %M KiB" \
    .venv/bin/capture --model olmoe --bench mbpp --limit 2 --max-new-tokens 32 \
      --dtype bfloat16 --device cuda --out "$full" --no-progress --output "$work/full-capture.json"
  $py - "$work/full-capture.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"gpu-check: full-size: load {s['load_seconds']:.1f} s, {s['trees']} trees, "
      f"{(s['seconds'] - s['load_seconds']) / max(s['trees'], 1):.3f} s per verification pass, "
      f"{s['bytes_written'] / max(s['trees'], 1) / 2**20:.2f} MiB per tree, tau {s['tau']:.2f}")
PY
  /usr/bin/time -f "gpu-check: full-size replay: %e s wall, peak RSS %M KiB" \
    .venv/bin/replay --traces "$full" --ranking router oracle --budget 8,16,24,32 --device cuda \
      --no-progress
  .venv/bin/report --traces "$full" --out "$work/full-report" >/dev/null
  echo "gpu-check: full-size report written (GPU memory in use before capture: ${mem:-unknown})"
fi
