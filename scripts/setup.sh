#!/usr/bin/env bash
# One-time set-up, safe to rerun: a virtual environment in .venv with the project installed.
#
#   scripts/setup.sh          # the project only: capture, replay, report, the dashboard (demo.sh)
#   scripts/setup.sh dev      # and the test extras (pytest, selenium, Ray; test.sh)
#   EXTRAS=dev scripts/setup.sh
#
# On a machine without an NVIDIA GPU, torch is installed first as the CPU build
# (torch==2.13.0 is served locally here; set TORCH_PIP_ARGS, e.g. to an --index-url of CPU wheels,
# elsewhere), so that the project's own `torch` requirement pulls no multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-${EXTRAS:-}}  # comma-separated extras of pyproject.toml (dev, ray), or none
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
# already set up for these extras and this pyproject.toml: nothing to do (a rerun takes no time)
stamp="extras=$EXTRAS $(sha256sum pyproject.toml | cut -c1-16)"
if [ -f .venv/.setup-stamp ] && [ "$(cat .venv/.setup-stamp)" = "$stamp" ] \
    && python -c "import torch" 2>/dev/null; then
  exit 0
fi
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.6,<2.15"
  else
    # shellcheck disable=SC2086
    python -m pip install -q "torch==2.13.0" ${TORCH_PIP_ARGS:-}
  fi
fi
if [ -n "$EXTRAS" ]; then
  python -m pip install -q -e ".[$EXTRAS]"
else
  python -m pip install -q -e .
fi
echo "$stamp" > .venv/.setup-stamp
