#!/usr/bin/env bash
# Set up (if needed) and run the tests on the embedded tiny models, offline.
#
#   scripts/test.sh            # the whole suite (the README's command; CI's .ci/run adds -q)
#   scripts/test.sh --fast     # every package's unit tests: the suite less its `slow` tests
#                              # (end to end: captures, servers, fresh processes, bench runs)
#   scripts/test.sh --fast tests/test_policy.py -x   # other arguments go to pytest
#
# The end of the output lists the slowest tests (pytest's --durations), so a test that grows
# slow is seen where it is added.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
export HF_HUB_OFFLINE=1
args=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then
    args+=(-m "not slow")
  else
    args+=("$arg")
  fi
done
exec .venv/bin/python -m pytest --durations=25 ${args[@]+"${args[@]}"}
