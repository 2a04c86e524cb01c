#!/usr/bin/env bash
# On a machine with CUDA: capture and replay at real width in bf16, print the capture overhead
# (traced / untraced decoding) and bytes per tree. Skips cleanly (exit 0) without a GPU.
# Random-weight models with the real widths of OLMoE-1B-7B and Qwen3-30B-A3B (two decoder
# layers, built on the fly, never committed); SHAPES=olmoe overrides the list.
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
from capture.run import CaptureSettings, capture_run
from eagle import loading
from eagle.decoding import EagleDecoder
from eagle.fixtures import real_width_pair
from moe import models
from replay import cli as replay_cli
from tasks import benchmarks

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
