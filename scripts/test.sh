#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on the embedded tiny models, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
