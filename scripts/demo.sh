#!/usr/bin/env bash
# The main job on the embedded default model (offline). Grows into capture -> replay -> report.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/inspect-model --model "${MODEL:-tiny-olmoe}" "$@"
