#!/usr/bin/env bash
# The main job on the embedded default model, offline: inspect it, then capture real EAGLE
# verification passes into traces/ (rerunning resumes/reuses the same run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
MODEL=${MODEL:-tiny-olmoe}
.venv/bin/inspect-model --model "$MODEL"
.venv/bin/capture --model "$MODEL" --bench mbpp --limit 4 --max-new-tokens 48 --out traces "$@"
